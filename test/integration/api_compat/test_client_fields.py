"""Client-compatibility fields on a real server: /v1/models as vLLM shapes it, logit_bias, vLLM's
structured-output parameters, truncate_prompt_tokens, chat_template, 20 logprobs, prompt-logprob
ranks against transformers, the vLLM metrics labels and series, and vLLM's /tokenize of a chat.
"""

from __future__ import annotations

import json
import os
import re
import time

import httpx

from .support import reference_prompt_logprobs


def _post(server, path: str, body: dict) -> dict:
    response = httpx.post(f"{server.url}{path}", json={"model": server.model_name, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_models_have_vllm_fields(tiny_server):
    [card] = httpx.get(f"{tiny_server.url}/v1/models", timeout=10).json()["data"]
    # `vllm bench serve` without --model loads its tokenizer from data[0]["root"]: the checkpoint's path.
    assert card["id"] == tiny_server.model_name and card["parent"] is None
    assert os.path.isabs(card["root"]) and os.path.isfile(os.path.join(card["root"], "config.json"))
    # vLLM clients send root back as the model's name.
    answer = httpx.post(f"{tiny_server.url}/v1/completions", json={"model": card["root"], "prompt": "x",
                                                                   "max_tokens": 1}, timeout=60)
    assert answer.status_code == 200 and answer.json()["model"] == card["root"], answer.text
    assert card["max_model_len"] > 0 and card["permission"][0]["object"] == "model_permission"


def test_logit_bias_steers_greedy_decoding(tiny_server, tokenizer):
    body = {"prompt": "The quick brown", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    ids = _post(tiny_server, "/v1/completions", {**body, "logprobs": 0, "return_tokens_as_token_ids": True})
    greedy = [int(token.split(":")[1]) for token in ids["choices"][0]["logprobs"]["tokens"]]
    target = 1000 if greedy[0] != 1000 else 1001
    forced = _post(tiny_server, "/v1/completions", {**body, "logprobs": 0, "return_tokens_as_token_ids": True,
                                                    "logit_bias": {str(target): 100}})
    assert all(token == f"token_id:{target}" for token in forced["choices"][0]["logprobs"]["tokens"])
    banned = _post(tiny_server, "/v1/completions", {**body, "logprobs": 0, "return_tokens_as_token_ids": True,
                                                    "logit_bias": {str(greedy[0]): -100}})
    assert banned["choices"][0]["logprobs"]["tokens"][0] != f"token_id:{greedy[0]}"
    too_big = httpx.post(f"{tiny_server.url}/v1/completions", timeout=60,
                         json={**body, "logit_bias": {str(len(tokenizer) + 10**6): 1}})
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "logit_bias"


def test_vllm_structured_output_parameters(tiny_server):
    base = {"max_tokens": 24, "temperature": 1.0, "seed": 3}
    for seed in (1, 2):
        chat = _post(tiny_server, "/v1/chat/completions", {
            **base, "seed": seed, "messages": [{"role": "user", "content": "Pick"}],
            "guided_choice": ["red", "green", "blue"]})
        assert chat["choices"][0]["message"]["content"] in ("red", "green", "blue")
        done = _post(tiny_server, "/v1/completions", {**base, "seed": seed, "prompt": "Code:",
                                                      "structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}})
        assert re.fullmatch(r"[A-Z]{3}-[0-9]{2}", done["choices"][0]["text"])
        assert done["choices"][0]["finish_reason"] == "stop"


def test_vllm_structured_outputs_options_and_json_blocks(tiny_server):
    """vLLM's request model dumped with exclude_none=True sends its structured-output options at their defaults
    (refused as unknown keys before); a costly multipleOf inside a Lark grammar's %json block is refused at once,
    as the same schema is elsewhere (it was served after about 26 s of compiling)."""
    schema = {"type": "object", "properties": {"n": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
              "required": ["n"]}
    for path, body in (("/v1/completions", {"prompt": "Data:"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Data"}]})):
        for seed in (1, 2):
            done = _post(tiny_server, path, {**body, "max_tokens": 48, "temperature": 1.0, "seed": seed,
                                             "structured_outputs": {
                                                 "json": schema, "disable_any_whitespace": True,
                                                 "disable_additional_properties": False, "_backend_was_auto": False}})
            choice = done["choices"][0]
            text = choice["text"] if "text" in choice else choice["message"]["content"]
            assert choice["finish_reason"] == "stop" and set(json.loads(text)) == {"n"}
            assert not any(char.isspace() for char in text), text
        started = time.monotonic()
        costly = httpx.post(f"{tiny_server.url}{path}", timeout=60, json={
            "model": tiny_server.model_name, **body, "max_tokens": 1,
            "guided_grammar": 'start: %json {"type": "integer", "multipleOf": 999983}'})
        assert costly.status_code == 400 and costly.json()["error"]["param"] == "guided_grammar", costly.text
        assert "multipleOf 999983" in costly.json()["error"]["message"] and time.monotonic() - started < 5


def test_truncate_prompt_tokens_and_chat_template(tiny_server, tokenizer):
    text = " ".join(f"word{i}" for i in range(40))
    done = _post(tiny_server, "/v1/completions", {"prompt": text, "max_tokens": 0, "truncate_prompt_tokens": 7,
                                                  "echo": True, "logprobs": 0, "return_tokens_as_token_ids": True})
    assert done["usage"]["prompt_tokens"] == 7
    # As vLLM cuts it, in the tokenizer: the last tokens of the text, and the BOS the tokenizer adds.
    tokenizer.truncation_side = "left"
    expected = tokenizer(text, truncation=True, max_length=7)["input_ids"]
    assert done["choices"][0]["logprobs"]["tokens"] == [f"token_id:{token_id}" for token_id in expected]
    assert expected[0] == tokenizer.bos_token_id
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{{ extra }}"
    chat = _post(tiny_server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1, "chat_template": template,
        "chat_template_kwargs": {"extra": "ASSISTANT:"}})
    expected = tokenizer("[user] hello\nASSISTANT:", add_special_tokens=False)["input_ids"]
    assert chat["usage"]["prompt_tokens"] == len(expected)


def test_twenty_completion_logprobs_and_prompt_logprob_ranks(tiny_server, tokenizer, hf_model):
    prompt = "the lazy dog jumps over the quick brown fox again"
    done = _post(tiny_server, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0,
                                                  "logprobs": 20, "prompt_logprobs": 1,
                                                  "return_tokens_as_token_ids": True})
    # Token ids as names: tokens that decode to the same text do not collapse into one key.
    assert all(len(top) == 20 for top in done["choices"][0]["logprobs"]["top_logprobs"])
    prompt_ids = tokenizer(prompt)["input_ids"]
    reference = reference_prompt_logprobs(hf_model, prompt_ids)
    entries = done["choices"][0]["prompt_logprobs"]
    assert entries[0] is None
    for position, entry in enumerate(entries[1:], start=1):
        own = entry[str(prompt_ids[position])]
        row, value = reference[position - 1], reference[position - 1][prompt_ids[position]]
        # vLLM's rank: 1 + tokens strictly more likely (float noise may move a near-tie by one).
        low, high = 1 + int((row > value + 1e-4).sum()), 1 + int((row > value - 1e-4).sum())
        assert own["rank"] is not None and low <= own["rank"] <= high, (position, own, low, high)
    # A tiny random model ranks most prompt tokens far from the top: the ranks are real, not top-N positions.
    assert max(entry[str(prompt_ids[p])]["rank"] for p, entry in enumerate(entries[1:], start=1)) > 2


def test_metrics_count_every_choice_and_carry_vllm_labels(tiny_server):
    def scrape() -> str:
        return httpx.get(f"{tiny_server.url}/metrics", timeout=10).text

    def value(body: str, series: str) -> float:
        match = re.search(rf"^{re.escape(series)}{{[^}}]*}} (\S+)$", body, re.MULTILINE)
        assert match, series
        return float(match.group(1))

    before = scrape()
    done = _post(tiny_server, "/v1/completions", {"prompt": "one two three", "max_tokens": 3, "n": 3,
                                                  "temperature": 1.0, "seed": 1})
    after = scrape()
    prompt_len = done["usage"]["prompt_tokens"]
    # vLLM (0.32) counts the prompt once per sequence: n times.
    assert value(after, "vllm:prompt_tokens_total") - value(before, "vllm:prompt_tokens_total") == 3 * prompt_len
    assert value(after, "vllm:request_max_num_generation_tokens_count") - \
        value(before, "vllm:request_max_num_generation_tokens_count") == 3
    labels = re.search(r"^vllm:prompt_tokens_total({[^}]*})", after, re.MULTILINE).group(1)
    assert f'model_name="{tiny_server.model_name}"' in labels and 'engine="0"' in labels


def test_tokenize_a_chat_gives_the_chat_templates_ids(tiny_server, tokenizer):
    """vLLM's /tokenize on the real tokenizer: a chat's ids are transformers' apply_chat_template ids (and the
    chat endpoint's prompt count), and /detokenize gives the rendered text back."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert expected == list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                          return_dict=True)["input_ids"])
    answer = _post(tiny_server, "/tokenize", {"messages": messages, "return_token_strs": True})
    assert answer["tokens"] == expected and answer["count"] == len(expected)
    assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(expected)
    chat = _post(tiny_server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert answer["max_model_len"] > chat["usage"]["prompt_tokens"] == len(expected)
    assert _post(tiny_server, "/detokenize", {"tokens": expected})["prompt"] == tokenizer.decode(expected)
    ping = httpx.post(f"{tiny_server.url}/ping", timeout=10)
    assert (ping.status_code, ping.json()) == (200, {"status": "ok"})
