"""Torch threads per kind of forward: the launcher's defaults and overrides, the switch around a
prefill or long-context decode forward, and the executor running each forward under its count."""

from __future__ import annotations

import os

import pytest
import torch

from lightllm.common.basemodel.model_config import ModelConfig
from lightllm.server.api_args_check import validate_args
from lightllm.server.api_cli import make_argument_parser
from lightllm.server.launch_plan import build_process_configs, plan_layout, resolve_sampling_seed
from lightllm.server.router.model_infer.mode_backend.forward_threads import DEFAULT_LONG_DECODE_POSITIONS, ForwardThreads
from lightllm.server.server_sizing import plan_sizing


def _sizing(model_dir, tp: int):
    args = make_argument_parser().parse_args(
        ["--model_dir", str(model_dir), "--tp", str(tp), "--device", "cpu", "--max_total_token_num", "512",
         "--max_req_total_len", "256"]
    )
    validate_args(args, 0)
    return args, plan_sizing(args, ModelConfig.from_dir(args.model_dir), "cpu")


@pytest.fixture
def cores(monkeypatch) -> int:
    monkeypatch.delenv("LIGHTLLM_TORCH_THREADS", raising=False)
    monkeypatch.delenv("LIGHTLLM_PREFILL_TORCH_THREADS", raising=False)
    monkeypatch.delenv("LIGHTLLM_LONG_DECODE_POSITIONS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 9)
    return 9


@pytest.mark.parametrize("tp", [1, 2])
def test_decode_leaves_a_core_and_prefill_takes_every_core_by_default(tiny_llama_dir, cores, tp) -> None:
    args, sizing = _sizing(tiny_llama_dir, tp)
    assert sizing.torch_threads == (cores - 1) // tp
    assert sizing.prefill_torch_threads == cores // tp
    assert sizing.long_decode_positions == DEFAULT_LONG_DECODE_POSITIONS
    configs = build_process_configs(args, sizing, ModelConfig.from_dir(args.model_dir),
                                    plan_layout(sizing, "lightllm_test_threads", "/tmp/lightllm_test_threads"),
                                    nccl_port=29999, sampling_seed=resolve_sampling_seed(args))
    assert {(rank.torch_threads, rank.prefill_torch_threads, rank.long_decode_positions) for rank in configs.ranks} == {
        ((cores - 1) // tp, cores // tp, DEFAULT_LONG_DECODE_POSITIONS)}


def test_one_core_gives_one_thread_to_both(tiny_llama_dir, monkeypatch) -> None:
    monkeypatch.delenv("LIGHTLLM_TORCH_THREADS", raising=False)
    monkeypatch.delenv("LIGHTLLM_PREFILL_TORCH_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    _, sizing = _sizing(tiny_llama_dir, 2)
    assert (sizing.torch_threads, sizing.prefill_torch_threads) == (1, 1)


def test_torch_threads_sets_both_and_the_prefill_variable_only_prefill(tiny_llama_dir, cores, monkeypatch) -> None:
    monkeypatch.setenv("LIGHTLLM_TORCH_THREADS", "3")
    _, sizing = _sizing(tiny_llama_dir, 1)
    assert (sizing.torch_threads, sizing.prefill_torch_threads) == (3, 3)
    monkeypatch.setenv("LIGHTLLM_PREFILL_TORCH_THREADS", "5")
    _, sizing = _sizing(tiny_llama_dir, 1)
    assert (sizing.torch_threads, sizing.prefill_torch_threads) == (3, 5)
    monkeypatch.delenv("LIGHTLLM_TORCH_THREADS")
    _, sizing = _sizing(tiny_llama_dir, 1)
    assert (sizing.torch_threads, sizing.prefill_torch_threads) == (cores - 1, 5)


def test_the_long_decode_threshold_is_read_and_0_turns_it_off(tiny_llama_dir, cores, monkeypatch) -> None:
    monkeypatch.setenv("LIGHTLLM_LONG_DECODE_POSITIONS", "1000")
    assert _sizing(tiny_llama_dir, 1)[1].long_decode_positions == 1000
    monkeypatch.setenv("LIGHTLLM_LONG_DECODE_POSITIONS", "0")
    assert _sizing(tiny_llama_dir, 1)[1].long_decode_positions == 0
    for value in ("-1", "many"):
        monkeypatch.setenv("LIGHTLLM_LONG_DECODE_POSITIONS", value)
        with pytest.raises(ValueError, match="LIGHTLLM_LONG_DECODE_POSITIONS must be an integer >= 0"):
            _sizing(tiny_llama_dir, 1)


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_a_bad_prefill_thread_count_is_refused_by_name(tiny_llama_dir, cores, monkeypatch, value) -> None:
    monkeypatch.setenv("LIGHTLLM_PREFILL_TORCH_THREADS", value)
    with pytest.raises(ValueError, match="LIGHTLLM_PREFILL_TORCH_THREADS must be a positive integer"):
        _sizing(tiny_llama_dir, 1)


def test_wide_forwards_switch_and_restore_even_when_the_body_raises() -> None:
    before = torch.get_num_threads()
    try:
        threads = ForwardThreads(narrow=1, wide=2, long_decode_positions=100)
        threads.apply()
        assert torch.get_num_threads() == 1
        with threads.prefill_forward():
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
        with threads.decode_forward(99):
            assert torch.get_num_threads() == 1
        with threads.decode_forward(100):
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
        with pytest.raises(RuntimeError, match="boom"):
            with threads.prefill_forward():
                raise RuntimeError("boom")
        assert torch.get_num_threads() == 1
        with ForwardThreads(narrow=1, wide=2, long_decode_positions=0).decode_forward(10**9):
            assert torch.get_num_threads() == 1  # 0: decode never runs wide
        with ForwardThreads(narrow=1, wide=1).prefill_forward():
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("narrow, wide, positions", [(0, 1, 0), (1, 0, 0), (1, 1, -1)])
def test_bad_settings_are_refused(narrow, wide, positions) -> None:
    with pytest.raises(ValueError, match="must be"):
        ForwardThreads(narrow, wide, positions)


def test_the_executor_runs_prefill_forwards_with_the_prefill_count_and_decode_with_the_decode_count(tiny_llama_dir) -> None:
    from lightllm.common.req_manager import ReqManager
    from lightllm.common.sampling import Sampler, SamplingParams
    from lightllm.models.registry import load_model
    from lightllm.server.router.model_infer.infer_context import InferenceContext
    from lightllm.server.router.model_infer.mode_backend.prefill_queue_strategy import build_prefill_queue_strategy
    from lightllm.server.router.model_infer.mode_backend.rank_backend import build_rank_backend
    from lightllm.server.router.model_infer.mode_backend.step_planner import StepPlanner

    model = load_model(str(tiny_llama_dir), dtype=torch.float32)
    seen: list[tuple[int, int]] = []  # (tokens in the forward, torch threads during it)
    forward = model.forward

    def recording_forward(batch, *args, **kwargs):
        seen.append((int(batch.input_ids.numel()), torch.get_num_threads()))
        return forward(batch, *args, **kwargs)

    def run(threads):  # two prompts (5 and 3 tokens), 4 new tokens each
        context = InferenceContext(model.new_kv_cache(256), ReqManager(4, 128), use_prefix_cache=False)
        backend = build_rank_backend("normal", model, context, build_prefill_queue_strategy("default"),
                                     StepPlanner(64, 32), Sampler(0), [2], 128, threads=threads)
        for request_id, prompt in enumerate([[5, 6, 7, 8, 9], [11, 12, 13]]):
            backend.add_request(request_id, prompt, SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
        outputs = {}
        while backend.has_work:
            for req, _ in backend.step().finished:
                outputs[req.request_id] = list(req.output_ids)
        return outputs

    before = torch.get_num_threads()
    model.forward = recording_forward
    try:
        plain = run(None)
        seen.clear()
        threads = ForwardThreads(narrow=1, wide=2, long_decode_positions=11)
        threads.apply()
        assert run(threads) == plain  # the thread count changes no result
        assert torch.get_num_threads() == 1
    finally:
        model.forward = forward
        torch.set_num_threads(before)
    # Both prompts in one wide prefill forward; then decode forwards of both rows, whose contexts
    # sum to 5 + 3 = 8, 10, 12 positions: narrow below the threshold of 11, wide from it.
    assert seen == [(8, 2), (2, 1), (2, 1), (2, 2)]
