"""The open-loop sender: every request of a workload at its scheduled time, whatever the server's pace.

An open loop measures the server as traffic finds it: a slow answer never delays the next send
(unless ``max_concurrency`` caps the requests in flight), so queueing shows up in the server's
TTFT, not hidden in the client.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Sequence

import httpx
from tqdm import tqdm

from lightllm.benchmark.backends import RequestInput, make_backend
from lightllm.benchmark.metrics import RequestRecord
from lightllm.benchmark.stream_request import encode_body, send_request
from lightllm.utils.http_client_support import auth_headers


async def send_all(
    client: httpx.AsyncClient,
    base_url: str,
    backend_name: str,
    model: str | None,
    requests: Sequence[RequestInput],
    *,
    ignore_eos: bool = True,
    extra_body: dict[str, Any] | None = None,
    max_concurrency: int | None = None,
    show_progress: bool = False,
    finished: list[RequestRecord] | None = None,
) -> list[RequestRecord]:
    """Send every request at its scheduled time (open loop) and return records in index order.

    ``finished``, when given, gets each record as its request ends (in the order they end): what
    a caller interrupted before the end still has.

    Bodies are encoded before the clock starts so serialization does not skew sends.
    With ``max_concurrency`` a request past its time waits for a free slot; its record
    then shows the wait as send lag.
    """
    backend = make_backend(backend_name, model, ignore_eos=ignore_eos, extra_body=extra_body)
    bodies = [encode_body(backend, r) for r in requests]
    limiter = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    progress = tqdm(total=len(requests), disable=not show_progress, desc="requests")
    start = 0.0

    def clock() -> float:
        return time.perf_counter() - start

    async def run_one(request: RequestInput, body: bytes) -> RequestRecord:
        delay = request.scheduled_time - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        if limiter is None:
            record = await send_request(client, base_url, backend, request, clock, body)
        else:
            async with limiter:
                record = await send_request(client, base_url, backend, request, clock, body)
        progress.update(1)
        if finished is not None:
            finished.append(record)
        return record

    coroutines = [run_one(r, b) for r, b in zip(requests, bodies)]
    start = time.perf_counter()
    try:
        return list(await asyncio.gather(*coroutines))
    finally:
        progress.close()


def make_client(request_timeout_s: float, api_key: str | None = None) -> httpx.AsyncClient:
    """HTTP client with no connection cap (an open-loop benchmark must not queue in the pool).

    Proxy environment variables are ignored: a proxy would distort every timing.  ``api_key``
    goes with every request the client sends (the model lookup and every measured request).
    """
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(request_timeout_s, connect=min(request_timeout_s, 30.0))
    return httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False, headers=auth_headers(api_key))
