"""bench_serving and bench_burst against a server started with ``--api_key``, and the server's own error
messages in their one-line errors.

The tester's repros: against a keyed server bench_serving printed "cannot reach the server ... Client
error '401 Unauthorized' ..." on two lines, the server's message dropped; with ``--backend lightllm``
it sent every request to a 401 and skipped the context check.  bench_burst's ``--prompt-len 5000``
against a 4096-token server ended with "Client error '400 Bad Request' ...", the server's reason
dropped.  The server here is a canned app that answers like ours (OpenAI error bodies).
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from canned_server import require_key, serve
from lightllm.benchmark import bench_burst, bench_serving

KEY = "k-123"
CONTEXT = 4096


def _error(message: str, status: int) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                   "code": None}}, status_code=status)


def make_app(log: list[dict[str, Any]]) -> FastAPI:
    """Every path needs ``Authorization: Bearer KEY``; a prompt past CONTEXT is answered 400."""
    app = FastAPI()
    require_key(app, KEY, log, "Missing API key: send it as 'Authorization: Bearer <key>'")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": CONTEXT}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if len(body["prompt"]) + body["max_tokens"] > CONTEXT:
            return _error(f"This model's maximum context length is {CONTEXT} tokens. However, the prompt holds "
                          f"{len(body['prompt'])} tokens.", 400)
        n = body["max_tokens"]
        if not body.get("stream"):
            return {"id": "x", "choices": [{"index": 0, "text": "t" * n, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}}

        async def events() -> Iterator[str]:
            for i in range(n):
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f't{i}', 'finish_reason': None}]})}\n\n"
            yield f"data: {json.dumps({'choices': [{'index': 0, 'text': '', 'finish_reason': 'length'}]})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/generate_stream")
    async def generate_stream(request: Request):
        n = (await request.json())["parameters"]["max_new_tokens"]

        async def events() -> Iterator[str]:
            for i in range(n):
                yield f"data: {json.dumps({'token': {'id': i, 'text': 't'}, 'finished': i == n - 1})}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def keyed_server() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """(base URL, log of every request's path and Authorization header)."""
    log: list[dict[str, Any]] = []
    with serve(make_app(log)) as base_url:
        yield base_url, log


@pytest.fixture(autouse=True)
def no_key_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)


def _one_error_line(main, argv: list[str], capsys) -> str:
    """Run ``main``: it must return 1 and print exactly one stderr line, ``error: ...``."""
    capsys.readouterr()
    status = main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert status == 1 and len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0], err
    return err[0]


def _serving_argv(base_url: str, tokenizer_dir, *extra: str) -> list[str]:
    return ["--base-url", base_url, "--tokenizer", str(tokenizer_dir), "--no-progress", "--long-count", "1",
            "--short-count", "2", "--long-len", "24", "--short-len", "6", "--output-len", "3", *extra]


@pytest.mark.parametrize("extra", [(), ("--backend", "lightllm"), ("--model", "m")])
def test_bench_serving_without_the_key_names_the_server_s_refusal(keyed_server, tokenizer_dir, capsys, extra):
    base_url, _ = keyed_server
    line = _one_error_line(bench_serving.main, _serving_argv(base_url, tokenizer_dir, *extra), capsys)
    assert line == (f"error: the server at {base_url} refused /v1/models: HTTP 401: Missing API key: send it as "
                    "'Authorization: Bearer <key>'")


@pytest.mark.parametrize("backend", ["openai-completions", "lightllm"])
def test_bench_serving_sends_the_key_with_every_request_and_records_none(keyed_server, tokenizer_dir, tmp_path,
                                                                         backend):
    base_url, log = keyed_server
    log.clear()
    summary_path = tmp_path / "s.json"
    argv = _serving_argv(base_url, tokenizer_dir, "--backend", backend, "--api-key", KEY,
                         "--output-json", str(summary_path))
    assert bench_serving.main(argv) == 0
    summary = json.loads(summary_path.read_text())
    assert summary["overall"]["completed"] == 3
    assert KEY not in summary_path.read_text() and summary["config"]["api_key"] == "<given>"
    sent = [entry for entry in log if entry["path"] != "/"]
    assert len(sent) >= 4 and all(entry["authorization"] == f"Bearer {KEY}" for entry in sent), log


def test_bench_serving_reads_the_key_from_openai_api_key(keyed_server, tokenizer_dir, monkeypatch, capsys):
    base_url, _ = keyed_server
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    assert bench_serving.main(_serving_argv(base_url, tokenizer_dir)) == 0
    # An empty --api-key sends none, whatever the environment holds.
    line = _one_error_line(bench_serving.main, _serving_argv(base_url, tokenizer_dir, "--api-key", ""), capsys)
    assert "refused /v1/models: HTTP 401" in line
    monkeypatch.setenv("OPENAI_API_KEY", "wrong")
    assert "refused /v1/models: HTTP 401" in _one_error_line(bench_serving.main,
                                                              _serving_argv(base_url, tokenizer_dir), capsys)


def _burst_argv(base_url: str, *extra: str, prompt_len: int = 8) -> list[str]:
    return ["--base-url", base_url, "--num-requests", "2", "--rounds", "1", "--prompt-len", str(prompt_len),
            "--output-len", "2", *extra]


@pytest.mark.parametrize("extra", [(), ("--model", "m")])
def test_bench_burst_without_the_key_names_the_server_s_refusal(keyed_server, capsys, extra):
    base_url, _ = keyed_server
    line = _one_error_line(bench_burst.main, _burst_argv(base_url, *extra), capsys)
    assert line == (f"error: the server at {base_url} refused /v1/models: HTTP 401: Missing API key: send it as "
                    "'Authorization: Bearer <key>'")


def test_bench_burst_sends_the_key_and_records_none(keyed_server, tmp_path, monkeypatch, capsys):
    base_url, log = keyed_server
    log.clear()
    out = tmp_path / "burst.json"
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    assert bench_burst.main(_burst_argv(base_url, "--output-json", str(out))) == 0
    assert [entry["authorization"] for entry in log] == [f"Bearer {KEY}"] * 3  # the probe and two requests
    assert KEY not in out.read_text() and json.loads(out.read_text())["args"]["api_key"] == "<given>"
    assert "round 0: 4 tokens" in capsys.readouterr().out


def test_bench_burst_shows_the_server_s_reason_for_a_400(keyed_server, capsys):
    base_url, _ = keyed_server
    line = _one_error_line(bench_burst.main, _burst_argv(base_url, "--api-key", KEY, prompt_len=5000), capsys)
    assert line == (f"error: round 0 failed against {base_url}: HTTP 400: This model's maximum context length is "
                    "4096 tokens. However, the prompt holds 5000 tokens.")


@pytest.mark.parametrize("listing", ["[1, 2]", "<html>proxy</html>", '{"data": "m"}', '{"data": [1]}'])
def test_bench_serving_names_a_model_list_that_is_not_one(listing, tokenizer_dir, capsys):
    """Another service on the port (a proxy's page, a list): a TypeError/JSON traceback before."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> Response:
        return Response(listing, media_type="application/json")

    with serve(app) as base_url:
        line = _one_error_line(bench_serving.main, _serving_argv(base_url, tokenizer_dir), capsys)
    assert f"{base_url}/v1/models lists no model" in line and "pass --model explicitly" in line, line
