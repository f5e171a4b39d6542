"""``--logprobs_mode``: scaled logprobs (default) describe the distribution before the top-k / top-p /
min-p filters, processed ones (vLLM's meaning) the filtered one a token was drawn from, raw ones (vLLM's
default) the model's own; each checked against transformers on real servers."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
import torch

from server_process import start_server

from .support import ATOL, reference_logprobs

PROMPT = "The quick brown fox"
# Temperature and a bias make the two modes differ; a seed makes both servers draw the same tokens.
BODY = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0.5, "seed": 7, "logprobs": 3, "ignore_eos": True,
        "return_tokens_as_token_ids": True}


def _server_in_mode(tiny_llama_dir, tmp_path_factory, mode: str):
    handle = start_server(tiny_llama_dir, tmp_path_factory.mktemp("logs"),
                          ["--max_total_token_num", "8192", "--logprobs_mode", mode])
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def raw_server(tiny_llama_dir, tmp_path_factory):
    """A server that reports raw logprobs."""
    yield from _server_in_mode(tiny_llama_dir, tmp_path_factory, "raw_logprobs")


@pytest.fixture(scope="module")
def processed_server(tiny_llama_dir, tmp_path_factory):
    """A server that reports processed logprobs (vLLM's meaning)."""
    yield from _server_in_mode(tiny_llama_dir, tmp_path_factory, "processed_logprobs")


def _answer(server, bias_id: int) -> tuple[list[int], list[float], list[dict[int, float]]]:
    body = {**BODY, "model": server.model_name, "logit_bias": {str(bias_id): 3.0}}
    logprobs = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]
    ids = [int(token.split(":", 1)[1]) for token in logprobs["tokens"]]
    tops = [{int(key.split(":", 1)[1]): value for key, value in row.items()} for row in logprobs["top_logprobs"]]
    return ids, logprobs["token_logprobs"], tops


def test_raw_logprobs_are_the_models_and_processed_ones_the_drawn_distributions(
        raw_server, tiny_server, hf_model, tokenizer):
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    bias_id = int(hf_model(torch.tensor([prompt_ids])).logits[0, -1].argsort()[-2])
    raw_ids, raw_chosen, raw_tops = _answer(raw_server, bias_id)
    ids, chosen, tops = _answer(tiny_server, bias_id)
    assert raw_ids == ids  # the mode changes what is reported, not what is drawn
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids + ids[:-1]])).logits[0, len(prompt_ids) - 1:].float()
    raw = reference_logprobs(hf_model, prompt_ids, ids)
    biased = logits.clone()
    biased[:, bias_id] += 3.0
    processed = torch.log_softmax(biased / 0.5, dim=-1)
    for row, token_id in enumerate(ids):
        assert raw_chosen[row] == pytest.approx(float(raw[row, token_id]), abs=ATOL)
        assert chosen[row] == pytest.approx(float(processed[row, token_id]), abs=ATOL)
        for reference, top in ((raw[row], raw_tops[row]), (processed[row], tops[row])):
            values, top_ids = reference.topk(3)
            # Completions list the 3 best plus the chosen token.
            assert sorted(top, key=lambda key: -top[key])[:3] == top_ids.tolist()
            assert [top[key] for key in top_ids.tolist()] == pytest.approx(values.tolist(), abs=ATOL)
    assert max(abs(a - b) for a, b in zip(raw_chosen, chosen)) > 0.1


def test_processed_logprobs_are_the_filtered_distribution_a_token_was_drawn_from(processed_server, hf_model,
                                                                               tokenizer):
    # As vLLM's processed_logprobs: after bias and temperature, the top-k filter, renormalised;
    # a filtered alternative is -inf (-9999.0 in JSON).
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    bias_id = int(hf_model(torch.tensor([prompt_ids])).logits[0, -1].argsort()[-2])
    body = {**BODY, "model": processed_server.model_name, "logit_bias": {str(bias_id): 3.0}, "top_k": 3,
            "logprobs": 4}
    logprobs = httpx.post(f"{processed_server.url}/v1/completions", json=body, timeout=60).json()["choices"][0][
        "logprobs"]
    ids = [int(token.split(":", 1)[1]) for token in logprobs["tokens"]]
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids + ids[:-1]])).logits[0, len(prompt_ids) - 1:].float()
    logits[:, bias_id] += 3.0
    scaled = logits / 0.5
    kept = scaled.topk(3)
    filtered = torch.full_like(scaled, float("-inf")).scatter(1, kept.indices, kept.values)
    expected = torch.log_softmax(filtered, dim=-1)
    for row, token_id in enumerate(ids):
        assert token_id in kept.indices[row].tolist()
        assert logprobs["token_logprobs"][row] == pytest.approx(float(expected[row, token_id]), abs=ATOL)
        top = {int(key.split(":", 1)[1]): value for key, value in logprobs["top_logprobs"][row].items()}
        best = sorted(top, key=lambda key: -top[key])
        assert best[:3] == kept.indices[row].tolist()
        assert [top[key] for key in best[:3]] == pytest.approx(expected[row, best[:3]].tolist(), abs=ATOL)
        assert top[best[3]] == -9999.0


def test_a_grammar_masks_raw_logprobs_as_vllm_masks_them(raw_server, tiny_server):
    # vLLM 0.32 applies the grammar's bitmask to the logits before its sampler computes raw
    # logprobs: for a greedy constrained request raw and processed logprobs are the same
    # renormalised distribution (a forbidden alternative is -inf, -9999.0 in JSON, in both).
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 3, "guided_choice": ["yes", "no"],
            "return_tokens_as_token_ids": True}
    answers = [httpx.post(f"{server.url}/v1/completions", json={**body, "model": server.model_name},
                          timeout=60).json()["choices"][0]["logprobs"] for server in (raw_server, tiny_server)]
    raw, processed = answers
    assert raw["tokens"] == processed["tokens"]
    assert raw["token_logprobs"] == pytest.approx(processed["token_logprobs"], abs=ATOL)
    for raw_top, processed_top in zip(raw["top_logprobs"], processed["top_logprobs"]):
        assert raw_top.keys() == processed_top.keys()
        assert [raw_top[key] for key in raw_top] == pytest.approx([processed_top[key] for key in raw_top], abs=ATOL)
    # Renormalised over the few tokens the grammar allows (the model's own are near -8 here).
    assert all(value > -4.0 for value in raw["token_logprobs"])


def test_a_bad_logprobs_mode_is_refused_in_one_line(tiny_llama_dir, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lightllm.server.api_server", "--model_dir", str(tiny_llama_dir),
                           "--logprobs_mode", "raw_logits"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--logprobs_mode" in proc.stderr.strip().splitlines()[-1]
