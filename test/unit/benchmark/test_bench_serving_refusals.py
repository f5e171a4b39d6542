"""bench_serving refuses, in one line (exit 2) before it sends anything, a run that would not measure
what it reports: a prompt the builder cannot make, a request longer than the context the server
reports, and an --extra-body key that would replace what the benchmark sets itself.

The tester's repros: ``--short-len 1`` and ``--shared-prefix-len 100`` (with 64/8-token prompts)
ended in a ValueError traceback; ``--long-len 1020 --output-len 10`` on a 1024-token server exited 0
with 4-token outputs; ``--extra-body '{"max_tokens": 1}'`` exited 0 with 1-token outputs.  No server
is started here: the server's answers are stand-ins.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from cli_refusal_support import one_line_refusal
from lightllm.benchmark import bench_serving, server_probe
from lightllm.benchmark.serving_run import BenchmarkConfig
from lightllm.benchmark.context_limit import ContextLimit
from lightllm.benchmark.server_probe import served_context
from lightllm.benchmark.workloads import WorkloadConfig

URL = "http://127.0.0.1:9"


def _never(*_args: Any, **_kwargs: Any) -> None:
    raise AssertionError("a request was about to be sent")


@pytest.fixture
def no_send(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server answers; nothing may be sent."""
    monkeypatch.setattr(bench_serving, "check_reachable", lambda *_args: None)
    monkeypatch.setattr(bench_serving, "_run_cli", _never)


def _argv(tokenizer: Path, *extra: str) -> list[str]:
    return ["--base-url", URL, "--model", "m", "--tokenizer", str(tokenizer), "--no-progress",
            "--long-count", "2", "--short-count", "2", *extra]


def _serves_context(monkeypatch: pytest.MonkeyPatch, tokens: int | None) -> None:
    limit = None if tokens is None else ContextLimit(tokens, f"max_model_len of model 'm' in {URL}/v1/models",
                                                     "the server's context")
    monkeypatch.setattr(bench_serving, "served_context", lambda *_args: limit)


# --- prompts the builder cannot make (finding 2) ---------------------------------------------------


@pytest.mark.parametrize("extra, flag", [
    (["--long-len", "8", "--short-len", "1", "--output-len", "2"], "--short-len"),
    (["--long-len", "1", "--short-len", "8", "--output-len", "2"], "--long-len"),
])
def test_a_prompt_with_no_room_for_content_is_refused(tiny_llama_dir, monkeypatch, capsys, no_send, extra, flag):
    _serves_context(monkeypatch, None)
    line = one_line_refusal(bench_serving.main, _argv(tiny_llama_dir, *extra), capsys)
    assert f"of 1 prompt tokens ({flag}), which leaves no room for content" in line, line
    assert "so a prompt needs at least 2 tokens" in line and f"raise {flag} (" in line


def test_a_shared_prefix_longer_than_a_prompt_is_refused(tiny_llama_dir, monkeypatch, capsys, no_send):
    _serves_context(monkeypatch, None)
    argv = _argv(tiny_llama_dir, "--long-len", "64", "--short-len", "8", "--output-len", "4",
                 "--shared-prefix-len", "100")
    line = one_line_refusal(bench_serving.main, argv, capsys)
    assert line.startswith("error: --shared-prefix-len 100 leaves no token of its own to a short request of 8 prompt "
                           "tokens (--short-len)"), line
    assert "lower --shared-prefix-len below 7 or raise --short-len" in line
    # The largest prefix the shortest prompt holds is accepted.
    argv[argv.index("100")] = "6"
    with pytest.raises(AssertionError, match="about to be sent"):
        bench_serving.main(argv)


# --- requests longer than the server's context (finding 3) -----------------------------------------


def test_a_request_the_server_would_cut_is_refused_before_the_tokenizer_loads(tiny_llama_dir, monkeypatch, capsys,
                                                                              no_send):
    _serves_context(monkeypatch, 1024)
    monkeypatch.setattr(bench_serving, "load_tokenizer", _never)
    argv = _argv(tiny_llama_dir, "--long-len", "1020", "--short-len", "8", "--output-len", "10")
    line = one_line_refusal(bench_serving.main, argv, capsys)
    assert line.startswith("error: --workload long_first has a long request of 1020 prompt tokens (--long-len) plus "
                           "10 output tokens (--output-len), 1030 in all, more than the server's context of 1024 "
                           f"(max_model_len of model 'm' in {URL}/v1/models); the server would cut such a request's "
                           "output to 4 tokens"), line
    assert ": lower --long-len or --output-len (" in line


def test_a_request_the_server_would_refuse_is_refused(tiny_llama_dir, monkeypatch, capsys, no_send):
    _serves_context(monkeypatch, 1024)
    line = one_line_refusal(bench_serving.main, _argv(tiny_llama_dir, "--long-len", "2000", "--output-len", "4"), capsys)
    assert "every such request would fail with HTTP 400: lower --long-len or --output-len" in line, line


def test_requests_that_fit_the_server_s_context_go_on(tiny_llama_dir, monkeypatch, no_send):
    _serves_context(monkeypatch, 1024)
    with pytest.raises(AssertionError, match="about to be sent"):
        bench_serving.main(_argv(tiny_llama_dir, "--long-len", "1014", "--short-len", "8", "--output-len", "10"))


def _answers(monkeypatch: pytest.MonkeyPatch, status: int, body: Any) -> list[str]:
    asked: list[str] = []

    def get(url: str, **_kwargs: Any) -> httpx.Response:
        asked.append(url)
        return httpx.Response(status, json=body)

    monkeypatch.setattr(server_probe.httpx, "get", get)
    return asked


def test_the_context_is_the_max_model_len_the_server_lists_for_the_model(monkeypatch):
    listing = {"object": "list", "data": [{"id": "a", "max_model_len": 2048}, {"id": "b", "max_model_len": 1024}]}
    asked = _answers(monkeypatch, 200, listing)
    assert served_context(URL + "/", "b") == ContextLimit(1024, f"max_model_len of model 'b' in {URL}/v1/models",
                                                          "the server's context")
    assert served_context(URL, None).tokens == 2048  # no --model: the first, the one the requests name
    assert asked == [URL + "/v1/models"] * 2


@pytest.mark.parametrize("status, body", [
    (404, {"detail": "Not Found"}),
    (200, {"data": [{"id": "a"}]}),
    (200, {"data": [{"id": "a", "max_model_len": 0}]}),
    (200, {"data": [{"id": "a", "max_model_len": "1024"}]}),
    (200, {"data": []}),
    (200, ["not", "an", "object"]),
])
def test_a_server_that_reports_no_context_is_not_checked(monkeypatch, status, body):
    _answers(monkeypatch, status, body)
    assert served_context(URL, "a") is None


def test_a_name_the_server_does_not_list_gets_the_context_of_its_only_model(monkeypatch):
    # Our server also takes its checkpoint path as the model name; the context check was skipped
    # for it (the lookup by id missed), and an over-long workload ran and had its output cut.
    _answers(monkeypatch, 200, {"data": [{"id": "small", "max_model_len": 1024}]})
    limit = served_context(URL, "/models/small")
    assert limit == ContextLimit(1024, f"max_model_len of model 'small' in {URL}/v1/models", "the server's context")


def test_a_name_none_of_several_listed_models_has_is_refused(monkeypatch):
    _answers(monkeypatch, 200, {"data": [{"id": "a", "max_model_len": 2048}, {"id": "b", "max_model_len": 1024}]})
    with pytest.raises(server_probe.UnknownModel) as unknown:
        served_context(URL, "c")
    assert str(unknown.value) == f"model 'c' is none of the models {URL}/v1/models lists ('a', 'b'); name one of them"


def test_bench_serving_refuses_an_unlisted_model_up_front(tiny_llama_dir, monkeypatch, capsys, no_send):
    _answers(monkeypatch, 200, {"data": [{"id": "a", "max_model_len": 2048}, {"id": "b", "max_model_len": 1024}]})
    monkeypatch.setattr(bench_serving, "load_tokenizer", _never)
    argv = _argv(tiny_llama_dir, "--long-len", "64", "--short-len", "8", "--output-len", "4")  # --model m
    line = one_line_refusal(bench_serving.main, argv, capsys)
    assert line.startswith(f"error: --model 'm' is none of the models {URL}/v1/models lists ('a', 'b'); "
                           "name one of them"), line


def test_the_native_backend_sends_no_model_name_so_none_is_refused(tiny_llama_dir, monkeypatch, capsys, no_send):
    # --backend lightllm never sends --model: the first listed model's context is checked instead.
    _answers(monkeypatch, 200, {"data": [{"id": "a", "max_model_len": 1024}, {"id": "b", "max_model_len": 4096}]})
    argv = _argv(tiny_llama_dir, "--backend", "lightllm", "--long-len", "1020", "--short-len", "8",
                 "--output-len", "10")  # --model m
    line = one_line_refusal(bench_serving.main, argv, capsys)
    assert "more than the server's context of 1024 (max_model_len of model 'a'" in line, line


def test_bench_serving_checks_an_alias_against_the_only_model_s_context(tiny_llama_dir, monkeypatch, capsys, no_send):
    _answers(monkeypatch, 200, {"data": [{"id": "small", "max_model_len": 1024}]})
    argv = _argv(tiny_llama_dir, "--long-len", "1020", "--short-len", "8", "--output-len", "10")  # --model m
    line = one_line_refusal(bench_serving.main, argv, capsys)
    assert "more than the server's context of 1024 (max_model_len of model 'small'" in line, line
    # A workload that fits goes on with the name as given: the server decides whether it takes it.
    argv = _argv(tiny_llama_dir, "--long-len", "1010", "--short-len", "8", "--output-len", "10")
    with pytest.raises(AssertionError, match="about to be sent"):
        bench_serving.main(argv)


# --- --extra-body keys the benchmark sets itself (finding 6) ---------------------------------------


@pytest.mark.parametrize("backend, body, keys", [
    ("openai-completions", '{"max_tokens": 1}', "max_tokens"),
    ("openai-completions", '{"temperature": 0, "prompt": "x", "stream": false}', "prompt, stream"),
    ("openai-chat", '{"max_completion_tokens": 1}', "max_completion_tokens"),
    ("openai-chat", '{"model": "other"}', "model"),
    ("lightllm", '{"max_new_tokens": 1}', "max_new_tokens"),
    ("lightllm", '{"ignore_eos": false}', "ignore_eos"),
])
def test_extra_body_keys_the_benchmark_sets_are_refused(tiny_llama_dir, capsys, no_send, backend, body, keys):
    argv = _argv(tiny_llama_dir, "--backend", backend, "--long-len", "64", "--short-len", "8", "--output-len", "4",
                 "--extra-body", body)
    line = one_line_refusal(bench_serving.main, argv, capsys)
    assert line.startswith(f"error: --extra-body must not set {keys}: the benchmark sets"), line
    assert f"for backend {backend}" in line


def test_other_extra_body_keys_are_sent():
    config = BenchmarkConfig(tokenizer="/t", workload=WorkloadConfig(), extra_body={"temperature": 0.5, "top_k": 4})
    config.validate()
    # The native API nests its parameters: "model" there is no field the benchmark sets.
    BenchmarkConfig(backend="lightllm", extra_body={"model": "x", "max_tokens": 2}).validate()


@pytest.mark.parametrize("backend, body, keys", [
    ("openai-completions", '{"n": 2}', "n"),
    ("openai-chat", '{"best_of": 2, "temperature": 0}', "best_of"),
    ("lightllm", '{"n": 2, "best_of": 3}', "n, best_of"),
])
def test_extra_body_keys_that_ask_for_several_generations_are_refused(tiny_llama_dir, capsys, no_send, backend, body,
                                                                       keys):
    # {"n": 2} streamed two generations interleaved as one request: 16 output tokens for 8 asked.
    argv = _argv(tiny_llama_dir, "--backend", backend, "--long-len", "64", "--short-len", "8", "--output-len", "4",
                 "--extra-body", body)
    line = one_line_refusal(bench_serving.main, argv, capsys)
    assert line.startswith(f"error: --extra-body must not set {keys}: the benchmark measures one generation per "
                           "request"), line


# --- flags whose value the run would throw away -----------------------------------------------------


@pytest.mark.parametrize("extra, message", [
    (["--seed", "1", "--seed", "2"], "--seed is given twice; give it once, with all its values"),
    (["--slo", "ttft:5000", "--slo", "tpot:1"], "--slo is given twice"),
    (["--slo", "ttft:5000", "TTFT:1"], "--slo names 'ttft' twice; name each once"),
    (["--slo"], "argument --slo: expected at least one argument"),
    (["--long-output-len", "5", "--short-output-len", "5", "--output-len", "7"],
     "--output-len does not apply when --long-output-len and --short-output-len are both given"),
])
def test_a_flag_whose_value_would_be_thrown_away_is_refused(tiny_llama_dir, capsys, no_send, extra, message):
    line = one_line_refusal(bench_serving.main, _argv(tiny_llama_dir, "--long-len", "64", "--short-len", "8", *extra),
                            capsys)
    assert line.startswith(f"error: {message}"), line


def test_output_len_still_sets_the_class_without_a_length_of_its_own(tiny_llama_dir, no_send):
    with pytest.raises(AssertionError, match="about to be sent"):
        bench_serving.main(_argv(tiny_llama_dir, "--long-len", "64", "--short-len", "8", "--long-output-len", "5",
                                 "--output-len", "7", "--slo", "ttft:500", "tpot:50"))


@pytest.mark.parametrize("status, message", [
    (401, "HTTP 401: Invalid API key"),
    (500, "HTTP 500: Invalid API key"),
])
def test_a_server_that_refuses_the_listing_refuses_the_run(monkeypatch, status, message):
    _answers(monkeypatch, status, {"error": {"message": "Invalid   API key", "type": "authentication_error"}})
    with pytest.raises(server_probe.ServerRefused) as refused:
        served_context(URL + "/", "a")
    assert str(refused.value) == f"the server at {URL} refused /v1/models: {message}"


@pytest.mark.parametrize("body, message", [
    ({"detail": "Not allowed"}, "Not allowed"),
    ({"error": "plain"}, "plain"),
    ({"detail": [{"loc": ["x"]}]}, '[{"loc": ["x"]}]'),
    ("<html>\nForbidden\n</html>", "<html> Forbidden </html>"),
    ("", "Forbidden"),
])
def test_the_server_s_error_message_is_read_from_any_body(body, message):
    response = (httpx.Response(403, json=body) if isinstance(body, dict)
                else httpx.Response(403, content=body.encode()))
    assert server_probe.http_refusal(response) == f"HTTP 403: {message}"
