"""Request extras (sampling, stop, chat template, ids) and the exact request shapes of vLLM-era clients.
"""

from __future__ import annotations

import httpx
import torch

from .support import sse_chunks


def test_guidellm_continuous_usage_stream(tiny_server, tokenizer):
    # The bodies guidellm 0.8.1 sends in its default streaming mode with a fixed output length, as its
    # request handlers format them (recorded from guidellm's own code; a real run is in the docs).
    prompt = "hello world scheduler"
    body = {"model": tiny_server.model_name, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_tokens": 6, "stop": None, "ignore_eos": True, "prompt": prompt}
    chunks = sse_chunks(f"{tiny_server.url}/v1/completions", body)
    prompt_tokens = len(tokenizer(prompt)["input_ids"])
    assert all(chunk["usage"] is not None for chunk in chunks)
    assert all(chunk["usage"]["prompt_tokens"] == prompt_tokens for chunk in chunks)
    counts = [chunk["usage"]["completion_tokens"] for chunk in chunks]
    assert counts == sorted(counts) and counts[-1] == 6
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == prompt_tokens + 6
    # Chat too, including the opening role chunk.
    chat = {"model": tiny_server.model_name, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_completion_tokens": 4, "stop": None, "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}]}
    chunks = sse_chunks(f"{tiny_server.url}/v1/chat/completions", chat)
    assert all(chunk["usage"]["prompt_tokens"] > 0 for chunk in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 4


def test_completions_default_to_16_tokens_chat_to_the_context(client, tiny_server):
    done = client.completions.create(model=tiny_server.model_name, prompt="count", extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 16 and done.choices[0].finish_reason == "length"


def test_model_id_as_vllm_serves_it(tiny_server, tiny_llama_dir):
    url = f"{tiny_server.url}/v1/completions"
    base = {"prompt": "hi", "max_tokens": 2}
    for model in (tiny_server.model_name, str(tiny_llama_dir)):
        answer = httpx.post(url, json={**base, "model": model}, timeout=60)
        assert answer.status_code == 200 and answer.json()["model"] == model
    answer = httpx.post(url, json=base, timeout=60)
    assert answer.status_code == 200 and answer.json()["model"] == tiny_server.model_name
    missing = httpx.post(url, json={**base, "model": "gpt-4"}, timeout=60)
    assert missing.status_code == 404
    assert tiny_server.model_name in missing.json()["error"]["message"]
    assert httpx.get(f"{tiny_server.url}/v1/models/{tiny_llama_dir}", timeout=10).status_code == 200


def test_min_p_one_is_greedy(client, tiny_server):
    kwargs = dict(model=tiny_server.model_name, prompt="The quick brown fox", max_tokens=8)
    greedy = client.completions.create(temperature=0, extra_body={"ignore_eos": True}, **kwargs).choices[0].text
    for seed in (1, 2, 3):
        sampled = client.completions.create(temperature=1.5, seed=seed, extra_body={"ignore_eos": True, "min_p": 1.0},
                                            **kwargs).choices[0].text
        assert sampled == greedy


def test_include_stop_str_in_output(client, tiny_server):
    kwargs = dict(model=tiny_server.model_name, prompt="import os\nimport sys", max_tokens=16, temperature=0)
    full = client.completions.create(extra_body={"ignore_eos": True}, **kwargs).choices[0].text
    stop = full[4:7]
    cut = full.index(stop)
    plain = client.completions.create(stop=[stop], extra_body={"ignore_eos": True}, **kwargs).choices[0].text
    kept = client.completions.create(stop=[stop], extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
                                     **kwargs).choices[0].text
    assert plain == full[:cut]
    assert kept == full[: cut + len(stop)]


def test_chat_template_extras(client, tiny_server, tokenizer):
    model = tiny_server.model_name
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}]

    def prompt_tokens(**extra) -> int:
        done = client.chat.completions.create(model=model, messages=messages, max_tokens=1, extra_body=extra)
        return done.usage.prompt_tokens

    def expected(**options) -> int:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **options)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    assert prompt_tokens() == expected(add_generation_prompt=True)
    assert prompt_tokens(add_generation_prompt=False) == expected(add_generation_prompt=False)
    assert prompt_tokens(add_generation_prompt=False, continue_final_message=True) == expected(
        add_generation_prompt=False, continue_final_message=True)
    assert expected(add_generation_prompt=False, continue_final_message=True) != expected(add_generation_prompt=False)
    # Template variables reach the template (the demo template writes bos_token first) ...
    assert prompt_tokens(chat_template_kwargs={"bos_token": ""}) == expected(add_generation_prompt=True, bos_token="")
    assert expected(add_generation_prompt=True, bos_token="") == expected(add_generation_prompt=True) - 1
    # ... and one it never reads is refused rather than dropped (the demo template is not a thinking or RAG one).
    url = f"{tiny_server.url}/v1/chat/completions"
    for extra, param in (({"continue_final_message": True}, "continue_final_message"),
                         ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
                         ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs.enable_thinking"),
                         ({"documents": [{"title": "a", "text": "b"}]}, "documents")):
        answer = httpx.post(url, json={"model": model, "messages": messages, **extra}, timeout=60)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param


def test_request_id_metadata_and_parallel_tool_calls(tiny_server):
    body = {"model": tiny_server.model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "request_id": "bench-42", "metadata": {"run": "a"}, "parallel_tool_calls": False}
    answer = httpx.post(f"{tiny_server.url}/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 200 and answer.json()["id"] == "chatcmpl-bench-42"
    assert "chatcmpl-bench-42" in tiny_server.log()


def test_best_of_returns_the_most_likely_candidates(client, tiny_server):
    kwargs = dict(model=tiny_server.model_name, prompt="Once upon", max_tokens=6, temperature=1.0, seed=11,
                  logprobs=0)
    every = client.completions.create(n=3, extra_body={"ignore_eos": True}, **kwargs).choices
    scores = {choice.text: sum(choice.logprobs.token_logprobs) for choice in every}
    best = client.completions.create(n=1, best_of=3, extra_body={"ignore_eos": True}, **kwargs).choices
    assert len(best) == 1
    assert best[0].text == max(scores, key=scores.get)
    two = client.completions.create(n=2, best_of=3, extra_body={"ignore_eos": True}, **kwargs).choices
    assert [choice.index for choice in two] == [0, 1]
    assert [choice.text for choice in two] == sorted(scores, key=scores.get, reverse=True)[:2]
    refused = httpx.post(f"{tiny_server.url}/v1/completions", timeout=60, json={
        "model": tiny_server.model_name, "prompt": "x", "n": 2, "best_of": 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "best_of"


def test_native_lightllm_shape_and_parameters(tiny_server, tokenizer):
    url = f"{tiny_server.url}/generate"
    answer = httpx.post(url, json={"inputs": "Native call", "parameters": {
        "do_sample": False, "ignore_eos": True, "return_details": True}}, timeout=60).json()
    assert answer["count_output_tokens"] == 16 and len(answer["tokens"]) == 16
    assert answer["tokens"] == answer["details"]["tokens"]
    assert "".join(token["text"] for token in answer["tokens"]) == answer["generated_text"][0]
    plain = httpx.post(url, json={"inputs": "Native call", "parameters": {
        "max_new_tokens": 2, "add_special_tokens": False}}, timeout=60).json()
    assert plain["prompt_tokens"] == len(tokenizer("Native call", add_special_tokens=False)["input_ids"])
    several = httpx.post(url, json={"inputs": "Native call", "parameters": {
        "max_new_tokens": 4, "n": 2, "best_of": 3, "seed": 3, "ignore_eos": True, "input_penalty": True,
        "presence_penalty": 1.0}}, timeout=60).json()
    assert len(several["generated_text"]) == 2 and several["count_output_tokens"] == [4, 4]
    refused = httpx.post(url, json={"inputs": "x", "parameters": {"exponential_decay_length_penalty": [1, 20]}},
                         timeout=60)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "parameters.exponential_decay_length_penalty"


def test_native_length_decay_and_print_eos_token_match_transformers(tiny_server, tokenizer, hf_model):
    # LightLLM's exponential_decay_length_penalty pushes the random-weight model to EOS; greedy tokens
    # must be those of transformers' generate with the same penalty, and print_eos_token shows EOS.
    prompt = "Native decay"
    decay = [2, 1.5]
    parameters = {"do_sample": False, "max_new_tokens": 40, "exponential_decay_length_penalty": decay,
                  "return_details": True}
    answer = httpx.post(f"{tiny_server.url}/generate", json={"inputs": prompt, "parameters": parameters},
                        timeout=60).json()
    prompt_ids = tokenizer(prompt)["input_ids"]
    with torch.no_grad():
        reference = hf_model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=40,
                                      exponential_decay_length_penalty=tuple(decay),
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    expected = reference[0, len(prompt_ids):].tolist()
    assert [token["id"] for token in answer["tokens"]] == expected
    assert expected[-1] == tokenizer.eos_token_id and len(expected) < 40
    assert answer["finish_reason"] == "stop"
    assert tokenizer.eos_token not in answer["generated_text"][0]
    shown = httpx.post(f"{tiny_server.url}/generate", timeout=60, json={
        "inputs": prompt, "parameters": {**parameters, "print_eos_token": True}}).json()
    assert shown["generated_text"][0] == answer["generated_text"][0] + tokenizer.eos_token
    assert shown["tokens"][-1]["text"] == tokenizer.eos_token


def test_vllm_bench_serve_request_shapes(tiny_server, tiny_llama_dir):
    # What `vllm bench serve` sends with --backend openai / openai-chat and --model <path>.
    model = str(tiny_llama_dir)
    completions = {"model": model, "prompt": "benchmark prompt", "temperature": 0.0, "repetition_penalty": 1.0,
                   "max_tokens": 5, "logprobs": None, "best_of": 1, "stream": True, "ignore_eos": True,
                   "stream_options": {"include_usage": True}}
    chunks = sse_chunks(f"{tiny_server.url}/v1/completions", completions)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    chat = {"model": model, "messages": [{"role": "user", "content": [{"type": "text", "text": "benchmark"}]}],
            "temperature": 0.0, "max_completion_tokens": 5, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    chunks = sse_chunks(f"{tiny_server.url}/v1/chat/completions", chat)
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    assert all(chunk["model"] == model for chunk in chunks)


def test_model_name_list_is_served(tiny_llama_dir, tmp_path):
    from server_process import start_server

    server = start_server(tiny_llama_dir, tmp_path, ["--max_total_token_num", "4096", "--model_name", "first", "second"])
    try:
        url = f"{server.url}/v1/completions"
        assert httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"] == "first"
        for model in ("first", "second"):
            answer = httpx.post(url, json={"model": model, "prompt": "hi", "max_tokens": 1}, timeout=60)
            assert answer.status_code == 200 and answer.json()["model"] == model
        # With --model_name the directory's own names are no longer served.
        missing = httpx.post(url, json={"model": str(tiny_llama_dir), "prompt": "hi", "max_tokens": 1}, timeout=60)
        assert missing.status_code == 404 and "'first', 'second'" in missing.json()["error"]["message"]
    finally:
        server.stop()


def test_stop_token_ids_end_without_their_text_and_name_the_stop(tiny_server, tokenizer):
    # vLLM: the stop token's text is left out (kept with include_stop_str_in_output) and
    # stop_reason names the stop token id or stop string; EOS and length report none.
    url = f"{tiny_server.url}/v1/completions"
    base = {"model": tiny_server.model_name, "prompt": "import os\nimport sys", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True}
    full = httpx.post(url, json=base, timeout=60).json()["choices"][0]
    assert full["finish_reason"] == "length" and full["stop_reason"] is None
    ids = [int(token.removeprefix("token_id:")) for token in full["logprobs"]["tokens"]]
    at = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i] and tokenizer.decode(ids[i]).strip())
    for keep in (False, True):
        body = {**base, "stop_token_ids": [ids[at]], "include_stop_str_in_output": keep}
        choice = httpx.post(url, json=body, timeout=60).json()["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] == ids[at]
        assert choice["text"] == tokenizer.decode(ids[: at + keep])
        streamed = sse_chunks(url, {**body, "stream": True})
        assert "".join(chunk["choices"][0]["text"] for chunk in streamed) == choice["text"]
        assert streamed[-1]["choices"][0]["stop_reason"] == ids[at]
    stop = tokenizer.decode(ids[at])
    choice = httpx.post(url, json={**base, "stop": [stop]}, timeout=60).json()["choices"][0]
    assert choice["stop_reason"] == stop
    chat = {"model": tiny_server.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "temperature": 0, "ignore_eos": True, "logprobs": True, "return_tokens_as_token_ids": True}
    chat_url = f"{tiny_server.url}/v1/chat/completions"
    first = httpx.post(chat_url, json=chat, timeout=60).json()["choices"][0]["logprobs"]["content"][0]["token"]
    first_id = int(first.removeprefix("token_id:"))
    stopped = httpx.post(chat_url, json={**chat, "stop_token_ids": [first_id]}, timeout=60).json()["choices"][0]
    assert stopped["message"]["content"] == "" and stopped["stop_reason"] == first_id


def test_min_tokens_holds_stop_strings_back_too(tiny_server):
    url = f"{tiny_server.url}/v1/completions"
    base = {"model": tiny_server.model_name, "prompt": "import os\nimport sys", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, "logprobs": 0}
    full = httpx.post(url, json=base, timeout=60).json()["choices"][0]
    tokens = full["logprobs"]["tokens"]
    stop = tokens[1]
    early = httpx.post(url, json={**base, "stop": [stop]}, timeout=60).json()["choices"][0]
    assert early["finish_reason"] == "stop" and len(early["logprobs"]["tokens"]) <= 2
    held = httpx.post(url, json={**base, "stop": [stop], "min_tokens": 6}, timeout=60).json()["choices"][0]
    assert len(held["logprobs"]["tokens"]) >= 6
    assert held["text"] == full["text"][: len(held["text"])]
    assert held["finish_reason"] == "length" or held["stop_reason"] == stop


def test_request_template_errors_name_chat_template_and_echo_scoring_names_the_room(tiny_server):
    chat = {"model": tiny_server.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "chat_template": "{% for m in messages %}{{ m.content }"}
    answer = httpx.post(f"{tiny_server.url}/v1/chat/completions", json=chat, timeout=60)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "chat_template"
    assert "not a valid Jinja template" in answer.json()["error"]["message"]
    limit = httpx.get(f"{tiny_server.url}/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    body = {"model": tiny_server.model_name, "prompt": [5] * limit, "max_tokens": 0, "echo": True, "logprobs": 1}
    answer = httpx.post(f"{tiny_server.url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "prompt"
    assert f"at most {limit - 1} tokens" in answer.json()["error"]["message"]
    body["prompt"] = [5] * (limit - 1)
    answer = httpx.post(f"{tiny_server.url}/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200 and len(answer.json()["choices"][0]["logprobs"]["tokens"]) == limit - 1
