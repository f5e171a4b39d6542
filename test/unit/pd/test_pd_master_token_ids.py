"""``return_token_ids`` through a PD master: the ids are the client's prompt and every generated token
over all segments (the prefill node's first token, the decode node's, continuations), as on a normal
server; a stop string the master decides keeps the tokens of its trimmed text.

The master is the real one over node stand-ins (pd_master_support.py), whose "model" is a fixed
function of the sequence, so the expected ids are computed independently.
"""

from __future__ import annotations

import json

import httpx

from pd_master_support import REQUEST_TIMEOUT, Cluster, StraddlingStop, cluster_fixture  # noqa: F401 - the "cluster" fixture
from pd_node_stand_in import reference_tokens


def _completion(cluster: Cluster, **fields: object) -> httpx.Response:
    body = {"model": cluster.master.manager.served.model_name, "return_token_ids": True, **fields}
    response = httpx.post(f"{cluster.master.url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT)
    assert response.status_code == 200, response.text
    return response


def test_ids_span_every_segment_whole_and_streamed(cluster: Cluster) -> None:
    cluster.decode.segment_limit = 2  # segments of 3 tokens: P's first, then 2 on D
    prompt = "a long story"
    prompt_ids = cluster.master.manager.served.encode_prompt(prompt)
    expected = reference_tokens(prompt_ids, 8)
    choice = _completion(cluster, prompt=prompt, max_tokens=8).json()["choices"][0]
    assert choice["prompt_token_ids"] == prompt_ids and choice["token_ids"] == expected
    streamed = _completion(cluster, prompt=prompt, max_tokens=8, stream=True)
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    choices = [chunk["choices"][0] for chunk in chunks]
    assert choices[0]["prompt_token_ids"] == prompt_ids
    assert [token for item in choices for token in item["token_ids"]] == expected
    assert [body["segment_index"] for body in cluster.prefill.bodies][-3:] == [0, 1, 2]


def test_stop_string_decided_by_the_master_keeps_its_tokens(cluster: Cluster) -> None:
    prompt = "hello there, general"
    straddling = StraddlingStop(cluster, prompt, 20, after_tokens=5)
    tokens, stop, completes_at = straddling.tokens, straddling.stop, straddling.completes_at
    for include in (False, True):
        answer = _completion(cluster, prompt=prompt, max_tokens=20, stop=[stop],
                             include_stop_str_in_output=include).json()
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["text"] == straddling.text(include)
        # The same ids whether the stop string's text is kept or trimmed.
        assert choice["token_ids"] == tokens[:completes_at] and answer["usage"]["completion_tokens"] == completes_at
