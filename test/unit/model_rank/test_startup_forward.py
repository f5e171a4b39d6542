"""The start-up forward: the largest prefill the planner can build, run once and given back."""

from __future__ import annotations

import pytest
import torch

from lightllm.common.req_manager import ReqManager
from lightllm.models.registry import load_model
from lightllm.server.model_rank.execution.forward_threads import ForwardThreads
from lightllm.server.model_rank.execution.startup_forward import run_startup_forward, startup_forward_lengths


@pytest.mark.parametrize(
    "budget, chunk, sequence, rows, slots, expected",
    [
        (2048, 1024, 4096, 8, 10_000, [1024, 1024]),
        (2048, None, 4096, 8, 10_000, [2048]),  # no chunking: one prompt as long as the budget
        (8192, None, 3000, 8, 10_000, [3000, 3000, 2192]),  # a prompt never exceeds the sequence limit
        (2000, 768, 4096, 8, 10_000, [768, 768, 464]),  # budgets that are not multiples of the chunk
        (2048, 256, 4096, 3, 10_000, [256, 256, 256]),  # no more requests than rows
        (2048, 1024, 4096, 8, 1500, [1024, 476]),  # no more tokens than free slots
        (2048, 1024, 4096, 0, 10_000, []),
    ],
)
def test_lengths_are_the_planners_largest_prefill(budget, chunk, sequence, rows, slots, expected):
    assert startup_forward_lengths(budget, chunk, sequence, rows, slots) == expected


def test_the_forward_runs_and_gives_back_every_slot_and_row(tiny_llama_dir):
    model = load_model(str(tiny_llama_dir), dtype=torch.float32)
    kv_cache = model.new_kv_cache(600)
    req_manager = ReqManager(4, 301)
    threads = ForwardThreads(1, 1)
    lengths = startup_forward_lengths(512, 200, 300, 4, kv_cache.available)
    assert lengths == [200, 200, 112]
    assert run_startup_forward(model, kv_cache, req_manager, lengths, threads) > 0
    assert kv_cache.available == 600 and req_manager.available == 4
    assert run_startup_forward(model, kv_cache, req_manager, []) == 0.0


def test_a_failing_forward_still_gives_everything_back(tiny_llama_dir):
    model = load_model(str(tiny_llama_dir), dtype=torch.float32)
    kv_cache = model.new_kv_cache(600)
    req_manager = ReqManager(4, 301)

    def broken_forward(*_args):
        raise RuntimeError("out of memory")

    model.forward = broken_forward
    with pytest.raises(RuntimeError, match="out of memory"):
        run_startup_forward(model, kv_cache, req_manager, [200, 200])
    assert kv_cache.available == 600 and req_manager.available == 4
