"""End to end: the overtaking bound on a real server, and the prefill-wait metrics.

One request whose first prompt is long and whose 63 others are short.  Under ``promote_shortest``
without a bound each step promotes one short prompt and the long prompt's chunk no longer fits
the budget, so it would wait for the whole burst.  Nothing was ahead of the long prompt (its FCFS
wait is 0), so with ``--prefill_max_overtake_tokens 200 --prefill_overtake_fraction 0`` it is
protected once 200 tokens of later work went ahead of it and then gets the whole budget every
step: at most ``(W0 + B) / SHORT_LEN`` short prompts can get their first token before it (with
the bound off all 63 come first).  The assertion counts scheduling steps, not time.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

from server_process import start_server

# The long prompt's prefill takes LONG_LEN / BUDGET = 240 steps: far longer than the short
# prompts take to reach the rank, even on a loaded machine, so they always find it prefilling.
W, BUDGET, LONG_LEN, SHORT_NUM, SHORT_LEN, NEW_TOKENS = 200, 4, 960, 63, 12, 2


def _prompt(seed: int, length: int) -> list[int]:
    return [10 + (seed * 131 + i * 17) % 900 for i in range(length)]


async def _stream(client, server, prompt, order, tag):
    """Stream one completion request; ``prompt`` may be a list of prompts (one request each)."""
    body = {"model": server.model_name, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    async with client.stream("POST", f"{server.url}/v1/completions", json=body) as resp:
        assert resp.status_code == 200, (await resp.aread()).decode()
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    key = f"{tag}{choice['index']}"
                    if key not in order:
                        order.append(key)


async def _run(server):
    order: list = []
    async with httpx.AsyncClient(timeout=300) as client:
        # One request with many prompts, the long one first: default's order serves it first, and
        # promote_shortest puts every short prompt ahead of it until the bound protects it.
        prompts = [_prompt(0, LONG_LEN)] + [_prompt(100 + i, SHORT_LEN) for i in range(SHORT_NUM)]
        await _stream(client, server, prompts, order, "p")
    return ["long0" if key == "p0" else key for key in order]


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    handle = start_server(
        tiny_llama_dir,
        tmp_path_factory.mktemp("bound"),
        ["--prefill_queue_strategy", "promote_shortest", "--prefill_max_overtake_tokens", str(W),
         "--prefill_overtake_fraction", "0",
         # Every request in the rank's prefill queue at once (256 rows), so the strategy orders them
         # all: a budget this small beside 256 rows needs separate decode forwards.
         "--chunked_prefill_size", str(BUDGET), "--batch_max_tokens", str(BUDGET), "--disable_mixed_batches",
         "--disable_dynamic_prompt_cache", "--max_total_token_num", "16384"],
    )
    yield handle
    handle.stop()


def test_long_prompt_is_served_within_the_bound_and_waits_are_exposed(server):
    assert "prefill_queue_strategy=promote_shortest overtake_bound=200 + 0 x FCFS wait" in server.log()
    order = asyncio.run(_run(server))
    assert len(order) == SHORT_NUM + 1
    shorts_before_long = order.index("long0")
    # Protected after at most W0 + BUDGET tokens of later work, then ahead of it until it is done.
    assert shorts_before_long <= (W + BUDGET) // SHORT_LEN + 1, order[: shorts_before_long + 1]
    server.wait_idle()
    body = httpx.get(f"{server.url}/metrics", timeout=10).text
    count = re.search(r'^lightllm_prefill_wait_tokens_count\{model_name="[^"]*",strategy="promote_shortest"\} (\S+)$', body, re.M)
    assert count is not None and float(count.group(1)) == SHORT_NUM + 1
    total = re.search(r'^lightllm_prefill_wait_tokens_sum\{model_name="[^"]*",strategy="promote_shortest"\} (\S+)$', body, re.M)
    # The long prompt alone waited at least its own prompt's tokens.
    assert float(total.group(1)) >= LONG_LEN
    assert f'lightllm_prefill_wait_seconds_bucket{{le="+Inf",model_name="{server.model_name}",strategy="promote_shortest"}}' in body
    assert server.metric("lightllm_prefill_wait_longest_tokens") == 0  # nothing waits now
    assert server.metric("lightllm_prefill_wait_longest_seconds") == 0
    # What the bound limits, and the bound itself, are published too.
    overtaken = re.search(r'^lightllm_prefill_overtaken_tokens_sum\{model_name="[^"]*",strategy="promote_shortest"\} (\S+)$', body, re.M)
    assert overtaken is not None and W <= float(overtaken.group(1))
    assert server.metric("lightllm_prefill_overtake_bound_base_tokens") == W
    assert server.metric("lightllm_prefill_overtake_bound_fraction") == 0
    assert server.metric("lightllm_prefill_overtake_bound_enabled") == 1
    assert server.metric("lightllm_prefill_overtaken_longest_tokens") == 0


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--prefill_max_overtake_tokens", "-1"], "error: --prefill_max_overtake_tokens must be >= 0, got -1"),
        (["--prefill_overtake_fraction", "-0.5"], "error: --prefill_overtake_fraction must be a finite number >= 0, got -0.5"),
        (["--prefill_overtake_fraction", "nan"],
         "error: argument --prefill_overtake_fraction: must be a finite number, got 'nan' (--help lists the flags)"),
        (["--prefill_max_wait_tokens", "4096"], "error: --prefill_max_wait_tokens was replaced by the overtaking bound: "
         "use --prefill_max_overtake_tokens and --prefill_overtake_fraction (or --disable_prefill_overtake_bound)"),
    ],
)
def test_bad_bound_flags_are_refused_with_one_line(tiny_llama_dir, flags, message):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "lightllm.server.api_server", "--model_dir", str(tiny_llama_dir), *flags],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == message
