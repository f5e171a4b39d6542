"""Reference values and stream parsing shared by the compatibility tests.

Reference values come from transformers running the same checkpoint: the log-softmax of the
next-token logits at every generated position (greedy, so temperature 1).
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch

ATOL = 2e-3


def reference_logprobs(hf_model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """``[len(output_ids), V]`` log-softmax of the logits that predicted each output token."""
    ids = torch.tensor([prompt_ids + output_ids[:-1]])
    with torch.no_grad():
        logits = hf_model(ids).logits[0, len(prompt_ids) - 1 :].float()
    return torch.log_softmax(logits, dim=-1)


def reference_prompt_logprobs(hf_model, prompt_ids: list[int]) -> torch.Tensor:
    """``[len(prompt_ids) - 1, V]``: log-softmax of the logits that predicted prompt tokens 1..."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids])).logits[0, :-1].float()
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


def sse_chunks(url: str, body: dict) -> list[dict]:
    """The JSON payloads of a streamed (SSE) response, ``[DONE]`` left out; fails unless it is a 200."""
    chunks = []
    with httpx.stream("POST", url, json=body, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks
