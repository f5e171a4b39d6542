"""Compatibility features vLLM / LightLLM clients rely on, against a real server on the tiny model.

Reference values come from transformers running the same checkpoint: the log-softmax of the
next-token logits at every generated position (greedy, so temperature 1).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ATOL = 2e-3


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused")


def reference_logprobs(hf_model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """``[len(output_ids), V]`` log-softmax of the logits that predicted each output token."""
    ids = torch.tensor([prompt_ids + output_ids[:-1]])
    with torch.no_grad():
        logits = hf_model(ids).logits[0, len(prompt_ids) - 1 :].float()
    return torch.log_softmax(logits, dim=-1)


def check_top(reference_row: torch.Tensor, chosen_id: int, chosen_logprob: float,
              top: list[tuple[int, float]], count: int) -> None:
    """The chosen token is the arg-max; ``top`` are the ``count`` best, most likely first."""
    assert chosen_id == int(reference_row.argmax())
    assert chosen_logprob == pytest.approx(float(reference_row[chosen_id]), abs=ATOL)
    values, ids = reference_row.topk(count)
    assert [token_id for token_id, _ in top] == ids.tolist()
    assert [value for _, value in top] == pytest.approx(values.tolist(), abs=ATOL)
    assert top[0][0] == chosen_id


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
    # Without the switch tokens are their text, with UTF-8 bytes.
    texts = client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices[0].logprobs.content
    for row, entry in enumerate(texts):
        assert entry.token == tokenizer.decode([output_ids[row]])
        assert bytes(entry.bytes) == entry.token.encode("utf-8")
        assert entry.top_logprobs[0].token == entry.token
        assert entry.logprob == pytest.approx(content[row].logprob, abs=ATOL)


def _sse_chunks(url: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", url, json=body, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_guidellm_continuous_usage_stream(tiny_server, tokenizer):
    # The request guidellm 0.8 sends in its default streaming mode.
    prompt = "hello world scheduler"
    body = {"model": tiny_server.model_name, "prompt": prompt, "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}, "ignore_eos": True}
    chunks = _sse_chunks(f"{tiny_server.url}/v1/completions", body)
    prompt_tokens = len(tokenizer(prompt)["input_ids"])
    assert all(chunk["usage"] is not None for chunk in chunks)
    assert all(chunk["usage"]["prompt_tokens"] == prompt_tokens for chunk in chunks)
    counts = [chunk["usage"]["completion_tokens"] for chunk in chunks]
    assert counts == sorted(counts) and counts[-1] == 6
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == prompt_tokens + 6
    # Chat too, including the opening role chunk.
    chat = {"model": tiny_server.model_name, "messages": [{"role": "user", "content": prompt}], "max_tokens": 4,
            "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = _sse_chunks(f"{tiny_server.url}/v1/chat/completions", chat)
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
    # Template variables reach the template (an unused one changes nothing).
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) == expected(add_generation_prompt=True)
    url = f"{tiny_server.url}/v1/chat/completions"
    for extra, param in (({"continue_final_message": True}, "continue_final_message"),
                         ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs")):
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


def reference_prompt_logprobs(hf_model, prompt_ids: list[int]) -> torch.Tensor:
    """``[len(prompt_ids) - 1, V]``: log-softmax of the logits that predicted prompt tokens 1..."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def lm_eval_loglikelihood(url: str, model: str, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """lm-eval 0.4's ``local-completions`` loglikelihood request and its response parsing."""
    body = {"model": model, "prompt": [context + continuation], "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}
    choice = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    ctxlen = len(context)
    token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    tokens = choice["logprobs"]["tokens"][ctxlen:-1]
    top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    is_greedy = all(token == max(top, key=top.get) for token, top in zip(tokens, top_logprobs))
    return sum(token_logprobs), is_greedy


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
    chunks = _sse_chunks(f"{tiny_server.url}/v1/completions", {**body, "stream": True, "max_tokens": 3,
                                                                 "ignore_eos": True})
    texts = [chunk["choices"][0]["text"] for chunk in chunks if chunk["choices"]]
    assert texts[0].startswith(prompt) and len(texts) == 3


def test_lm_eval_loglikelihood_request(tiny_server, hf_model, tokenizer):
    context = tokenizer("Question: which is faster? Answer:")["input_ids"]
    choices = [tokenizer(" the cache", add_special_tokens=False)["input_ids"],
               tokenizer(" recomputing", add_special_tokens=False)["input_ids"]]
    for continuation in choices:
        served, is_greedy = lm_eval_loglikelihood(tiny_server.url, tiny_server.model_name, context, continuation)
        reference = reference_prompt_logprobs(hf_model, context + continuation)
        expected = sum(float(reference[p - 1, (context + continuation)[p]])
                       for p in range(len(context), len(context) + len(continuation)))
        greedy = all(int(reference[p - 1].argmax()) == (context + continuation)[p]
                     for p in range(len(context), len(context) + len(continuation)))
        assert served == pytest.approx(expected, abs=ATOL * len(continuation))
        assert is_greedy == greedy


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
    refused = httpx.post(url, json={"inputs": "x", "parameters": {"print_eos_token": True}}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "parameters.print_eos_token"


ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                   "size": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["ok", "color", "size"],
    "additionalProperties": False,
}


def test_structured_output_json_schema_validates(client, tiny_server):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}
    for seed in (1, 2, 3):
        done = client.chat.completions.create(model=tiny_server.model_name, max_tokens=64, temperature=1.0, seed=seed,
                                              messages=[{"role": "user", "content": "Describe it"}],
                                              response_format=fmt)
        assert done.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(done.choices[0].message.content), ANSWER_SCHEMA)
    bad = httpx.post(f"{tiny_server.url}/v1/chat/completions", timeout=60, json={
        "model": tiny_server.model_name, "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": 5}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format.json_schema.schema"


def test_structured_output_is_batched_with_free_requests(client, tiny_server):
    messages = [{"role": "user", "content": "Say something"}]
    kwargs = dict(model=tiny_server.model_name, messages=messages, max_tokens=12, temperature=0)
    alone = client.chat.completions.create(extra_body={"ignore_eos": True}, **kwargs).choices[0].message.content
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}

    async def both():
        aclient = openai.AsyncOpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused")
        free, constrained, obj = await asyncio.gather(
            aclient.chat.completions.create(extra_body={"ignore_eos": True}, **kwargs),
            aclient.chat.completions.create(response_format=fmt, **{**kwargs, "max_tokens": 64}),
            aclient.chat.completions.create(response_format={"type": "json_object"}, **{**kwargs, "max_tokens": 64}))
        await aclient.close()
        return free, constrained, obj

    free, constrained, obj = asyncio.run(both())
    assert free.choices[0].message.content == alone
    assert json.loads(constrained.choices[0].message.content).keys() == ANSWER_SCHEMA["properties"].keys()
    text = obj.choices[0].message.content
    assert text.startswith("{")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_vllm_bench_serve_request_shapes(tiny_server, tiny_llama_dir):
    # What `vllm bench serve` sends with --backend openai / openai-chat and --model <path>.
    model = str(tiny_llama_dir)
    completions = {"model": model, "prompt": "benchmark prompt", "temperature": 0.0, "repetition_penalty": 1.0,
                   "max_tokens": 5, "logprobs": None, "best_of": 1, "stream": True, "ignore_eos": True,
                   "stream_options": {"include_usage": True}}
    chunks = _sse_chunks(f"{tiny_server.url}/v1/completions", completions)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    chat = {"model": model, "messages": [{"role": "user", "content": [{"type": "text", "text": "benchmark"}]}],
            "temperature": 0.0, "max_completion_tokens": 5, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    chunks = _sse_chunks(f"{tiny_server.url}/v1/chat/completions", chat)
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    assert all(chunk["model"] == model for chunk in chunks)


def test_langchain_openai_streaming_and_structured_output(tiny_server):
    import langchain_openai  # a test requirement; imported here to keep the module's start-up light
    llm = langchain_openai.ChatOpenAI(model=tiny_server.model_name, base_url=f"{tiny_server.url}/v1", api_key="unused",
                                      temperature=0, max_tokens=6, stream_usage=True)
    pieces = list(llm.stream("Say hi"))
    text = "".join(piece.content for piece in pieces)
    assert text == llm.invoke("Say hi").content
    assert any(piece.usage_metadata for piece in pieces)
    schema = {"title": "Answer", "type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    structured = langchain_openai.ChatOpenAI(model=tiny_server.model_name, base_url=f"{tiny_server.url}/v1",
                                             api_key="unused", temperature=0, max_tokens=32)
    answer = structured.with_structured_output(schema, method="json_schema", strict=True).invoke("Is it ok?")
    assert isinstance(answer, dict) and isinstance(answer["ok"], bool)


MC_TASK = """task: compat_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""

GEN_TASK = """task: compat_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def test_lm_eval_end_to_end_on_a_local_task(tiny_server, tiny_llama_dir, tmp_path, monkeypatch):
    # lm-eval is heavy (pandas, pyarrow, scikit-learn); the exact-request test above always runs.
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    data = tmp_path / "data.jsonl"
    rows = [{"question": "Which is faster?", "choices": [" the cache", " recomputing"], "answer": 0},
            {"question": "Pick a color:", "choices": [" red", " green", " blue"], "answer": 2},
            {"question": "One plus one is", "choices": [" two", " three"], "answer": 0}]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "compat_mc.yaml").write_text(MC_TASK.format(data=data))
    (tmp_path / "compat_gen.yaml").write_text(GEN_TASK.format(data=data))
    model_args = (f"model={tiny_server.model_name},base_url={tiny_server.url}/v1/completions,"
                  f"tokenizer={tiny_llama_dir},tokenizer_backend=huggingface,num_concurrent=1,max_retries=1")
    results = lm_eval.simple_evaluate(model="local-completions", model_args=model_args,
                                      tasks=["compat_mc", "compat_gen"], task_manager=TaskManager(include_path=str(tmp_path)),
                                      log_samples=True)
    assert 0.0 <= results["results"]["compat_mc"]["acc,none"] <= 1.0
    assert 0.0 <= results["results"]["compat_gen"]["exact_match,none"] <= 1.0
    for sample in results["samples"]["compat_mc"]:
        loglikelihoods = [resp[0][0] for resp in sample["resps"]]
        assert all(value < 0 for value in loglikelihoods)
        assert sample["acc"] == float(max(range(len(loglikelihoods)), key=loglikelihoods.__getitem__) == sample["target"])


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
