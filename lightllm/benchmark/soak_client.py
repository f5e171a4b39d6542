"""The soak's client: the three load phases of a round and the wait for an idle server.

Kept apart from the soak's command line, its rounds and its memory samples
(:mod:`.soak_server`): this is the only part that speaks HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from typing import Any, Dict, List, Optional

import httpx

from lightllm.utils.http_client_support import auth_headers
from lightllm.benchmark.soak_report import PhaseResult


class SoakClient:
    """Sends the phases of a round to one server."""

    def __init__(self, base_url: str, model: str, args: argparse.Namespace):
        """``args``: the soak's flags (lengths, concurrency, timeouts and ``api_key``)."""
        self.base_url = base_url
        self.model = model
        self.args = args
        # No connection is reused: the server closes one that stayed idle past its keep-alive
        # timeout (5 s), and a client that reuses it at that moment loses the request unseen (a
        # ReadError, counted as a failure of a healthy server).  Dropping idle connections after
        # 2 s was not enough: a loaded client reads its answers late, so its idle clock lagged the
        # server's by seconds (5 of 6000 requests failed so on a loaded VM).
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        self.client = httpx.AsyncClient(timeout=args.request_timeout_s, limits=limits, trust_env=False,
                                        headers=auth_headers(args.api_key))

    async def close(self) -> None:
        """Close the client's connections."""
        await self.client.aclose()

    def _body(self, prompt: List[int], max_tokens: int, stream: bool) -> Dict[str, Any]:
        return {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0, "stream": stream}

    async def _stream(self, prompt: List[int], max_tokens: int, stop_after: Optional[int], result: PhaseResult) -> None:
        events = 0
        try:
            async with self.client.stream("POST", f"{self.base_url}/v1/completions",
                                          json=self._body(prompt, max_tokens, True)) as resp:
                if resp.status_code != 200:
                    result.fail(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    if line.strip() == "data: [DONE]":
                        break
                    try:
                        payload = json.loads(line[5:])
                    except ValueError:
                        result.fail(f"not JSON: {line}")
                        return
                    if isinstance(payload, dict) and "error" in payload:
                        result.fail(line)
                        return
                    events += 1
                    if stop_after is not None and events >= stop_after:
                        break  # leaving the block closes the connection mid-stream
            if stop_after is None and events == 0:
                result.fail("stream ended without a token")
            else:
                result.ok += 1
        except httpx.HTTPError as exc:
            result.fail(f"{type(exc).__name__}: {exc}")

    async def _complete(self, prompt: List[int], result: PhaseResult, gate: asyncio.Semaphore) -> None:
        async with gate:
            try:
                resp = await self.client.post(f"{self.base_url}/v1/completions",
                                              json=self._body(prompt, self.args.output_len, False))
                if resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == self.args.output_len:
                    result.ok += 1
                else:
                    result.fail(f"HTTP {resp.status_code}: {resp.text[:200]}")
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                result.fail(f"{type(exc).__name__}: {exc}")

    async def run_phase(self, kind: str, prompts: List[List[int]]) -> PhaseResult:
        """``streams``, ``aborts`` or ``requests`` over ``prompts``."""
        result = PhaseResult(sent=len(prompts))
        started = time.perf_counter()
        if kind == "streams":
            jobs = [self._stream(p, self.args.output_len, None, result) for p in prompts]
        elif kind == "aborts":
            jobs = [self._stream(p, self.args.abort_output_len, self.args.abort_after_events, result) for p in prompts]
        else:
            gate = asyncio.Semaphore(self.args.concurrency)
            jobs = [self._complete(p, result, gate) for p in prompts]
        await asyncio.gather(*jobs)
        result.seconds = time.perf_counter() - started
        return result

    async def wait_idle(self) -> bool:
        """Poll /metrics until nothing runs or waits; False when ``--idle-timeout-s`` passed."""
        deadline = time.monotonic() + self.args.idle_timeout_s
        while time.monotonic() < deadline:
            try:
                text = (await self.client.get(f"{self.base_url}/metrics", timeout=10)).text
                busy = sum(_metric(text, name) for name in ("lightllm_running_requests", "lightllm_waiting_requests"))
                if busy == 0:
                    return True
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
        return False


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def make_prompts(count: int, low: int, high: int, vocab: int, rng: random.Random) -> List[List[int]]:
    """Random token-id prompts with lengths in [low, high] (fresh ids, so every round adds cache entries)."""
    return [[rng.randrange(5, vocab) for _ in range(rng.randint(low, high))] for _ in range(count)]
