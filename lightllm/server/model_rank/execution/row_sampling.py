"""Sampling a step's logits so that one request's failure stays that request's.

The whole batch is sampled in one call; only when that call fails is each row sampled alone,
and a row that still fails gets :data:`FAILED_TOKEN`.  Under tensor parallelism rank 0's tokens
are broadcast, so the marker also tells the other ranks which requests to finish with an error.
"""

from __future__ import annotations

import logging
from typing import List, Sequence, Tuple

import torch

from lightllm.common.sampling.sampler import Sampler
from lightllm.common.sampling.sampling_batch import SamplingBatch
from lightllm.server.model_rank.scheduling.infer_req import InferReq

log = logging.getLogger("lightllm.model_rank")

FAILED_TOKEN = -1

TopLogprobs = List[Tuple[int, float]]


def sampling_batch(logits: torch.Tensor, reqs: Sequence[InferReq], eos_token_ids: Sequence[int]) -> SamplingBatch:
    """The :class:`SamplingBatch` of ``reqs`` (one per row of ``logits``)."""
    return SamplingBatch.build(
        [r.sampling for r in reqs],
        [r.prompt_ids for r in reqs],
        [r.output_ids for r in reqs],
        eos_token_ids,
        logits.shape[1],
        logits.device,
        generated_before=[r.generated_before for r in reqs],
    )


def sample_rows(
    sampler: Sampler, logits: torch.Tensor, reqs: Sequence[InferReq], eos_token_ids: Sequence[int]
) -> Tuple[torch.Tensor, List[float], List[TopLogprobs]]:
    """Sample the whole batch; if that fails, each row alone, with ``FAILED_TOKEN`` for rows that fail.

    Returns the tokens, their logprobs and each row's requested top alternatives (empty for rows
    that asked for none).
    """
    try:
        out = sampler.sample(logits, sampling_batch(logits, reqs, eos_token_ids))
        return out.next_token_ids, out.logprobs.tolist(), [out.row_top_logprobs(r) for r in range(len(reqs))]
    except Exception:
        log.exception("sampling a batch of %d failed; retrying its requests one by one", len(reqs))
    tokens: List[int] = []
    logprobs: List[float] = []
    tops: List[TopLogprobs] = []
    for row, req in enumerate(reqs):
        try:
            out = sampler.sample(logits[row : row + 1], sampling_batch(logits, [req], eos_token_ids))
            tokens.append(int(out.next_token_ids[0]))
            logprobs.append(float(out.logprobs[0]))
            tops.append(out.row_top_logprobs(0))
        except Exception:
            log.exception("sampling failed for request %d; finishing it with an error", req.request_id)
            tokens.append(FAILED_TOKEN)
            logprobs.append(float("nan"))
            tops.append([])
    return torch.tensor(tokens, dtype=torch.long, device=logits.device), logprobs, tops
