"""Benchmark client: exact-length prompts and SSE streaming against a small real HTTP server.

The server here is a canned FastAPI app on loopback that speaks the three stream
formats; it tests the client, not lightllm's own server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from canned_server import serve
from lightllm.benchmark.bench_serving import main
from lightllm.benchmark.serving_run import BenchmarkConfig, run_benchmark
from lightllm.benchmark.metrics import read_records_jsonl
from lightllm.benchmark.stream_request import iter_sse_data
from lightllm.benchmark.workloads import WorkloadConfig

# Requested output lengths that make the canned server misbehave in a specific way.
FAIL_HTTP, TRUNCATE, ERROR_EVENT, NO_TEXT, HELD_BACK = 3, 5, 6, 7, 8
CHAT_TEMPLATE_TOKENS = 5
LOGPROB_ONLY = "<logprob-only>"


def _sse(obj: Any) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def make_app(tokenizer, log: list[dict[str, Any]]) -> FastAPI:
    """Canned streams in the lightllm native, completions and chat formats."""
    app = FastAPI()

    def count(text: str) -> int:
        return len(tokenizer(text)["input_ids"])

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/generate_stream")
    async def generate_stream(request: Request):
        body = await request.json()
        log.append({"path": "/generate_stream", **body})
        n = body["parameters"]["max_new_tokens"]
        if n == FAIL_HTTP:
            return JSONResponse({"error": "canned failure"}, status_code=500)

        async def events() -> Iterator[str]:
            yield ": keep-alive comment\n\n"
            for i in range(n):
                if n == ERROR_EVENT and i == 1:
                    yield _sse({"error": {"message": "canned stream error"}})
                    return
                if n == TRUNCATE and i == n - 1:
                    return
                done = i == n - 1
                yield _sse({
                    "token": {"id": i, "text": f" t{i}", "logprob": -0.5, "special": False},
                    "generated_text": "all" if done else None, "finished": done,
                    "finish_reason": "length" if done else None, "details": None,
                })
                await asyncio.sleep(0.001)

        return StreamingResponse(events(), media_type="text/event-stream")

    def openai_stream(n: int, prompt_tokens: int, chat: bool, finish: str = "length"):
        def chunk(text: str | None, finish: str | None = None) -> dict[str, Any]:
            choice = {"index": 0, "finish_reason": finish}
            choice.update({"delta": {} if text is None else {"content": text}} if chat else {"text": text or ""})
            if text == LOGPROB_ONLY:  # a token of no text yet, sent because logprobs were asked for
                choice.update({"text": "", "logprobs": {"tokens": ["\ufffd"], "token_logprobs": [-1.0]}})
            return {"id": "x", "choices": [choice]}

        async def events() -> Iterator[str]:
            if chat:
                yield _sse({"id": "x", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            else:
                yield _sse(chunk(""))  # an empty first chunk is not a token
            # The first chunk carries two tokens, as detokenizers sometimes merge them.
            pieces = ["t0t1"] + [f"t{i}" for i in range(2, n)]
            if n == NO_TEXT:  # every token decodes to no text: only the finish chunk comes
                pieces = [""]
            if n == HELD_BACK:  # a token of no text (logprobs chunk), and a last chunk of no text
                pieces = ["t0t1", "t2", LOGPROB_ONLY, "t4", "t5", "t6", ""]
            for i, piece in enumerate(pieces):
                last = i == len(pieces) - 1
                yield _sse(chunk(piece, finish if last and not chat else None))
                await asyncio.sleep(0.001)
            if chat:
                yield _sse(chunk(None, finish))
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
            yield _sse({"id": "x", "choices": [], "usage": usage})
            yield _sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        log.append({"path": "/v1/completions", **body})
        prompt = body["prompt"]
        prompt_tokens = len(prompt) if isinstance(prompt, list) else count(prompt)
        # A stop sequence ends every completion after its first chunk (two tokens).
        stopped = bool(body.get("stop"))
        return openai_stream(2 if stopped else body["max_tokens"], prompt_tokens, chat=False,
                             finish="stop" if stopped else "length")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        log.append({"path": "/v1/chat/completions", **body})
        prompt_tokens = count(body["messages"][0]["content"]) + CHAT_TEMPLATE_TOKENS
        return openai_stream(body["max_tokens"], prompt_tokens, chat=True)

    return app


@pytest.fixture(scope="module")
def server(tokenizer) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """Run the canned app with uvicorn on a free loopback port; yields (base_url, request log)."""
    log: list[dict[str, Any]] = []
    with serve(make_app(tokenizer, log)) as base_url:
        yield base_url, log


def _config(base_url: str, tokenizer_dir: Path, backend: str, **workload: Any) -> BenchmarkConfig:
    params = {"long_count": 2, "short_count": 3, "long_len": 40, "short_len": 8, "output_len": 4,
              "long_spread_ms": 2.0, "short_start_ms": 5.0, "short_spread_ms": 2.0, **workload}
    return BenchmarkConfig(base_url=base_url, backend=backend, tokenizer=str(tokenizer_dir),
                           workload=WorkloadConfig(**params), show_progress=False)


# ---------------------------------------------------------------- SSE parsing


def test_iter_sse_data_handles_comments_fields_and_multiline() -> None:
    raw = b": hello\n\nevent: message\ndata: {\"a\":\ndata: 1}\n\nid: 7\ndata:[DONE]"

    async def collect() -> list[str]:
        response = httpx.Response(200, stream=httpx.ByteStream(raw))
        return [d async for d in iter_sse_data(response)]

    assert asyncio.run(collect()) == ['{"a":\n1}', "[DONE]"]


def test_lightllm_native_stream(server, tokenizer_dir, tokenizer) -> None:
    base_url, log = server
    log.clear()
    summary = asyncio.run(run_benchmark(_config(base_url, tokenizer_dir, "lightllm")))
    overall = summary["overall"]
    assert (overall["completed"], overall["failed"], overall["output_tokens"]) == (5, 0, 20)
    assert overall["itl_ms"]["count"] == 15 and overall["tpot_ms"]["count"] == 5
    assert summary["model"] is None  # the native API needs no model name
    assert summary["classes"]["long"]["input_tokens"] == 80
    assert len(log) == 5
    for body in log:
        assert body["parameters"] == {"max_new_tokens": 4, "ignore_eos": True}
        assert len(tokenizer(body["inputs"])["input_ids"]) in (40, 8)


def test_openai_completions_text_stream(server, tokenizer_dir, tmp_path) -> None:
    base_url, log = server
    log.clear()
    config = _config(base_url, tokenizer_dir, "openai-completions", output_len=6)
    config.output_jsonl = str(tmp_path / "records.jsonl")
    summary = asyncio.run(run_benchmark(config))
    assert summary["model"] == "fake-model"  # from GET /v1/models
    records = read_records_jsonl(config.output_jsonl)
    assert len(records) == 5 and all(r.success for r in records)
    for r in records:
        assert r.output_tokens == 6  # usage wins over the 5 text chunks seen
        assert len(r.token_times) == 5 and r.first_token_time == r.token_times[0]
        assert r.prompt_tokens == (40 if r.request_class == "long" else 8)
        assert r.send_time <= r.first_token_time <= r.end_time
    body = log[0]
    assert body["model"] == "fake-model" and body["stream"] is True and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True} and body["max_tokens"] == 6


def test_a_stream_whose_tokens_have_no_text_counts_its_finish_as_the_first_token(server, tokenizer_dir, tmp_path) -> None:
    base_url, _ = server
    for backend in ("openai-completions", "openai-chat"):
        config = _config(base_url, tokenizer_dir, backend, output_len=NO_TEXT)
        config.output_jsonl = str(tmp_path / f"{backend}.jsonl")
        asyncio.run(run_benchmark(config))
        records = read_records_jsonl(config.output_jsonl)
        assert len(records) == 5 and all(r.success for r in records), [r.error for r in records]
        for r in records:
            assert r.output_tokens == NO_TEXT and len(r.token_times) == 1
            assert r.send_time <= r.first_token_time <= r.end_time


def test_every_chunk_with_output_is_stamped_and_e2e_ends_at_the_last_one(server, tokenizer_dir, tmp_path) -> None:
    # A chunk merging two tokens is one stamp; a chunk of no text is one when it carries a token
    # (logprobs) or the finish.  E2E ends there, not at the usage chunk or [DONE] after it.
    base_url, _ = server
    config = _config(base_url, tokenizer_dir, "openai-completions", output_len=HELD_BACK)
    config.output_jsonl = str(tmp_path / "records.jsonl")
    summary = asyncio.run(run_benchmark(config))
    records = read_records_jsonl(config.output_jsonl)
    assert len(records) == 5 and all(r.success for r in records), [r.error for r in records]
    for r in records:
        assert r.output_tokens == HELD_BACK and len(r.token_times) == 7
        assert r.first_token_time == r.token_times[0] and r.end_time == r.token_times[-1]
    assert summary["overall"]["itl_ms"]["count"] == 5 * 6


def test_openai_completions_token_id_prompts(server, tokenizer_dir, builder) -> None:
    base_url, log = server
    log.clear()
    config = dataclasses.replace(_config(base_url, tokenizer_dir, "openai-completions"), prompt_format="ids")
    summary = asyncio.run(run_benchmark(config, builder))
    assert summary["overall"]["completed"] == 5
    prompts = sorted((body["prompt"] for body in log), key=len)
    assert [len(p) for p in prompts] == [8, 8, 8, 40, 40]
    assert all(isinstance(t, int) for p in prompts for t in p)


def test_openai_chat_stream(server, tokenizer_dir) -> None:
    base_url, log = server
    log.clear()
    config = _config(base_url, tokenizer_dir, "openai-chat", output_len=3)
    config.extra_body = {"temperature": 0.0}
    summary = asyncio.run(run_benchmark(config))
    assert summary["overall"]["completed"] == 5 and summary["overall"]["output_tokens"] == 15
    # The server reports the templated prompt length, and the record keeps it.
    assert summary["classes"]["short"]["input_tokens"] == 3 * (8 + CHAT_TEMPLATE_TOKENS)
    body = log[0]
    assert body["messages"][0]["role"] == "user" and body["temperature"] == 0.0


@pytest.mark.parametrize(
    ("long_output_len", "error"),
    [(FAIL_HTTP, "HTTP 500"), (TRUNCATE, "before the response was complete"), (ERROR_EVENT, "canned stream error")],
)
def test_failed_requests_are_counted_and_excluded(server, tokenizer_dir, long_output_len, error) -> None:
    base_url, _ = server
    config = _config(base_url, tokenizer_dir, "lightllm", long_output_len=long_output_len)
    summary = asyncio.run(run_benchmark(config))
    assert summary["classes"]["long"]["failed"] == 2 and summary["classes"]["long"]["completed"] == 0
    assert summary["classes"]["long"]["ttft_ms"]["count"] == 0
    assert summary["overall"]["completed"] == 3 and summary["overall"]["ttft_ms"]["count"] == 3
    [(message, count)] = summary["errors"].items()
    assert error in message and count == 2


def test_max_concurrency_bounds_in_flight_requests(server, tokenizer_dir, tmp_path) -> None:
    base_url, _ = server
    config = _config(base_url, tokenizer_dir, "lightllm", long_count=0, short_count=8, short_start_ms=0.0)
    config.max_concurrency = 2
    config.output_jsonl = str(tmp_path / "records.jsonl")
    asyncio.run(run_benchmark(config))
    records = read_records_jsonl(config.output_jsonl)
    assert all(r.success for r in records)
    for r in records:
        overlapping = sum(o.send_time <= r.send_time < o.end_time for o in records)
        assert overlapping <= 2


def test_config_validation(tokenizer_dir) -> None:
    with pytest.raises(ValueError, match="prompt_format"):
        BenchmarkConfig(backend="lightllm", prompt_format="ids").validate()
    with pytest.raises(ValueError, match="backend"):
        BenchmarkConfig(backend="tgi").validate()
    with pytest.raises(ValueError, match="max_concurrency"):
        BenchmarkConfig(max_concurrency=0).validate()
    with pytest.raises(ValueError, match="tokenizer"):
        asyncio.run(run_benchmark(BenchmarkConfig(tokenizer=str(tokenizer_dir / "missing"))))


def test_cli_end_to_end_with_warmup(server, tokenizer_dir, tmp_path, capsys) -> None:
    base_url, log = server
    log.clear()
    records_path, summary_path = tmp_path / "r.jsonl", tmp_path / "s.json"
    status = main([
        "--base-url", base_url, "--backend", "openai-completions", "--tokenizer", str(tokenizer_dir),
        "--workload", "interleaved", "--num-requests", "8", "--request-rate", "1000", "--long-every", "4",
        "--long-len", "24", "--short-len", "6", "--output-len", "3", "--seed", "4", "--slo", "ttft:60000",
        "--warmup-runs", "1", "--output-jsonl", str(records_path), "--output-json", str(summary_path),
        "--no-progress",
    ])
    assert status == 0
    assert len(log) == 16  # one warm-up round plus the measured round
    warmup_prompts = {body["prompt"] for body in log[:8]}
    measured_prompts = {body["prompt"] for body in log[8:]}
    assert not warmup_prompts & measured_prompts  # warm-up must not pre-fill the prefix cache
    summary = json.loads(summary_path.read_text())
    assert summary["overall"]["completed"] == 8 and summary["classes"]["long"]["requests"] == 2
    assert summary["overall"]["slo_met"] == 8
    assert summary["config"]["workload"]["name"] == "interleaved"
    assert len(read_records_jsonl(records_path)) == 8
    assert summary["overall"]["output_len_mismatch"] == 0
    out = capsys.readouterr().out
    assert "ttft_ms p50" in out and "warning" not in out


def test_cli_warns_about_requests_that_ended_before_their_length(server, tokenizer_dir, tmp_path, capsys) -> None:
    base_url, _ = server
    summary_path = tmp_path / "s.json"
    status = main([
        "--base-url", base_url, "--tokenizer", str(tokenizer_dir), "--long-count", "1", "--short-count", "2",
        "--long-len", "24", "--short-len", "6", "--output-len", "5", "--extra-body", '{"stop": ["t2"]}',
        "--output-json", str(summary_path), "--no-progress",
    ])
    assert status == 0  # a stop sequence may be what the user wants measured: it is reported, not refused
    summary = json.loads(summary_path.read_text())
    assert summary["overall"]["output_len_mismatch"] == 3 and summary["classes"]["long"]["output_len_mismatch"] == 1
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: 3 of 3 completed requests generated a different number of output tokens than "
                        "requested (finish_reason stop x3: a stop sequence, or EOS when it is not ignored); their "
                        "latencies are not those of the requested lengths"]
    assert summary["overall"]["output_len_mismatch_finish_reasons"] == {"stop": 3}


def test_cli_rejects_bad_arguments(tokenizer_dir) -> None:
    with pytest.raises(SystemExit):
        main(["--tokenizer", str(tokenizer_dir), "--slo", "speed:3"])
    with pytest.raises(SystemExit):
        main(["--tokenizer", str(tokenizer_dir), "--backend", "lightllm", "--prompt-format", "ids"])
