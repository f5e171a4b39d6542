"""A burst of prompts with a long common prefix computes the prefix once, on a real server.

Before, the planner put the same chunk of the shared prefix for several requests into one step,
and a request's last prompt chunk reached the prefix cache only when the request ended: eight
prompts with a 1500-token prefix computed it 3.2 times. Now a chunk that repeats one planned this
step waits a step and is taken from the cache, and a request publishes its prompt as soon as it
is computed. The counts are what the server reports, not timings: however the requests arrive
(one step or several), no token of the common prefix is computed twice.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server_process import start_server

PREFIX, SUFFIX, BURST, MAX_TOKENS = 700, 9, 6, 3


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    # Chunks of 256 in a budget of 1024: the prefix takes three chunks, and four requests' chunks fit a step.
    handle = start_server(tiny_llama_dir, tmp_path_factory.mktemp("logs"), [
        "--max_total_token_num", "16384", "--chunked_prefill_size", "256", "--batch_max_tokens", "1024"])
    yield handle
    handle.stop()


def _burst(server, prompts):
    def complete(prompt):
        return httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "model": server.model_name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}).json()

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(complete, prompts))


def test_a_burst_with_a_common_prefix_computes_it_once(server):
    rng = random.Random(7)
    prefix = [rng.randrange(10, 500) for _ in range(PREFIX)]
    prompts = [prefix + [rng.randrange(10, 500) for _ in range(SUFFIX)] for _ in range(BURST)]
    before = server.metric("lightllm_processed_prefill_tokens_total")
    answers = _burst(server, prompts)
    server.wait_idle()
    computed = server.metric("lightllm_processed_prefill_tokens_total") - before
    # The prefix once, every suffix, and the decode rows that ride in prefill steps (mixed batches).
    assert computed <= PREFIX + BURST * SUFFIX + BURST * MAX_TOKENS, computed
    cached = sorted(answer["usage"]["prompt_tokens_details"]["cached_tokens"] for answer in answers)
    assert cached[0] == 0 and cached[1:] == [PREFIX] * (BURST - 1)
    # The same text as each prompt alone, once the cache holds the prefix.
    alone = [_burst(server, [prompt])[0]["choices"][0]["text"] for prompt in prompts[:2]]
    assert alone == [answer["choices"][0]["text"] for answer in answers[:2]]
