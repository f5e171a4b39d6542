"""The text a PD cluster sends equals a normal server's whatever the segment boundaries.

The decode node ends a segment every few tokens, so segment boundaries fall inside multi-byte
UTF-8 characters and inside stop strings; the master decodes the whole generation itself and
decides stop strings (tiny model, greedy, real 1P1D cluster on loopback).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Dict, List, Tuple

import httpx
import pytest

from lightllm.utils.tokenizer_utils import load_tokenizer
from pd_cluster_support import launch, start_cluster, wait_healthy

SEGMENT_TOKENS = 5  # --pd_max_segment_tokens of the decode node
MAX_TOKENS = 30
# Greedy outputs of the tiny demo model on these prompts hold multi-byte characters split by tokens.
PROMPTS = ["lambda 12", "yield 13", "print( 20", "for x in 24", "async 31", "import os 17"]


@pytest.fixture(scope="module")
def servers(tiny_llama_dir, tmp_path_factory):
    """A normal server and a 1P1D cluster, started side by side."""
    log_dir = tmp_path_factory.mktemp("pd_text")
    normal = launch(tiny_llama_dir, log_dir, "normal", ["--max_total_token_num", "16384"])
    try:
        cluster = start_cluster(tiny_llama_dir, log_dir, decode_args=["--pd_max_segment_tokens", str(SEGMENT_TOKENS)])
    except BaseException:
        normal.stop()
        raise
    try:
        wait_healthy(normal)
        yield cluster, normal
    finally:
        cluster.stop()
        normal.stop()


@pytest.fixture(scope="module")
def normal(servers):
    return servers[1]


@pytest.fixture(scope="module")
def cluster(servers):
    return servers[0]


def _summary(path: str, status: int, text: str) -> Dict[str, Any]:
    """Text, finish reason and token count of a /generate, /generate_stream or /v1/completions answer."""
    assert status == 200, text
    if path == "/generate":
        body = json.loads(text)
        return {"text": body["generated_text"][0], "count": body["count_output_tokens"], "finish": body["finish_reason"]}
    if path == "/generate_stream":
        events = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]
        assert not any("error" in event for event in events), events
        return {"text": "".join(event["token"]["text"] for event in events), "count": len(events),
                "finish": events[-1]["finish_reason"]}
    if not text.startswith("data:"):
        body = json.loads(text)
        choice = body["choices"][0]
        return {"text": choice["text"], "count": body["usage"]["completion_tokens"], "finish": choice["finish_reason"],
                "stop_reason": choice["stop_reason"]}
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert not any("error" in chunk for chunk in chunks), chunks
    pieces = [choice["text"] for chunk in chunks for choice in chunk.get("choices") or []]
    finish = [choice["finish_reason"] for chunk in chunks for choice in chunk.get("choices") or []][-1]
    stop_reason = [choice["stop_reason"] for chunk in chunks for choice in chunk.get("choices") or []][-1]
    return {"text": "".join(pieces), "count": chunks[-1]["usage"]["completion_tokens"], "finish": finish,
            "stop_reason": stop_reason}


def _send_all(url: str, requests: List[Tuple[str, Dict[str, Any]]]) -> List[Dict[str, Any]]:
    async def run() -> List[Tuple[int, str]]:
        async with httpx.AsyncClient(timeout=180) as client:
            async def one(path: str, body: Dict[str, Any]) -> Tuple[int, str]:
                response = await client.post(f"{url}{path}", json=body)
                return response.status_code, response.text

            return await asyncio.gather(*(one(path, body) for path, body in requests))

    return [_summary(path, status, text) for (path, _), (status, text) in zip(requests, asyncio.run(run()))]


def _reference_tokens(normal, prompt: str) -> Tuple[List[int], List[str]]:
    """Token ids and per-token text pieces of the normal server's greedy answer."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": MAX_TOKENS, "do_sample": False, "ignore_eos": True,
                                             "return_details": True}}
    answer = httpx.post(f"{normal.url}/generate", json=body, timeout=120).json()
    return [token["id"] for token in answer["tokens"]], [token["text"] for token in answer["tokens"]]


def test_characters_split_at_segment_boundaries_reach_the_client_whole(cluster, normal, tiny_llama_dir):
    tokenizer = load_tokenizer(str(tiny_llama_dir), "auto")
    split = 0
    for prompt in PROMPTS:
        ids, _ = _reference_tokens(normal, prompt)
        boundaries = range(SEGMENT_TOKENS, len(ids), SEGMENT_TOKENS)
        split += sum(tokenizer.decode(ids[:k]).endswith("\ufffd") for k in boundaries)
    assert split >= 3, "the prompts no longer put a segment boundary inside a character"

    requests: List[Tuple[str, Dict[str, Any]]] = []
    for i, prompt in enumerate(PROMPTS):
        path = ("/generate", "/generate_stream", "/v1/completions")[i % 3]
        if path == "/v1/completions":
            requests.append((path, {"model": normal.model_name, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                    "temperature": 0, "ignore_eos": True, "stream": i % 2 == 1,
                                    "skip_special_tokens": i % 2 == 0,
                                    **({"stream_options": {"include_usage": True}} if i % 2 == 1 else {})}))
        else:
            requests.append((path, {"inputs": prompt, "parameters": {"max_new_tokens": MAX_TOKENS, "do_sample": False,
                                                                   "ignore_eos": True}}))
    assert _send_all(cluster.master.url, requests) == _send_all(normal.url, requests)


def _straddling_stop(pieces: List[str]) -> Tuple[str, int]:
    """A stop string whose first half is text of segment 1 and second half text of segment 2."""
    full = "".join(pieces)
    for boundary_tokens in range(2 * SEGMENT_TOKENS, MAX_TOKENS - SEGMENT_TOKENS, SEGMENT_TOKENS):
        at = len("".join(pieces[:boundary_tokens]))
        stop = full[at - 2: at + 2]
        if len(stop) == 4 and "\ufffd" not in stop and full.find(stop) == at - 2:
            return stop, boundary_tokens
    raise AssertionError(f"no stop string straddles a segment boundary in {full!r}")


def test_stop_string_straddling_a_segment_boundary_ends_like_a_normal_server(cluster, normal):
    prompt = "def 16"
    _, pieces = _reference_tokens(normal, prompt)
    stop, boundary_tokens = _straddling_stop(pieces)
    requests = [("/v1/completions", {"model": normal.model_name, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                     "temperature": 0, "ignore_eos": True, "stop": [stop],
                                     "include_stop_str_in_output": include, "stream": stream,
                                     **({"stream_options": {"include_usage": True}} if stream else {})})
                for include in (False, True) for stream in (False, True)]
    ours = _send_all(cluster.master.url, requests)
    assert ours == _send_all(normal.url, requests)
    for (_, body), got in zip(requests, ours):
        assert got["finish"] == "stop" and boundary_tokens < got["count"] < MAX_TOKENS, got
        assert got["text"].endswith(stop) == body["include_stop_str_in_output"] and got["stop_reason"] == stop
    # The master ended these requests mid-segment: the nodes aborted them and freed their KV.
    for node in cluster.nodes.values():
        node.wait_idle()
        assert node.metric("lightllm_kv_allocatable_tokens") == node.metric("lightllm_kv_total_tokens"), node.url


def test_a_stop_token_in_a_later_segment_ends_like_a_normal_server(cluster, normal):
    # The master decodes the text: the stop token's text is left out (or kept) and named in
    # stop_reason exactly as a normal server's detokenizer does it.
    prompt = "def 16"
    ids, _ = _reference_tokens(normal, prompt)
    at = next(i for i in range(SEGMENT_TOKENS + 1, len(ids)) if ids[i] not in ids[:i])
    requests = [("/v1/completions", {"model": normal.model_name, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                     "temperature": 0, "ignore_eos": True, "stop_token_ids": [ids[at]],
                                     "include_stop_str_in_output": include, "stream": stream,
                                     **({"stream_options": {"include_usage": True}} if stream else {})})
                for include in (False, True) for stream in (False, True)]
    ours = _send_all(cluster.master.url, requests)
    assert ours == _send_all(normal.url, requests)
    assert all(got["finish"] == "stop" and got["count"] == at + 1 and got["stop_reason"] == ids[at] for got in ours)


# What two servers answering the same requests need not agree on: the prefix-cache hits (the
# requests run concurrently and share a prompt, so which finds the other's is timing).
_CACHE_KEYS = frozenset({"prompt_cache_len", "prompt_tokens_details"})


def _comparable(value: Any) -> Any:
    """``value`` less :data:`_CACHE_KEYS`, with every float replaced by a marker: logprobs depend
    on the batch a token was computed in (rounding), which two servers do not share; their places
    and number must agree."""
    if isinstance(value, float):
        return "<float>"
    if isinstance(value, dict):
        return {key: _comparable(item) for key, item in value.items() if key not in _CACHE_KEYS}
    if isinstance(value, list):
        return [_comparable(item) for item in value]
    return value


def _answer_without_ids(path: str, status: int, text: str) -> Any:
    """An answer as the client reads it (a stream's chunks in order), :func:`_comparable`, less
    what differs between any two servers (an OpenAI response's id and time)."""
    assert status == 200, text
    if path == "/generate":
        return _comparable(json.loads(text))
    chunks = ([json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
              if text.startswith("data:") else [json.loads(text)])
    return [_comparable({key: item for key, item in chunk.items() if key not in ("id", "created")})
            for chunk in chunks]


def test_a_grammar_completed_at_a_segment_boundary_ends_like_a_normal_server(cluster, normal):
    # A normal server finishes a request whose structured-output grammar can go no further.  The
    # decode node must finish it too when that token is also its segment's last (a continuation
    # would add an end-of-sequence token: one more token, a logprob and a stop_reason), and the
    # prefill node when it is a segment's first token.  The tiny model writes one token per digit.
    lengths = {1: "the prefill node's first token", SEGMENT_TOKENS: "the first segment's last token",
               SEGMENT_TOKENS + 1: "a continuation's first token", 2 * SEGMENT_TOKENS: "a continuation's last token"}
    requests: List[Tuple[str, Dict[str, Any]]] = []
    for digits in lengths:
        requests.append(("/generate", {"inputs": "x=", "parameters": {
            "max_new_tokens": MAX_TOKENS, "do_sample": False, "regular_constraint": f"[0-9]{{{digits}}}",
            "return_details": True}}))
    for stream in (False, True):
        requests.append(("/v1/completions", {"model": normal.model_name, "prompt": "x=", "max_tokens": MAX_TOKENS,
                                             "temperature": 0, "logprobs": 1, "stream": stream,
                                             "structured_outputs": {"regex": f"[0-9]{{{SEGMENT_TOKENS}}}"},
                                             **({"stream_options": {"include_usage": True}} if stream else {})}))

    async def run(url: str) -> List[Any]:
        async with httpx.AsyncClient(timeout=180) as client:
            async def one(path: str, body: Dict[str, Any]) -> Any:
                response = await client.post(f"{url}{path}", json=body)
                return _answer_without_ids(path, response.status_code, response.text)

            return await asyncio.gather(*(one(path, body) for path, body in requests))

    expected = asyncio.run(run(normal.url))
    for answer, (digits, where) in zip(expected, lengths.items()):  # the premise: the grammar ends on that token
        assert answer["count_output_tokens"] == digits and answer["finish_reason"] == "stop", (where, answer)
    assert asyncio.run(run(cluster.master.url)) == expected


def test_n_choices_report_the_smallest_cache_hit_among_them(cluster, normal):
    """A sanity check, through real processes, of the reported total against the choices' own hits.

    Each choice of an n > 1 request is a generation of its own, and one prefilled after a sibling
    computed the prompt adopts that prefix.  On a normal server choice 0 joins first and computes;
    through the master any choice may reach the prefill node first, choice 0 included.  Here the
    request's usage must equal the smallest of the hits its choices' continuous usage reports (and
    choice 0's on the normal server).  Which choice the master's prefill node sees first is timing
    and cannot be forced, so reporting choice 0's hit (the old rule) passes this whenever choice 0
    came first; test/unit/http/test_best_of_usage.py scripts the hits and tells the two rules apart.
    """
    words = ["Quartz", "Violet", "Harbor", "Juniper", "Falcon", "Ember", "Walnut", "Cobalt"]
    for server, first_is_smallest in ((cluster.master, False), (normal, True)):
        for word in words:
            body = {"model": normal.model_name, "prompt": f"{word} {server is normal} zz yy xx", "max_tokens": 3,
                    "temperature": 0.9, "n": 3, "stream": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
            text = httpx.post(f"{server.url}/v1/completions", json=body, timeout=180).text
            chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
            own = {chunk["choices"][0]["index"]: chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
                   for chunk in chunks[:-1]}
            reported = chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert sorted(own) == [0, 1, 2] and reported == min(own.values()), (server.url, word, own, reported)
            assert not first_is_smallest or own[0] == reported, (word, own)
