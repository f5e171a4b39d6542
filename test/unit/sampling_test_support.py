"""Helpers shared by the sampler tests (test_sampling_*.py)."""

from __future__ import annotations

from typing import Sequence

from lightllm.common.sampling import SamplingParams
from lightllm.common.sampling.sampling_batch import SamplingBatch


def build(
    params: Sequence[SamplingParams],
    prompts: Sequence[Sequence[int]] | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
    eos: Sequence[int] = (),
    vocab: int = 8,
    device: str = "cpu",
) -> SamplingBatch:
    """``SamplingBatch.build`` with empty prompts / outputs and no EOS unless given."""
    size = len(params)
    prompts = prompts if prompts is not None else [[] for _ in range(size)]
    outputs = outputs if outputs is not None else [[] for _ in range(size)]
    return SamplingBatch.build(params, prompts, outputs, list(eos), vocab, device)
