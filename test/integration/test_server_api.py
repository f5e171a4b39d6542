"""The HTTP API of a real server process on the tiny demo model."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from lightllm.common.basemodel.batch_generator import BatchGenerator
from lightllm.models.registry import load_model
from server_process import stream_token_ids


def test_greedy_over_http_equals_runtime_and_transformers(tiny_server, tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    prompts = ["The quick brown fox", "import os\nimport sys", "a"]
    runtime = BatchGenerator(load_model(str(tiny_llama_dir)), 2048)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    config = GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    for prompt in prompts:
        prompt_ids = tokenizer(prompt)["input_ids"]
        served = stream_token_ids(tiny_server.url, prompt, 16)
        ours = runtime.greedy_generate([prompt_ids], 16)[0]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt_ids]), generation_config=config)[0, len(prompt_ids) :].tolist()
        assert served == ours == ref


def test_openai_client_completions_and_chat(tiny_server, tiny_llama_dir):
    client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    assert model == tiny_server.model_name
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    prompt = "Hello there, scheduler"
    prompt_tokens = len(tokenizer(prompt)["input_ids"])

    done = client.completions.create(model=model, prompt=prompt, max_tokens=7, temperature=0, extra_body={"ignore_eos": True})
    assert done.usage.prompt_tokens == prompt_tokens
    assert done.usage.completion_tokens == 7
    assert done.usage.total_tokens == prompt_tokens + 7
    assert done.choices[0].finish_reason == "length"

    chunks = list(
        client.completions.create(
            model=model, prompt=prompt, max_tokens=7, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == done.choices[0].text
    assert chunks[-1].usage.completion_tokens == 7 and not chunks[-1].choices
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == "length"

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected_prompt = len(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    assert chat.usage.prompt_tokens == expected_prompt
    assert chat.usage.completion_tokens == 5
    assert chat.choices[0].message.role == "assistant"
    streamed = list(
        client.chat.completions.create(
            model=model, messages=messages, max_tokens=5, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )
    content = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert content == chat.choices[0].message.content
    assert streamed[-1].usage.completion_tokens == 5


def test_64_concurrent_streams_complete_and_free_the_kv_cache(tiny_server):
    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {
            "model": tiny_server.model_name, "prompt": "word " * (5 + (i * 37) % 200),
            "max_tokens": 4 + i % 20, "temperature": 0.7, "seed": i, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        usage = None
        async with client.stream("POST", f"{tiny_server.url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage") or usage
        return usage["completion_tokens"]

    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    counts = asyncio.run(run())
    assert counts == [4 + i % 20 for i in range(64)]
    tiny_server.wait_idle()
    total = tiny_server.metric("lightllm_kv_total_tokens")
    assert tiny_server.metric("lightllm_kv_allocatable_tokens") == total


def test_client_disconnect_frees_its_request(tiny_server):
    body = {"model": tiny_server.model_name, "prompt": "long story", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{tiny_server.url}/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        for _ in range(3):
            next(lines)
    tiny_server.wait_idle()
    assert tiny_server.metric("lightllm_kv_allocatable_tokens") == tiny_server.metric("lightllm_kv_total_tokens")
    ok = httpx.post(f"{tiny_server.url}/generate", json={"inputs": "still there?", "parameters": {"max_new_tokens": 2}}, timeout=60)
    assert ok.status_code == 200


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -3}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": [1, 2, 99999]}, "prompt"),
        ("/v1/completions", {"prompt": "x " * 2000, "max_tokens": 16}, "prompt"),
        ("/v1/completions", {"prompt": 17}, "prompt"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ],
)
def test_bad_input_gets_a_4xx_naming_the_field(tiny_server, path, body, param):
    resp = httpx.post(f"{tiny_server.url}{path}", json={"model": tiny_server.model_name, **body}, timeout=30)
    assert 400 <= resp.status_code < 500
    error = resp.json()["error"]
    assert error["param"] == param, error
    assert httpx.get(f"{tiny_server.url}/health", timeout=10).status_code == 200


def test_malformed_json_and_unknown_model(tiny_server):
    resp = httpx.post(f"{tiny_server.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}, timeout=30)
    assert resp.status_code == 400 and "error" in resp.json()
    resp = httpx.post(f"{tiny_server.url}/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=30)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"


def test_infer_high_priority_cannot_be_set_from_the_api(tiny_server):
    resp = httpx.post(
        f"{tiny_server.url}/generate",
        json={"inputs": "x", "parameters": {"max_new_tokens": 2, "infer_high_priority": -5}},
        timeout=30,
    )
    assert resp.status_code == 400 and "infer_high_priority" in resp.json()["error"]["message"]
    resp = httpx.post(
        f"{tiny_server.url}/v1/completions",
        json={"model": tiny_server.model_name, "prompt": "x", "max_tokens": 2, "infer_high_priority": -5},
        timeout=30,
    )
    assert resp.status_code == 400


def test_prefix_cache_reuses_a_shared_prefix(tiny_server):
    prefix = list(range(10, 410))
    client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused")
    first = client.completions.create(model=tiny_server.model_name, prompt=prefix + [5, 6], max_tokens=2, temperature=0)
    second = client.completions.create(model=tiny_server.model_name, prompt=prefix + [7, 8, 9], max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == 402
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 400 and cached < second.usage.prompt_tokens


def test_stop_string_truncates_and_frees_the_request(tiny_server):
    client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused")
    kwargs = dict(model=tiny_server.model_name, prompt="The scheduler", temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(max_tokens=24, **kwargs).choices[0].text
    stop = full.strip()[len(full.strip()) // 2 :][:3]
    assert stop and stop in full
    cut = client.completions.create(max_tokens=24, stop=[stop], **kwargs).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full[: full.index(stop)]
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(max_tokens=24, stop=[stop], stream=True, **kwargs) if c.choices
    )
    assert streamed == cut.text
    tiny_server.wait_idle()
    assert tiny_server.metric("lightllm_kv_allocatable_tokens") == tiny_server.metric("lightllm_kv_total_tokens")


def test_n_choices_and_logprobs(tiny_server):
    client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused")
    out = client.completions.create(
        model=tiny_server.model_name, prompt=["one", "two"], n=2, max_tokens=3, temperature=0.8, seed=7,
        logprobs=2, extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 12
    for choice in out.choices:
        assert len(choice.logprobs.token_logprobs) == 3
        assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    again = client.completions.create(
        model=tiny_server.model_name, prompt=["one", "two"], n=2, max_tokens=3, temperature=0.8, seed=7,
        extra_body={"ignore_eos": True},
    )
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == [c.text for c in sorted(out.choices, key=lambda c: c.index)]


def test_burst_benchmark_counts_every_token(tiny_server, tmp_path):
    from lightllm.benchmark.bench_burst import main as burst_main

    out = tmp_path / "burst.json"
    code = burst_main(["--base-url", tiny_server.url, "--num-requests", "6", "--prompt-len", "20", "--output-len", "5",
                       "--rounds", "2", "--output-json", str(out)])
    assert code == 0
    rounds = json.loads(out.read_text())["rounds"]
    assert [r["completion_tokens"] for r in rounds] == [30, 30]


def _scrape(url: str) -> tuple[str, list]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return text, [s for f in text_string_to_metric_families(text) for s in f.samples]


def _total(samples: list, name: str, **labels: str) -> float:
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_vllm_metrics_count_what_the_responses_report(tiny_server):
    """vLLM-named series agree with the usage the responses reported, and the dashboard's queries resolve."""
    from pathlib import Path

    from lightllm.utils.check_dashboard import dashboard_problems

    client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused")
    tiny_server.wait_idle()
    _, before = _scrape(tiny_server.url)
    kwargs = dict(model=tiny_server.model_name, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(prompt="The scheduler", max_tokens=12, **kwargs)
    stop = full.choices[0].text.strip()[-3:]
    reports = [(full.usage, full.choices[0].finish_reason)]
    cut = client.completions.create(prompt="The scheduler", max_tokens=12, stop=[stop], **kwargs)
    reports.append((cut.usage, cut.choices[0].finish_reason))
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "hello"}], max_tokens=3, **kwargs)
    reports.append((chat.usage, chat.choices[0].finish_reason))
    chunks = list(client.completions.create(prompt="word " * 30, max_tokens=5, stream=True, stream_options={"include_usage": True}, **kwargs))
    reports.append((chunks[-1].usage, next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)))
    assert {reason for _, reason in reports} == {"stop", "length"}

    tiny_server.wait_idle()
    text, after = _scrape(tiny_server.url)

    def delta(name: str, **labels: str) -> float:
        return _total(after, name, **labels) - _total(before, name, **labels)

    model = {"model_name": tiny_server.model_name}
    assert delta("vllm:prompt_tokens_total", **model) == sum(u.prompt_tokens for u, _ in reports)
    assert delta("vllm:generation_tokens_total", **model) == sum(u.completion_tokens for u, _ in reports)
    for reason in ("stop", "length", "abort"):
        assert delta("vllm:request_success_total", finished_reason=reason, **model) == sum(r == reason for _, r in reports)
    assert delta("vllm:time_to_first_token_seconds_count", **model) == len(reports)
    assert delta("vllm:e2e_request_latency_seconds_count", **model) == len(reports)
    assert delta("vllm:inter_token_latency_seconds_count", **model) == sum(u.completion_tokens - 1 for u, _ in reports)
    assert delta("vllm:request_prompt_tokens_sum", **model) == sum(u.prompt_tokens for u, _ in reports)
    assert delta("vllm:request_generation_tokens_count", **model) == len(reports)
    assert 0 < delta("vllm:time_to_first_token_seconds_sum", **model) <= delta("vllm:e2e_request_latency_seconds_sum", **model)
    # Queue, prefill and inference times split each request at the moment rank 0 first scheduled it.
    for name in ("request_queue_time", "request_prefill_time", "request_inference_time"):
        assert delta(f"vllm:{name}_seconds_count", **model) == len(reports), name
    queue = delta("vllm:request_queue_time_seconds_sum", **model)
    prefill = delta("vllm:request_prefill_time_seconds_sum", **model)
    assert 0 < queue < delta("vllm:time_to_first_token_seconds_sum", **model)
    assert queue + prefill == pytest.approx(delta("vllm:time_to_first_token_seconds_sum", **model), abs=1e-6)
    assert queue + delta("vllm:request_inference_time_seconds_sum", **model) == pytest.approx(
        delta("vllm:e2e_request_latency_seconds_sum", **model), abs=1e-6)
    assert _total(after, "vllm:num_requests_running", **model) == _total(after, "vllm:num_requests_waiting", **model) == 0
    assert 0 <= _total(after, "vllm:kv_cache_usage_perc", **model) < 1
    assert _total(after, "vllm:num_preemptions_total", **model) >= 0
    assert _total(after, "lightllm_backend_steps_total", **model) > _total(before, "lightllm_backend_steps_total", **model)
    dashboard = json.loads((Path(__file__).resolve().parents[2] / "docs" / "dashboards" / "lightllm_grafana.json").read_text())
    assert dashboard_problems(dashboard, text) == []


def test_a_prompt_logprobs_request_is_no_prefix_cache_query(tiny_server):
    """It computes every prompt position and reads nothing from the cache: vLLM's hit rate
    (hits / queries) must not count it."""
    tiny_server.wait_idle()
    _, before = _scrape(tiny_server.url)
    httpx.post(f"{tiny_server.url}/v1/completions", timeout=60, json={
        "model": tiny_server.model_name, "prompt": "score every token of this prompt", "max_tokens": 1,
        "prompt_logprobs": 1}).raise_for_status()
    tiny_server.wait_idle()
    _, after = _scrape(tiny_server.url)

    def delta(name: str) -> float:
        return (_total(after, name, model_name=tiny_server.model_name)
                - _total(before, name, model_name=tiny_server.model_name))

    assert delta("vllm:prompt_tokens_total") > 0
    assert delta("vllm:prefix_cache_queries_total") == 0 and delta("vllm:prefix_cache_hits_total") == 0


def test_n_choices_count_their_prompt_once_per_choice(tiny_server):
    """With n > 1 the prompt is counted once per choice in the vLLM counters (as vLLM 0.32 counts it),
    once in the response's usage."""
    client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused")
    tiny_server.wait_idle()
    _, before = _scrape(tiny_server.url)
    out = client.completions.create(model=tiny_server.model_name, prompt="count this prompt once", n=3, max_tokens=2,
                                    temperature=0.9, seed=5, extra_body={"ignore_eos": True})
    native = httpx.post(f"{tiny_server.url}/generate", timeout=60, json={
        "inputs": "and this one", "parameters": {"n": 2, "max_new_tokens": 2, "ignore_eos": True}}).json()
    tiny_server.wait_idle()
    _, after = _scrape(tiny_server.url)

    def delta(name: str, **labels: str) -> float:
        return _total(after, name, model_name=tiny_server.model_name, **labels) - _total(
            before, name, model_name=tiny_server.model_name, **labels)

    prompts = 3 * out.usage.prompt_tokens + 2 * native["prompt_tokens"]
    assert len(out.choices) == 3 and len(native["generated_text"]) == 2
    assert delta("vllm:prompt_tokens_total") == prompts
    assert delta("vllm:prefix_cache_queries_total") == prompts
    assert 0 <= delta("vllm:prefix_cache_hits_total") <= prompts
    assert delta("vllm:generation_tokens_total") == 3 * 2 + 2 * 2
    assert delta("vllm:request_success_total", finished_reason="length") == 5


def test_request_params_n_and_iteration_tokens_count_a_known_request_mix(tiny_server):
    """vLLM's request_params_n gets one observation of n per prompt; iteration_tokens_total one
    observation per engine step, of the tokens its forwards took in."""
    model = {"model_name": tiny_server.model_name}
    tiny_server.wait_idle()
    _, before = _scrape(tiny_server.url)
    # One request alone: a prefill step, then one decode step per further token.
    single = httpx.post(f"{tiny_server.url}/v1/completions", timeout=60, json={
        "model": tiny_server.model_name, "prompt": "a lone request for the step histogram", "max_tokens": 4,
        "temperature": 0, "ignore_eos": True}).json()
    tiny_server.wait_idle()
    _, alone = _scrape(tiny_server.url)

    def delta(name: str, start: list, end: list, **labels: str) -> float:
        return _total(end, name, **model, **labels) - _total(start, name, **model, **labels)

    computed = single["usage"]["prompt_tokens"] - delta("vllm:prefix_cache_hits_total", before, alone)
    assert single["usage"]["completion_tokens"] == 4
    assert delta("vllm:iteration_tokens_total_count", before, alone) == 4
    assert delta("vllm:iteration_tokens_total_sum", before, alone) == computed + 3
    assert delta("vllm:iteration_tokens_total_bucket", before, alone, le="1.0") == 3
    assert delta("vllm:request_params_n_count", before, alone) == 1
    assert delta("vllm:request_params_n_bucket", before, alone, le="1.0") == 1
    # Two prompts with n=2, a chat with n=1, /generate with n=3.
    client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused")
    kwargs = dict(model=tiny_server.model_name, max_tokens=3, extra_body={"ignore_eos": True})
    out = client.completions.create(prompt=["first of two", "second of two"], n=2, temperature=0.8, seed=3, **kwargs)
    assert len(out.choices) == 4
    client.chat.completions.create(messages=[{"role": "user", "content": "one choice"}], temperature=0, **kwargs)
    native = httpx.post(f"{tiny_server.url}/generate", timeout=60, json={
        "inputs": "three choices", "parameters": {"n": 3, "max_new_tokens": 3, "ignore_eos": True}}).json()
    assert len(native["generated_text"]) == 3
    tiny_server.wait_idle()
    _, after = _scrape(tiny_server.url)
    assert delta("vllm:request_params_n_count", alone, after) == 4
    assert delta("vllm:request_params_n_sum", alone, after) == 2 + 2 + 1 + 3
    for bound, count in (("1.0", 1), ("2.0", 3), ("5.0", 4), ("20.0", 4), ("+Inf", 4)):
        assert delta("vllm:request_params_n_bucket", alone, after, le=bound) == count, bound
    assert delta("lightllm_request_params_n_count", alone, after) == 4
    # Every token a forward took in is in one step: each generation's uncached prompt tokens and
    # every generated token but its last (nothing was paused, so nothing was computed twice).
    generations = sum(delta("vllm:request_success_total", alone, after, finished_reason=r) for r in ("stop", "length"))
    assert generations == 4 + 1 + 3
    fed = (delta("vllm:prompt_tokens_total", alone, after) - delta("vllm:prefix_cache_hits_total", alone, after)
           + delta("vllm:generation_tokens_total", alone, after) - generations)
    assert delta("vllm:num_preemptions_total", alone, after) == 0
    assert delta("vllm:iteration_tokens_total_sum", alone, after) == fed
    steps = delta("lightllm_backend_steps_total", alone, after)
    assert 0 < delta("vllm:iteration_tokens_total_count", alone, after) <= steps
