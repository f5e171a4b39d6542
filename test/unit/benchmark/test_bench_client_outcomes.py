"""What the benchmark client makes of how a response ends and of the counts a server reports.

Against a canned HTTP server on loopback (not lightllm's own) whose streams end the ways the
tester's fake server ended them (/tmp/s59/bench/mock.py): a native finish event that carries no
token (``"id": -1``, sent on an abort), an ``abort`` finish reason, and an OpenAI stream without
a usage chunk whose chunks pack two tokens each.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Iterator

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from canned_server import serve
from lightllm.benchmark.backends import LightLLMBackend, StreamState
from lightllm.benchmark.bench_serving import main
from lightllm.benchmark.serving_run import BenchmarkConfig, run_benchmark
from lightllm.benchmark.metrics import format_summary, read_records_jsonl
from lightllm.benchmark.workloads import WorkloadConfig

# Requested output lengths that pick how the canned server ends a response.
TOKENLESS_FINISH, ABORT, NO_USAGE = 6, 5, 8
# Each chunk of a NO_USAGE stream: text the test tokenizer splits into more than one token.
PACKED_PIECE = " hello world"


def _sse(obj: Any) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def make_app(log: list[dict[str, Any]]) -> FastAPI:
    """Native and completions streams that end as the requested length says."""
    app = FastAPI()

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/generate_stream")
    async def generate_stream(request: Request):
        n = (await request.json())["parameters"]["max_new_tokens"]

        def event(token_id: int, count: int, finish: str | None) -> str:
            token = {"id": token_id, "text": "" if token_id < 0 else f" t{count}", "special": token_id < 0,
                     "count_output_tokens": count}
            return _sse({"token": token, "generated_text": None, "finished": finish is not None,
                         "finish_reason": finish, "details": None})

        async def events() -> Iterator[str]:
            sent = 2 if n == ABORT else n
            for i in range(sent):
                last = i == sent - 1 and n not in (TOKENLESS_FINISH, ABORT)
                yield event(7, i + 1, "length" if last else None)
                await asyncio.sleep(0.001)
            if n in (TOKENLESS_FINISH, ABORT):
                # As the server does when it ends a request with nothing more to send.
                yield event(-1, sent, "abort" if n == ABORT else "length")

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        log.append(body)
        n = body["max_tokens"]

        def chunk(text: str, finish: str | None = None) -> str:
            return _sse({"id": "x", "choices": [{"index": 0, "text": text, "finish_reason": finish}]})

        async def events() -> Iterator[str]:
            if n == ABORT:
                yield chunk(" t0")
                yield chunk("", "abort")
                yield _sse({"id": "x", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}})
            elif n == NO_USAGE:
                for i in range(n // 2):  # two tokens a chunk, and no usage chunk at all
                    yield chunk(PACKED_PIECE, "length" if i == n // 2 - 1 else None)
                    await asyncio.sleep(0.001)
            else:
                for i in range(n):
                    yield chunk(f" t{i}", "length" if i == n - 1 else None)
                yield _sse({"id": "x", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": n}})
            yield _sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    log: list[dict[str, Any]] = []
    with serve(make_app(log)) as base_url:
        yield base_url, log


def _run(base_url: str, tokenizer_dir: Path, tmp_path: Path, backend: str, **workload: Any):
    params = {"long_count": 2, "short_count": 3, "long_len": 40, "short_len": 8, "output_len": 4,
              "long_spread_ms": 2.0, "short_start_ms": 5.0, "short_spread_ms": 2.0, **workload}
    config = BenchmarkConfig(base_url=base_url, backend=backend, tokenizer=str(tokenizer_dir),
                             workload=WorkloadConfig(**params), show_progress=False,
                             output_jsonl=str(tmp_path / "records.jsonl"))
    summary = asyncio.run(run_benchmark(config))
    return summary, read_records_jsonl(config.output_jsonl)


def test_a_native_finish_without_a_token_adds_no_token(server, tokenizer_dir, tmp_path) -> None:
    summary, records = _run(server[0], tokenizer_dir, tmp_path, "lightllm", output_len=TOKENLESS_FINISH)
    assert all(r.success for r in records), [r.error for r in records]
    for r in records:
        # Six tokens, six stamps, and E2E ends at the last token, not at the finish event after it.
        assert r.output_tokens == TOKENLESS_FINISH and len(r.token_times) == TOKENLESS_FINISH
        assert r.end_time == r.token_times[-1]
        assert (r.finish_reason, r.output_tokens_source) == ("length", "server")
    assert summary["overall"]["itl_ms"]["count"] == 5 * (TOKENLESS_FINISH - 1)
    assert summary["overall"]["output_len_mismatch"] == 0


@pytest.mark.parametrize("backend", ["lightllm", "openai-completions"])
def test_an_aborted_request_is_a_failure_kept_out_of_the_statistics(server, tokenizer_dir, tmp_path, backend) -> None:
    summary, records = _run(server[0], tokenizer_dir, tmp_path, backend, long_output_len=ABORT)
    aborted = [r for r in records if r.request_class == "long"]
    assert [r.finish_reason for r in aborted] == ["abort", "abort"]
    assert all(not r.success and "finish_reason 'abort'" in r.error for r in aborted)
    assert all(r.success and r.finish_reason == "length" for r in records if r.request_class == "short")
    overall = summary["overall"]
    assert (overall["completed"], overall["failed"], overall["ttft_ms"]["count"]) == (3, 2, 3)
    assert summary["classes"]["long"]["completed"] == 0 and summary["classes"]["long"]["e2e_ms"]["count"] == 0
    assert summary["errors"] == {"the server gave up on the request (finish_reason 'abort')": 2}
    assert overall["output_len_mismatch"] == 0  # a failure is not a completed request of another length


def test_without_usage_the_generated_text_is_counted_with_the_tokenizer(server, tokenizer_dir, tokenizer,
                                                                       tmp_path) -> None:
    summary, records = _run(server[0], tokenizer_dir, tmp_path, "openai-completions", output_len=NO_USAGE)
    expected = len(tokenizer(PACKED_PIECE * (NO_USAGE // 2), add_special_tokens=False)["input_ids"])
    chunks = NO_USAGE // 2
    assert expected != chunks  # the old fallback, one token a chunk, would differ
    assert all(r.success for r in records), [r.error for r in records]
    for r in records:
        assert len(r.token_times) == chunks
        assert (r.output_tokens, r.output_tokens_source) == (expected, "tokenizer")
    assert summary["overall"]["output_tokens"] == 5 * expected
    assert summary["overall"]["output_tokens_from_tokenizer"] == 5
    assert "generated_text" not in (tmp_path / "records.jsonl").read_text()  # kept in memory only
    note = [line for line in format_summary(summary).splitlines() if line.startswith("note:")]
    assert note == ["note: the server reported no output token count for 5 of 5 completed requests; their output "
                    "tokens are the generated text counted by the client's tokenizer (records: output_tokens_source "
                    "\"tokenizer\"), which can differ from the tokens the server generated"]


def test_a_server_s_usage_count_is_used_and_said_so(server, tokenizer_dir, tmp_path) -> None:
    summary, records = _run(server[0], tokenizer_dir, tmp_path, "openai-completions")
    assert all(r.output_tokens_source == "server" and r.output_tokens == 4 for r in records)
    assert summary["overall"]["output_tokens_from_tokenizer"] == 0
    assert "note:" not in format_summary(summary)


def test_warm_up_prompts_share_no_prefix_with_the_measured_ones(server, tokenizer_dir, tmp_path) -> None:
    # --shared-prefix-len gave the warm-up pass the measured pass's prefix (same seed), so the
    # warm-up filled the prefix cache the measured prompts then hit.
    base_url, log = server
    log.clear()
    status = main(["--base-url", base_url, "--tokenizer", str(tokenizer_dir), "--prompt-format", "ids",
                   "--workload", "interleaved", "--num-requests", "6", "--request-rate", "1000", "--long-every", "3",
                   "--long-len", "40", "--short-len", "16", "--output-len", "2", "--shared-prefix-len", "10",
                   "--warmup-runs", "1", "--no-progress"])
    assert status == 0 and len(log) == 12
    warmup, measured = [body["prompt"] for body in log[:6]], [body["prompt"] for body in log[6:]]

    def common(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    # Only the BOS the tokenizer puts first is shared across the passes.
    assert max(common(w, m) for w in warmup for m in measured) == 1
    # Within the measured pass every prompt still starts with the same 10 tokens after the BOS.
    assert min(common(a, b) for a in measured for b in measured) >= 11


def test_the_native_backend_reads_the_server_s_count_and_skips_a_tokenless_finish() -> None:
    # The tester's repro: three tokens, then the finish of an aborted request carrying no token.
    backend, state = LightLLMBackend(None), StreamState()
    for i in range(3):
        backend.consume({"token": {"id": 5, "count_output_tokens": i + 1}, "finished": False}, float(i), state)
    backend.consume({"token": {"id": -1, "text": "", "special": True, "count_output_tokens": 3}, "finished": True,
                     "finish_reason": "abort"}, 3.0, state)
    assert (state.usage_output_tokens, state.token_times) == (3, [0.0, 1.0, 2.0])
    assert (state.finished, state.finish_reason) == (True, "abort")


@pytest.mark.parametrize("name", ["reasoning", "reasoning_content"])
def test_chat_reasoning_chunks_are_output_under_either_name(name: str) -> None:
    # vLLM 0.32 streams a reasoning model's thinking as delta.reasoning; older servers as
    # reasoning_content.  Either is output: stamped, and counted by the tokenizer fallback.
    from lightllm.benchmark.backends import OpenAIChatBackend

    backend, state = OpenAIChatBackend("m"), StreamState()
    chunks = [{"role": "assistant", "content": ""}, {name: "let me think"}, {name: " more"}, {"content": "ok"}]
    for when, delta in enumerate(chunks):
        finish = "stop" if when == len(chunks) - 1 else None
        backend.consume({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}, float(when), state)
    assert state.token_times == [1.0, 2.0, 3.0]
    assert "".join(state.text_parts) == "let me think moreok"
