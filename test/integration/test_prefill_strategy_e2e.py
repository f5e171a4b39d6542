"""End to end: a queue of long prompts ahead of short ones, on each prefill-queue strategy.

The order in which first tokens come back is decided by the server's scheduling steps; the long
prompts take hundreds of steps to prefill (16-token budget), so the orders asserted below are
hundreds of steps apart and do not depend on timing.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from server_process import start_server

LONG_NUM, LONG_LEN, SHORT_NUM, SHORT_LEN, NEW_TOKENS = 5, 960, 4, 12, 6


def _prompt(seed: int, length: int) -> list[int]:
    return [10 + (seed * 131 + i * 17) % 900 for i in range(length)]


async def _stream(client, url, name, prompt, first_token_order, outputs):
    body = {"model": name, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
    pieces = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    if not pieces:
                        first_token_order.append(tuple(prompt[:1]) + (len(prompt),))
                    pieces.append(chunk["choices"][0]["text"])
    outputs[(prompt[0], len(prompt))] = "".join(pieces)


async def _run(server):
    order: list = []
    outputs: dict = {}
    async with httpx.AsyncClient(timeout=300) as client:
        longs = [asyncio.create_task(_stream(client, server.url, server.model_name, _prompt(i, LONG_LEN), order, outputs)) for i in range(LONG_NUM)]
        deadline = time.monotonic() + 60
        # All longs submitted first. A counter, not the running-requests gauge: on a quiet machine
        # the longs can all finish between two polls, and the gauge would never show five again.
        while server.metric("lightllm_prompt_tokens_total") < LONG_NUM * LONG_LEN:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        shorts = [asyncio.create_task(_stream(client, server.url, server.model_name, _prompt(100 + i, SHORT_LEN), order, outputs)) for i in range(SHORT_NUM)]
        await asyncio.gather(*longs, *shorts)
    kinds = ["long" if key[1] == LONG_LEN else "short" for key in order]
    return kinds, outputs


@pytest.fixture(scope="module")
def results(tiny_llama_dir, tmp_path_factory):
    out = {}
    for strategy in ("default", "promote_shortest", "hrrn"):
        server = start_server(
            tiny_llama_dir,
            tmp_path_factory.mktemp(strategy),
            ["--prefill_queue_strategy", strategy, "--chunked_prefill_size", "16", "--batch_max_tokens", "16",
             "--running_max_req_size", "16",
             "--disable_dynamic_prompt_cache", "--max_total_token_num", "16384"],
        )
        try:
            assert f"prefill_queue_strategy={strategy}" in server.log()
            assert f'strategy="{strategy}"' in httpx.get(f"{server.url}/metrics").text
            out[strategy] = asyncio.run(_run(server))
        finally:
            server.stop()
    return out


def test_default_serves_the_long_queue_first(results):
    kinds, _ = results["default"]
    # FCFS: at least all but the last long prompt have their first token before any short one.
    assert kinds.index("short") >= LONG_NUM - 1


@pytest.mark.parametrize("strategy", ["promote_shortest", "hrrn"])
def test_short_prompts_get_first_tokens_before_the_long_queue_finishes(results, strategy):
    kinds, _ = results[strategy]
    last_long = max(i for i, kind in enumerate(kinds) if kind == "long")
    assert all(i < last_long for i, kind in enumerate(kinds) if kind == "short")


def test_outputs_are_identical_across_strategies(results):
    reference = results["default"][1]
    assert len(reference) == LONG_NUM + SHORT_NUM
    for strategy in ("promote_shortest", "hrrn"):
        assert results[strategy][1] == reference
