"""vLLM request fields on a real server: ``add_special_tokens`` changes what the model reads (the
greedy answer equals the same prompt sent as token ids), ``response_format`` constrains completions,
chat ``echo`` repeats the last assistant message, and the refusals reach the client.
"""

from __future__ import annotations

import json

import httpx
import jsonschema

from .support import sse_chunks

GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
PREFILL = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "one two"}]


def _post(server, path: str, body: dict) -> dict:
    response = httpx.post(f"{server.url}{path}", json={"model": server.model_name, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_completions_add_special_tokens(tiny_server, tokenizer):
    text = "The quick brown fox"
    with_bos = tokenizer(text)["input_ids"]
    bare = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert with_bos == [tokenizer.bos_token_id, *bare]
    default = _post(tiny_server, "/v1/completions", {**GREEDY, "prompt": text})
    without = _post(tiny_server, "/v1/completions", {**GREEDY, "prompt": text, "add_special_tokens": False})
    assert default["usage"]["prompt_tokens"] == len(with_bos)
    assert without["usage"]["prompt_tokens"] == len(bare)
    # The model read exactly those ids: the same greedy answer as the ids sent directly (which the
    # field never changes).
    for ids, answer in ((with_bos, default), (bare, without)):
        for flag in (True, False):
            direct = _post(tiny_server, "/v1/completions", {**GREEDY, "prompt": ids, "add_special_tokens": flag})
            assert direct["choices"][0]["text"] == answer["choices"][0]["text"]
            assert direct["usage"]["prompt_tokens"] == len(ids)


def test_chat_add_special_tokens(tiny_server, tokenizer):
    text = tokenizer.apply_chat_template(PREFILL[:1], tokenize=False, add_generation_prompt=True)
    rendered = tokenizer(text, add_special_tokens=False)["input_ids"]
    doubled = tokenizer(text, add_special_tokens=True)["input_ids"]
    assert doubled == [tokenizer.bos_token_id, *rendered]  # vLLM's result: the template's BOS and the tokenizer's
    default = _post(tiny_server, "/v1/chat/completions", {**GREEDY, "messages": PREFILL[:1]})
    added = _post(tiny_server, "/v1/chat/completions", {**GREEDY, "messages": PREFILL[:1], "add_special_tokens": True})
    assert default["usage"]["prompt_tokens"] == len(rendered)
    assert added["usage"]["prompt_tokens"] == len(doubled)
    for ids, answer in ((rendered, default), (doubled, added)):
        direct = _post(tiny_server, "/v1/completions", {**GREEDY, "prompt": ids})
        assert direct["choices"][0]["text"] == answer["choices"][0]["message"]["content"]


def test_completions_response_format_json_schema(tiny_server):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    body = {"prompt": "JSON:", "max_tokens": 64, "temperature": 1.0, "seed": 5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}}
    choice = _post(tiny_server, "/v1/completions", body)["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["text"]), schema)
    # Any object: a random model may write a key longer than max_tokens, so only a finished one must parse.
    obj = _post(tiny_server, "/v1/completions", {**body, "response_format": {"type": "json_object"}})["choices"][0]
    assert obj["text"].startswith("{")
    if obj["finish_reason"] == "stop":
        assert isinstance(json.loads(obj["text"]), dict)


def test_chat_echo(tiny_server):
    body = {**GREEDY, "messages": PREFILL, "add_generation_prompt": False, "continue_final_message": True}
    plain = _post(tiny_server, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    echoed = _post(tiny_server, "/v1/chat/completions", {**body, "echo": True})
    assert echoed["choices"][0]["message"]["content"] == "one two" + plain
    chunks = sse_chunks(f"{tiny_server.url}/v1/chat/completions",
                        {"model": tiny_server.model_name, **body, "echo": True, "stream": True})
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[1] == {"content": "one two"}
    assert "".join(delta.get("content") or "" for delta in deltas) == "one two" + plain


def test_refused_vllm_fields_reach_the_client(tiny_server):
    for fields, param in (({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
                          ({"allowed_token_ids": [5]}, "allowed_token_ids"), ({"bad_words": ["a"]}, "bad_words")):
        response = httpx.post(f"{tiny_server.url}/v1/completions", timeout=60,
                              json={"prompt": "Hi", "max_tokens": 2, **fields})
        assert response.status_code == 400 and response.json()["error"]["param"] == param
        assert "not supported" in response.json()["error"]["message"]


def test_vllm_defaults_tools_and_stream_options_clients_send(tiny_server):
    """What clients built on vLLM's request models (every default sent), langchain's bind_tools([]) and an
    empty stream_options send is served."""
    shared = dict(n=1, stop=[], stream=False, use_beam_search=False, length_penalty=1.0, stop_token_ids=[],
                  include_stop_str_in_output=False, ignore_eos=False, min_tokens=0, spaces_between_special_tokens=True,
                  bad_words=[], echo=False, priority=0, return_weight_versions=False, routed_experts_prompt_start=0,
                  return_token_offsets=False, mm_payload="tensors", stream_options={})
    chat = _post(tiny_server, "/v1/chat/completions", {
        **shared, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": False,
        "top_logprobs": 0, "tools": [], "tool_choice": "auto", "include_reasoning": True, "parallel_tool_calls": True,
        "add_generation_prompt": True, "continue_final_message": False, "add_special_tokens": False})
    assert chat["choices"][0]["message"]["content"] is not None and "tool_calls" not in chat["choices"][0]["message"]
    done = _post(tiny_server, "/v1/completions", {**shared, "prompt": "Hi", "max_tokens": 16, "add_special_tokens": True})
    assert done["usage"]["completion_tokens"] >= 1


def test_continuous_usage_reports_the_cached_prompt_on_every_chunk(tiny_server):
    body = {"messages": [{"role": "user", "content": "a fixed prompt for the cache " * 8}], "max_tokens": 3,
            "temperature": 0}
    _post(tiny_server, "/v1/chat/completions", body)  # puts the prompt in the prefix cache
    chunks = sse_chunks(f"{tiny_server.url}/v1/chat/completions", {
        "model": tiny_server.model_name, **body, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    cached = [chunk["usage"]["prompt_tokens_details"]["cached_tokens"] for chunk in chunks]
    # The role chunk, every token chunk and the final usage chunk: one count, known before the first token.
    assert len(chunks) >= 3 and len(set(cached)) == 1 and cached[0] > 0, cached
