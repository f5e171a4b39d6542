"""Seeded sampling with penalties stays exact across PD continuation segments (issue 9).

The decode node ends every segment after a few tokens, so one request runs as several
segments, each a new request whose prompt ends with the tokens generated so far.  The master
tells the nodes how many of those trailing prompt tokens are output (``generated_before``), and
the seeded step index and the output-token penalties count them: the cluster's text must equal
a normal server's, token for token, for a seeded sampled request spanning four or more segments.
"""

from __future__ import annotations

import json
from typing import Any, Dict

import httpx
import pytest

from pd_cluster_support import start_cluster
from server_process import start_server

# The decode node ends every segment after this many tokens (--pd_max_segment_tokens).
SEGMENT_TOKENS = 5
MAX_TOKENS = 4 * SEGMENT_TOKENS + 2  # five segments


@pytest.fixture(scope="module")
def normal(tiny_llama_dir, tmp_path_factory):
    handle = start_server(tiny_llama_dir, tmp_path_factory.mktemp("normal"), ["--max_total_token_num", "4096"])
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, tmp_path_factory):
    handle = start_cluster(tiny_llama_dir, tmp_path_factory.mktemp("pd"),
                           decode_args=["--pd_max_segment_tokens", str(SEGMENT_TOKENS)])
    yield handle
    handle.stop()


def _completion(url: str, body: Dict[str, Any]) -> Dict[str, Any]:
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=180)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _streamed_text(url: str, body: Dict[str, Any]) -> str:
    with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=180) as resp:
        assert resp.status_code == 200, resp.read()
        events = [json.loads(line[5:]) for line in resp.iter_lines() if line.startswith("data:")]
    assert events and not any("error" in event for event in events), events
    return "".join(event["token"]["text"] for event in events)


def test_seeded_penalised_sampling_spanning_segments_equals_a_normal_server(cluster, normal):
    segments_before = cluster.master.metric("lightllm_pd_continuation_segments_total")
    body = {"model": normal.model_name, "prompt": "Seeded sampling over several segments", "max_tokens": MAX_TOKENS,
            "temperature": 1.2, "seed": 4321, "presence_penalty": 0.7, "frequency_penalty": 0.5, "ignore_eos": True}
    ours, theirs = _completion(cluster.master.url, body), _completion(normal.url, body)
    assert ours["usage"]["completion_tokens"] == theirs["usage"]["completion_tokens"] == MAX_TOKENS
    assert ours["choices"][0]["text"] == theirs["choices"][0]["text"]
    # The native streaming API, with a repetition penalty and the length decay (its start inside
    # the first segment, so every continuation must count earlier output to get it right).
    native = {"inputs": "Another seeded prompt", "parameters": {
        "max_new_tokens": MAX_TOKENS, "do_sample": True, "temperature": 1.1, "seed": 77, "ignore_eos": True,
        "presence_penalty": 0.4, "frequency_penalty": 0.9, "repetition_penalty": 1.2,
        "exponential_decay_length_penalty": [2, 1.1]}}
    assert _streamed_text(cluster.master.url, native) == _streamed_text(normal.url, native)
    # Both requests really ran as continuations: 4 or more after their first segment each.
    segments = cluster.master.metric("lightllm_pd_continuation_segments_total") - segments_before
    assert segments >= 2 * 4, segments
