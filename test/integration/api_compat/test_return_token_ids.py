"""``return_token_ids`` on a real server: the ids are the tokenizer's encoding of the prompt and the
tokens behind the returned text, streamed deltas add up to the whole answer, and a stop string's
trimmed text keeps its tokens (vLLM's rule). Placement details are in
test/unit/http/test_return_token_ids.py.
"""

from __future__ import annotations

import httpx

from .support import sse_chunks

PROMPT = "The quick brown fox"
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}


def _post(server, path: str, body: dict) -> dict:
    response = httpx.post(f"{server.url}{path}", json={"model": server.model_name, **body}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _stream(server, path: str, body: dict) -> list[dict]:
    return sse_chunks(f"{server.url}{path}", {"model": server.model_name, **body, "stream": True})


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_completion_ids_are_the_prompt_and_the_text(tiny_server, tokenizer):
    choice = _post(tiny_server, "/v1/completions", {**GREEDY, "prompt": PROMPT})["choices"][0]
    prompt_ids, output_ids = choice["prompt_token_ids"], choice["token_ids"]
    assert prompt_ids == tokenizer(PROMPT)["input_ids"]
    assert len(output_ids) == 12
    # The text is what the ids decode to after the prompt (decoded alone, the first word mark would go).
    assert _decode(tokenizer, prompt_ids + output_ids) == _decode(tokenizer, prompt_ids) + choice["text"]

    # The same greedy answer streamed: the prompt once, the deltas add up to the same ids and text.
    chunks = _stream(tiny_server, "/v1/completions", {**GREEDY, "prompt": PROMPT})
    choices = [chunk["choices"][0] for chunk in chunks if chunk["choices"]]
    assert choices[0]["prompt_token_ids"] == prompt_ids
    assert all(streamed["prompt_token_ids"] is None for streamed in choices[1:])
    assert [token for streamed in choices for token in streamed["token_ids"]] == output_ids
    assert "".join(streamed["text"] for streamed in choices) == choice["text"]


def test_stop_string_keeps_the_tokens_of_the_trimmed_text(tiny_server, tokenizer):
    full = _post(tiny_server, "/v1/completions", {**GREEDY, "prompt": PROMPT})["choices"][0]
    prompt_ids, full_ids = full["prompt_token_ids"], full["token_ids"]
    # A stop string from the middle of the answer, completed by some token after the first.
    stop = next(full["text"][start:start + 3] for start in range(4, len(full["text"]) - 3)
                if full["text"][start:start + 3].strip() == full["text"][start:start + 3])
    answer = _post(tiny_server, "/v1/completions", {**GREEDY, "prompt": PROMPT, "stop": [stop]})
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["text"] == full["text"][:full["text"].index(stop)]
    ids = choice["token_ids"]
    # The generation up to the token that completed the stop string: its text is trimmed, its ids are not.
    assert ids == full_ids[:len(ids)] and answer["usage"]["completion_tokens"] == len(ids)
    assert stop in _decode(tokenizer, prompt_ids + ids)[len(_decode(tokenizer, prompt_ids)):]
    assert stop not in _decode(tokenizer, prompt_ids + ids[:-1])[len(_decode(tokenizer, prompt_ids)):]
    # Streamed, the held-back pieces still send their ids.
    chunks = _stream(tiny_server, "/v1/completions", {**GREEDY, "prompt": PROMPT, "stop": [stop]})
    assert [token for chunk in chunks for streamed in chunk["choices"] for token in streamed["token_ids"]] == ids
    assert "".join(streamed["text"] for chunk in chunks for streamed in chunk["choices"]) == choice["text"]


def test_chat_prompt_ids_are_the_rendered_template(tiny_server, tokenizer):
    messages = [{"role": "user", "content": "Name three colours"}]
    answer = _post(tiny_server, "/v1/chat/completions", {**GREEDY, "messages": messages})
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert answer["prompt_token_ids"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    choice = answer["choices"][0]
    ids = answer["prompt_token_ids"] + choice["token_ids"]
    assert _decode(tokenizer, ids) == _decode(tokenizer, answer["prompt_token_ids"]) + choice["message"]["content"]
    chunks = _stream(tiny_server, "/v1/chat/completions", {**GREEDY, "messages": messages})
    assert chunks[0]["prompt_token_ids"] == answer["prompt_token_ids"]
    streamed = [token for chunk in chunks[1:] for item in chunk["choices"] for token in item["token_ids"]]
    assert streamed == choice["token_ids"]
