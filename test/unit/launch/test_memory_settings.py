"""glibc malloc settings of the children, idle trimming, and the KV budget rule."""

from __future__ import annotations

import pytest
import torch

from lightllm.common.basemodel.model_config import ModelConfig
from lightllm.server.argument_error import ArgumentError
from lightllm.server.launch.args_check import validate_args
from lightllm.server.launch.arg_parser import make_argument_parser
from lightllm.server.launch.kv_budget import GIB, KVBudget, activation_bytes, plan_kv_budget, weights_bytes
from lightllm.server.launch.sizing import plan_sizing
from lightllm.utils.malloc_tuning import (
    IdleMallocTrimmer,
    apply_child_malloc_env,
    child_malloc_env,
    malloc_trim,
)


def test_children_get_a_high_mmap_threshold_but_a_moderate_trim_threshold():
    env = child_malloc_env()
    assert int(env["MALLOC_MMAP_THRESHOLD_"]) == 1 << 32
    assert 0 < int(env["MALLOC_TRIM_THRESHOLD_"]) <= 1 << 30  # a peak is given back, not kept forever
    environ = {"MALLOC_TRIM_THRESHOLD_": "1234"}
    assert apply_child_malloc_env(environ) == {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": "1234"}


def test_idle_trimmer_trims_once_per_idle_period_after_work():
    now = [0.0]
    calls = []
    trimmer = IdleMallocTrimmer(1.0, clock=lambda: now[0], trim=lambda: calls.append(now[0]) or True, enabled=True)
    assert not trimmer.idle()  # no work yet: nothing to give back
    trimmer.busy()
    now[0] = 0.5
    assert not trimmer.idle()  # not idle long enough
    now[0] = 1.2
    assert trimmer.idle() and calls == [1.2]
    now[0] = 5.0
    assert not trimmer.idle()  # still the same idle period
    trimmer.busy()
    now[0] = 6.5
    assert trimmer.idle() and trimmer.trims == 2
    off = IdleMallocTrimmer(0.0, clock=lambda: now[0], trim=lambda: calls.append(-1) or True, enabled=False)
    off.busy()
    assert not off.idle() and calls == [1.2, 6.5]
    with pytest.raises(ValueError):
        IdleMallocTrimmer(-1.0)


def test_malloc_trim_runs_on_glibc():
    assert malloc_trim() in (True, False)  # False only where libc has no malloc_trim


def test_budget_is_never_negative_and_follows_the_rule():
    budget = KVBudget(available=10 * GIB, weights=2 * GIB, reserve=3 * GIB, mem_fraction=0.5)
    assert budget.kv_bytes == int(2.5 * GIB)
    assert "reserve 3.00" in budget.describe()
    assert KVBudget(available=GIB, weights=GIB, reserve=GIB, mem_fraction=0.9).kv_bytes == 0


def test_weights_are_counted_at_the_serving_dtype(tiny_llama_dir):
    stored = sum(p.stat().st_size for p in tiny_llama_dir.glob("*.safetensors"))
    assert weights_bytes(str(tiny_llama_dir), torch.float32, torch.float32) == stored
    assert weights_bytes(str(tiny_llama_dir), torch.bfloat16, torch.float32) == 2 * stored


def test_activation_estimate_grows_with_the_batch_and_shrinks_with_tp(tiny_llama_dir):
    config = ModelConfig.from_dir(tiny_llama_dir)
    small = activation_bytes(config, 1, 256, 256, 1024, 16)
    assert activation_bytes(config, 1, 2048, 1024, 1024, 16) > small
    assert activation_bytes(config, 2, 256, 256, 1024, 16) < small


def _budget(tiny_llama_dir, device="cpu", reserved=None, tp=1):
    return plan_kv_budget(
        device=device, config=ModelConfig.from_dir(tiny_llama_dir), model_dir=str(tiny_llama_dir),
        serving_dtype=torch.float32, tp=tp, mem_fraction=0.9, reserved_memory_gb=reserved,
        batch_max_tokens=2048, chunk_tokens=1024, max_req_total_len=4096, max_batch_rows=256,
    )


def test_cpu_reserve_covers_processes_activations_and_a_share_of_the_machine(tiny_llama_dir):
    budget = _budget(tiny_llama_dir)
    assert budget.reserve > 1.5 * GIB  # three children at 0.5 GiB each, before activations and the machine share
    assert _budget(tiny_llama_dir, tp=2).reserve > budget.reserve
    explicit = _budget(tiny_llama_dir, reserved=1.5)
    assert explicit.reserve == int(1.5 * GIB) and explicit.kv_bytes > budget.kv_bytes


def test_reserved_memory_flag_is_validated_and_used_by_sizing(tiny_llama_dir):
    parser = make_argument_parser()
    with pytest.raises(ArgumentError, match="--reserved_memory_gb must be a finite number >= 0"):
        validate_args(parser.parse_args(["--model_dir", "m", "--reserved_memory_gb", "-1"]))
    config = ModelConfig.from_dir(tiny_llama_dir)
    args = parser.parse_args(["--model_dir", str(tiny_llama_dir), "--reserved_memory_gb", "100000"])
    with pytest.raises(ArgumentError, match="--reserved_memory_gb"):
        plan_sizing(args, config, "cpu")  # the reserve leaves nothing for the KV cache
    args.reserved_memory_gb = 0.0
    assert plan_sizing(args, config, "cpu").max_total_token_num >= config.max_position_embeddings
