"""Send one streaming request to a backend's endpoint and record what happened.

:func:`send_request` does the transport part shared by all backends
(:mod:`lightllm.benchmark.backends`): POST, read server-sent events, timestamp every
output-bearing event on the benchmark clock and turn the outcome into a :class:`RequestRecord`.

Output tokens are the count the server reports (``count_output_tokens`` natively, the usage chunk's
``completion_tokens`` for the OpenAI APIs) and the record says so (``output_tokens_source`` of
``"server"``).  Without one they are counted from the stream (``"stream"``): exact natively, one
event per token, but only a count of chunks for the OpenAI APIs, so the response's text is kept
(:attr:`RequestRecord.generated_text`) for ``bench_serving`` to count with the tokenizer instead.

A response the server ended with a finish reason meaning it gave up (:data:`GAVE_UP_FINISH_REASONS`)
is a failed request, whatever it streamed before: its record keeps the reason in ``finish_reason``
and in its error.

TTFT is the first stamp; E2E ends at the last stamp (the last output the client received), not
at ``[DONE]`` or the usage chunk that follow it: those are protocol trailers, and ending there
would put them into E2E and TPOT for the OpenAI APIs but not the native one (whose last event
is the last token), and not into vLLM's benchmark either, which ends at the last chunk too.
"""

from __future__ import annotations

import json
from typing import AsyncIterator, Callable

import httpx

from lightllm.benchmark.backends import Backend, RequestInput, StreamState
from lightllm.benchmark.metrics import COUNT_FROM_SERVER, COUNT_FROM_STREAM, RequestRecord

Clock = Callable[[], float]
_JSON_HEADERS = {"Content-Type": "application/json", "Accept": "text/event-stream"}
# Finish reasons that say the server gave up on a request rather than finished it: "abort" (our
# server: a request it ended without finishing it, such as one its scheduler dropped; vLLM: an
# aborted request) and "error" (the engine's name for a failed request: vLLM and our server both
# turn it into an error event before it reaches a stream, so it is guarded against, not expected).
# Its latencies would be those of a cut-off output, so such a request counts as failed.
GAVE_UP_FINISH_REASONS: tuple[str, ...] = ("abort", "error")


async def iter_sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """Yield the data of each server-sent event; multi-line data is joined by newlines."""
    lines: list[str] = []
    async for line in response.aiter_lines():
        if not line.strip():
            if lines:
                yield "\n".join(lines)
                lines = []
            continue
        if line.startswith("data:"):
            value = line[5:]
            lines.append(value[1:] if value.startswith(" ") else value)
        # Comments (":") and event/id/retry fields carry nothing the benchmark needs.
    if lines:
        yield "\n".join(lines)


async def _read_stream(
    backend: Backend, response: httpx.Response, clock: Clock, state: StreamState
) -> bool:
    """Feed every event of ``response`` to ``backend``; return whether ``[DONE]`` arrived.

    ``state.end_time`` is the arrival of the terminating event, or of end-of-stream.
    """
    async for data in iter_sse_data(response):
        now = clock()
        state.end_time = now
        if data.strip() == "[DONE]":
            return True
        chunk = json.loads(data)
        if not isinstance(chunk, dict):
            raise ValueError(f"stream event is not a JSON object: {data[:200]!r}")
        if chunk.get("error"):
            state.error = f"server error: {json.dumps(chunk['error'])[:500]}"
            return False
        backend.consume(chunk, now, state)
        if backend.stops_on_finish and state.finished:
            return False
    state.end_time = clock()
    return False


def encode_body(backend: Backend, request: RequestInput) -> bytes:
    """The serialized JSON body; done ahead of time so encoding does not delay sends."""
    return json.dumps(backend.build_payload(request), ensure_ascii=False).encode("utf-8")


async def send_request(
    client: httpx.AsyncClient,
    base_url: str,
    backend: Backend,
    request: RequestInput,
    clock: Clock,
    body: bytes | None = None,
) -> RequestRecord:
    """Send one streaming request and record what happened; never raises for server faults.

    ``body`` is the pre-encoded payload from :func:`encode_body` (built here if omitted).
    """
    record = RequestRecord(
        index=request.index,
        request_class=request.request_class,
        prompt_tokens=request.prompt_tokens,
        scheduled_time=request.scheduled_time,
        requested_output_tokens=request.output_len,
    )
    if body is None:
        body = encode_body(backend, request)
    state = StreamState()
    saw_done = False
    record.send_time = clock()
    try:
        url = base_url.rstrip("/") + backend.path
        async with client.stream("POST", url, content=body, headers=_JSON_HEADERS) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                state.error = f"HTTP {response.status_code}: {body[:500]}"
            else:
                saw_done = await _read_stream(backend, response, clock, state)
    except (httpx.HTTPError, ValueError) as exc:
        state.error = f"{type(exc).__name__}: {exc}"
        state.end_time = None
    record.token_times = state.token_times
    if state.token_times:
        record.first_token_time = state.token_times[0]
    _count_output(backend, state, record)
    if state.usage_prompt_tokens is not None:
        record.prompt_tokens = state.usage_prompt_tokens
    record.finish_reason = state.finish_reason
    if state.error is None and not backend.is_complete(state, saw_done):
        state.error = "stream ended before the response was complete"
    if state.error is None and state.finish_reason in GAVE_UP_FINISH_REASONS:
        state.error = f"the server gave up on the request (finish_reason {state.finish_reason!r})"
    if state.error is None and not state.token_times:
        state.error = "no output token received"
    record.error = state.error
    if record.error is None:
        # E2E ends at the last output received, not at the trailers (usage, [DONE]) after it.
        record.end_time = state.token_times[-1]
    else:
        record.end_time = state.end_time if state.end_time is not None else clock()
    return record


def _count_output(backend: Backend, state: StreamState, record: RequestRecord) -> None:
    """Set the record's output tokens, and where they came from, from what the stream said."""
    if state.usage_output_tokens is not None:
        record.output_tokens, record.output_tokens_source = state.usage_output_tokens, COUNT_FROM_SERVER
        return
    record.output_tokens, record.output_tokens_source = len(state.token_times), COUNT_FROM_STREAM
    if not backend.one_token_per_event:
        # A chunk may carry several tokens: keep the text so the run can count them (see
        # serving_run.count_unreported_output).
        record.generated_text = "".join(state.text_parts)
