"""lm-eval's local-completions model against the server: its exact loglikelihood request, then a whole run.
"""

from __future__ import annotations

import json

import httpx
import pytest

from .support import ATOL, reference_prompt_logprobs


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
