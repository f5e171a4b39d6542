"""Logprobs as vLLM / OpenAI clients read them (top, streamed, echoed, prompt), checked against transformers.
"""

from __future__ import annotations

import httpx
import pytest

from .support import ATOL, check_top, reference_logprobs, reference_prompt_logprobs, sse_chunks


def test_native_generate_top_logprobs(tiny_server, hf_model, tokenizer):
    prompt = "The quick brown fox"
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 6, "do_sample": False, "ignore_eos": True,
                                             "return_details": True, "logprobs": 4}}
    answer = httpx.post(f"{tiny_server.url}/generate", json=body, timeout=60).json()
    tokens = answer["details"]["tokens"]
    assert len(tokens) == 6
    reference = reference_logprobs(hf_model, tokenizer(prompt)["input_ids"], [t["id"] for t in tokens])
    for row, token in enumerate(tokens):
        top = [(int(key), value) for key, value in token["top_logprobs"].items()]
        check_top(reference[row], token["id"], token["logprob"], top, 4)


def test_completions_top_logprobs(client, tiny_server, hf_model, tokenizer):
    prompt = "import os\nimport sys"
    done = client.completions.create(model=tiny_server.model_name, prompt=prompt, max_tokens=5, temperature=0,
                                     logprobs=3, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    logprobs = done.choices[0].logprobs
    ids = [int(token.split(":", 1)[1]) for token in logprobs.tokens]
    reference = reference_logprobs(hf_model, tokenizer(prompt)["input_ids"], ids)
    for row, token_id in enumerate(ids):
        top = [(int(key.split(":", 1)[1]), value) for key, value in logprobs.top_logprobs[row].items()]
        top.sort(key=lambda pair: -pair[1])
        check_top(reference[row], token_id, logprobs.token_logprobs[row], top, 3)


def test_chat_top_logprobs_plain_and_streamed(client, tiny_server, hf_model, tokenizer):
    messages = [{"role": "user", "content": "Say hi"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    kwargs = dict(model=tiny_server.model_name, messages=messages, max_tokens=5, temperature=0, logprobs=True,
                  top_logprobs=5)
    as_ids = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    content = client.chat.completions.create(**kwargs, extra_body=as_ids).choices[0].logprobs.content
    streamed = [entry for chunk in client.chat.completions.create(stream=True, **kwargs, extra_body=as_ids)
                if chunk.choices and chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
    assert len(content) == 5
    # The second request may reuse the first one's prompt cache: equal up to float rounding.
    assert [entry.token for entry in streamed] == [entry.token for entry in content]
    for got, want in zip(streamed, content):
        assert [alt.token for alt in got.top_logprobs] == [alt.token for alt in want.top_logprobs]
        assert [alt.logprob for alt in got.top_logprobs] == pytest.approx([alt.logprob for alt in want.top_logprobs],
                                                                          abs=ATOL)
    output_ids = [int(entry.token.split(":", 1)[1]) for entry in content]
    reference = reference_logprobs(hf_model, prompt_ids, output_ids)
    for row, entry in enumerate(content):
        top = [(int(alt.token.split(":", 1)[1]), alt.logprob) for alt in entry.top_logprobs]
        check_top(reference[row], output_ids[row], entry.logprob, top, 5)
    # Without the switch tokens are their text; bytes are the token's own (whole characters here).
    texts = client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices[0].logprobs.content
    for row, entry in enumerate(texts):
        alone = tokenizer.decode([output_ids[row]])
        # vLLM's strings: a token holding part of a character is "" or, completing it, the character.
        assert entry.token == alone or (alone.endswith("\ufffd") and not entry.token.endswith("\ufffd"))
        if "\ufffd" not in entry.token:
            assert bytes(entry.bytes) == entry.token.encode("utf-8")
        assert entry.top_logprobs[0].token == entry.token
        assert entry.logprob == pytest.approx(content[row].logprob, abs=ATOL)


def test_echo_with_logprobs_matches_transformers(tiny_server, hf_model, tokenizer):
    prompt_ids = tokenizer("The scheduler picks the shortest job first")["input_ids"]
    reference = reference_prompt_logprobs(hf_model, prompt_ids)
    body = {"model": tiny_server.model_name, "prompt": prompt_ids, "max_tokens": 1, "logprobs": 2, "echo": True,
            "temperature": 0, "return_tokens_as_token_ids": True}
    # Twice: the second request finds the prompt in the prefix cache and must still compute it.
    for _ in range(2):
        choice = httpx.post(f"{tiny_server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(prompt_ids) + 1
        assert [int(t.split(":")[1]) for t in logprobs["tokens"][:-1]] == prompt_ids
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        for position in range(1, len(prompt_ids)):
            row = reference[position - 1]
            assert logprobs["token_logprobs"][position] == pytest.approx(float(row[prompt_ids[position]]), abs=ATOL)
            top = logprobs["top_logprobs"][position]
            best = row.topk(2)
            for token_id, value in zip(best.indices.tolist(), best.values.tolist()):
                assert top[f"token_id:{token_id}"] == pytest.approx(value, abs=ATOL)
        assert choice["text"].startswith(tokenizer.decode(prompt_ids))


def test_echo_with_zero_max_tokens_returns_the_prompt(tiny_server, tokenizer):
    prompt = "Echo me back"
    body = {"model": tiny_server.model_name, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0}
    answer = httpx.post(f"{tiny_server.url}/v1/completions", json=body, timeout=60).json()
    prompt_ids = tokenizer(prompt)["input_ids"]
    assert answer["choices"][0]["text"] == prompt
    assert len(answer["choices"][0]["logprobs"]["tokens"]) == len(prompt_ids)
    assert answer["usage"]["completion_tokens"] == 0 and answer["usage"]["prompt_tokens"] == len(prompt_ids)
    # Streaming: the prompt comes first.
    chunks = sse_chunks(f"{tiny_server.url}/v1/completions", {**body, "stream": True, "max_tokens": 3,
                                                                 "ignore_eos": True})
    # Chunks are counted by their logprob entries, one per token: a token may add no text yet
    # (the detokenizer holds back an incomplete piece) and a finish may come as one more,
    # text-less chunk, so neither the chunks nor the text-bearing ones are one per token.
    choices = [chunk["choices"][0] for chunk in chunks if chunk["choices"]]
    assert "".join(choice["text"] for choice in choices).startswith(prompt)
    assert choices[0]["text"].startswith(prompt)
    logged = [token for choice in choices if choice.get("logprobs") for token in choice["logprobs"]["tokens"]]
    assert len(logged) == len(prompt_ids) + 3, logged


def test_vllm_prompt_logprobs(tiny_server, hf_model, tokenizer):
    prompt = "Prompt logprobs please"
    prompt_ids = tokenizer(prompt)["input_ids"]
    reference = reference_prompt_logprobs(hf_model, prompt_ids)
    body = {"model": tiny_server.model_name, "prompt": prompt, "max_tokens": 2, "prompt_logprobs": 3}
    entries = httpx.post(f"{tiny_server.url}/v1/completions", json=body, timeout=60).json()["choices"][0][
        "prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt_ids)
    for position in range(1, len(prompt_ids)):
        entry = entries[position]
        row = reference[position - 1]
        actual = entry[str(prompt_ids[position])]
        assert actual["logprob"] == pytest.approx(float(row[prompt_ids[position]]), abs=ATOL)
        best = row.topk(3)
        for rank, token_id in enumerate(best.indices.tolist(), start=1):
            assert entry[str(token_id)]["rank"] == rank
    messages = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(f"{tiny_server.url}/v1/chat/completions", timeout=60, json={
        "model": tiny_server.model_name, "messages": messages, "max_tokens": 1, "prompt_logprobs": 0}).json()
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    chat_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert len(chat["prompt_logprobs"]) == len(chat_ids)
    chat_reference = reference_prompt_logprobs(hf_model, chat_ids)
    last = chat["prompt_logprobs"][-1][str(chat_ids[-1])]["logprob"]
    assert last == pytest.approx(float(chat_reference[-1, chat_ids[-1]]), abs=ATOL)


def test_chat_bytes_join_into_characters_split_over_tokens(tiny_server):
    """The demo tokenizer spells CJK and emoji as one token per byte: each token reports its own byte
    (not U+FFFD's three), so the joined bytes are the content, streamed or not."""
    body = {"model": tiny_server.model_name, "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
            "top_logprobs": 1, "temperature": 0, "guided_regex": "語😀x"}
    answer = httpx.post(f"{tiny_server.url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    assert answer["message"]["content"] == "語😀x"
    entries = answer["logprobs"]["content"]
    assert len(entries) == 8 and b"".join(bytes(entry["bytes"]) for entry in entries) == "語😀x".encode("utf-8")
    chunks = [chunk["choices"][0] for chunk in sse_chunks(f"{tiny_server.url}/v1/chat/completions",
                                                           {**body, "stream": True}) if chunk["choices"]]
    streamed = [entry for chunk in chunks if chunk["logprobs"] for entry in chunk["logprobs"]["content"]]
    assert [entry["bytes"] for entry in streamed] == [entry["bytes"] for entry in entries]


def test_echo_text_offsets_point_into_the_text_streamed_or_not(tiny_server, tokenizer):
    """BOS is not in the echoed text: the prompt's words start at 0 and the output at len(prompt);
    the streamed offsets equal the whole response's for the same (greedy) request."""
    prompt = "hello world"
    body = {"model": tiny_server.model_name, "prompt": prompt, "max_tokens": 8, "logprobs": 1, "echo": True,
            "temperature": 0, "ignore_eos": True}
    choice = httpx.post(f"{tiny_server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    text, offsets = choice["text"], choice["logprobs"]["text_offset"]
    prompt_ids = tokenizer(prompt)["input_ids"]
    assert text.startswith(prompt) and len(offsets) == len(prompt_ids) + 8
    assert offsets[:2] == [0, 0] and offsets[len(prompt_ids)] == len(prompt)
    assert offsets == sorted(offsets) and offsets[-1] <= len(text)
    chunks = [chunk["choices"][0] for chunk in sse_chunks(f"{tiny_server.url}/v1/completions", {**body, "stream": True})
              if chunk["choices"]]
    assert "".join(chunk["text"] for chunk in chunks) == text
    assert [offset for chunk in chunks if chunk["logprobs"] for offset in chunk["logprobs"]["text_offset"]] == offsets
