"""Torch threads per forward: the launcher's defaults and overrides, the cost rule that decides wide
or narrow from a forward's work per streamed token, and the executor running each forward under its count."""

from __future__ import annotations

import os

import pytest
import torch

from lightllm.common.basemodel.attention.torch_sdpa import TorchSdpaAttention
from lightllm.common.basemodel.model_config import ModelConfig
from lightllm.server.argument_error import ArgumentError
from lightllm.server.launch.args_check import validate_args
from lightllm.server.launch.arg_parser import make_argument_parser
from lightllm.server.launch.plan import build_process_configs, plan_layout, resolve_sampling_seed
from lightllm.server.model_rank.execution.forward_cost import (
    ForwardCostModel, ForwardShape, MachineRates, measure_rates,
)
from lightllm.server.model_rank.execution.forward_threads import (
    DEFAULT_WIDE_FORWARD_MS_PER_TOKEN, ForwardThreads, WideForwardRule,
)
from lightllm.server.launch.sizing import plan_sizing
from lightllm.server.core.objs.request_spec import RequestSpec


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
    monkeypatch.delenv("LIGHTLLM_WIDE_FORWARD_MS_PER_TOKEN", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 9)
    return 9


@pytest.mark.parametrize("tp", [1, 2])
def test_decode_leaves_a_core_and_prefill_takes_every_core_by_default(tiny_llama_dir, cores, tp) -> None:
    args, sizing = _sizing(tiny_llama_dir, tp)
    assert sizing.torch_threads == (cores - 1) // tp
    assert sizing.prefill_torch_threads == cores // tp
    assert sizing.wide_forward_ms_per_token == DEFAULT_WIDE_FORWARD_MS_PER_TOKEN
    configs = build_process_configs(args, sizing, ModelConfig.from_dir(args.model_dir),
                                    plan_layout(sizing, "lightllm_test_threads", "/tmp/lightllm_test_threads"),
                                    nccl_port=29999, sampling_seed=resolve_sampling_seed(args))
    assert {(rank.torch_threads, rank.prefill_torch_threads, rank.wide_forward_ms_per_token) for rank in configs.ranks} == {
        ((cores - 1) // tp, cores // tp, DEFAULT_WIDE_FORWARD_MS_PER_TOKEN)}


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
    monkeypatch.setenv("LIGHTLLM_PREFILL_TORCH_THREADS", str(cores))
    _, sizing = _sizing(tiny_llama_dir, 1)
    assert (sizing.torch_threads, sizing.prefill_torch_threads) == (cores - 1, cores)
    # Fewer wide threads than every forward has would make the wide forwards the narrow ones.
    monkeypatch.setenv("LIGHTLLM_PREFILL_TORCH_THREADS", "5")
    with pytest.raises(ArgumentError, match=rf"LIGHTLLM_PREFILL_TORCH_THREADS=5 is below the {cores - 1} threads of "
                                            rf"every forward \(the default for {cores} CPUs and --tp 1\)"):
        _sizing(tiny_llama_dir, 1)


def test_the_wide_forward_threshold_is_read(tiny_llama_dir, cores, monkeypatch) -> None:
    monkeypatch.setenv("LIGHTLLM_WIDE_FORWARD_MS_PER_TOKEN", "1.5")
    assert _sizing(tiny_llama_dir, 1)[1].wide_forward_ms_per_token == 1.5
    monkeypatch.setenv("LIGHTLLM_WIDE_FORWARD_MS_PER_TOKEN", "inf")
    assert _sizing(tiny_llama_dir, 1)[1].wide_forward_ms_per_token == float("inf")
    for value in ("-1", "many", "nan"):
        monkeypatch.setenv("LIGHTLLM_WIDE_FORWARD_MS_PER_TOKEN", value)
        with pytest.raises(ValueError, match="LIGHTLLM_WIDE_FORWARD_MS_PER_TOKEN must be a number >= 0"):
            _sizing(tiny_llama_dir, 1)


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_a_bad_prefill_thread_count_is_refused_by_name(tiny_llama_dir, cores, monkeypatch, value) -> None:
    monkeypatch.setenv("LIGHTLLM_PREFILL_TORCH_THREADS", value)
    with pytest.raises(ValueError, match="LIGHTLLM_PREFILL_TORCH_THREADS must be an integer from 1 to"):
        _sizing(tiny_llama_dir, 1)


# A decoder whose numbers are easy to follow: a token's matrix products are
# 2 * (1 * (10 * (2*10 + 2*5) + 3 * 10 * 20) + 10 * 50) = 2 * (300 + 600 + 500) = 2800 FLOPs, and it
# reads 1 * 2 * 5 * 4 = 40 bytes of K and V per context position.
TOY = ForwardShape(layers=1, hidden=10, q_dim=10, kv_dim=5, intermediate=20, vocab=50, dtype_bytes=4)
# 2.8 MFLOP/s and 4 MB/s: a decode row costs 1 ms of matrix products plus 0.01 ms per context position.
TOY_RATES = MachineRates(matmul_flops_per_s=2.8e6, kv_scan_bytes_per_s=4e6)


def _rule(ms_per_token: float) -> WideForwardRule:
    return WideForwardRule(ForwardCostModel(TOY, TOY_RATES), ms_per_token / 1000)


def test_the_cost_model_counts_the_shapes_and_prices_them_with_the_rates() -> None:
    assert TOY.matmul_flops_per_token() == 2800
    assert TOY.matmul_flops_per_token(with_lm_head=False) == 1800
    assert TOY.kv_bytes_per_position() == 40
    cost = ForwardCostModel(TOY, TOY_RATES)
    assert cost.decode_seconds(4, 100) == pytest.approx(4 * 1e-3 + 100 * 1e-5)
    # 6 prompt tokens attending 21 (token, position) pairs, one finished prompt's logits row.
    assert cost.prefill_seconds(6, 21, 1) == pytest.approx((6 * 1800 + 1000) / 2.8e6 + 21 * 1e-5)


def test_decode_runs_wide_once_its_work_per_row_pays_for_the_borrowed_core() -> None:
    rule = _rule(1.5)  # a row is 1 ms + 0.01 ms per position: wide from 50 positions per row
    assert rule.decode_wide_from_positions() == 50
    assert not rule.decode_is_wide(rows=8, context_positions=8 * 49)
    assert rule.decode_is_wide(rows=8, context_positions=8 * 50)
    assert rule.decode_is_wide(rows=1, context_positions=50)
    # Work per row decides, not the batch size: 64 short rows stay narrow, 2 long ones go wide.
    assert not rule.decode_is_wide(rows=64, context_positions=64 * 10)
    assert rule.decode_is_wide(rows=2, context_positions=2 * 400)
    assert _rule(0.5).decode_wide_from_positions() == 0  # a wide model: every decode forward
    assert _rule(0).decode_is_wide(rows=1, context_positions=0)
    never = WideForwardRule(ForwardCostModel(TOY, TOY_RATES), float("inf"))
    assert not never.decode_is_wide(rows=1, context_positions=10**9)
    assert never.prefill_is_wide(new_tokens=100, attended_positions=5050, finished_prompts=0)
    # inf (documented) and a finite threshold beyond any context: no decode forward is wide.
    for threshold in (float("inf"), 1e305):
        beyond = WideForwardRule(ForwardCostModel(TOY, TOY_RATES), threshold)
        assert beyond.decode_wide_from_positions() is None and "no decode forward" in beyond.describe()
    assert "decode from 50 context positions per row" in rule.describe()
    assert "every decode forward" in _rule(0.5).describe()


# The small demo model's shapes (hidden 256, 4 layers, q 256 / kv 128 per layer, MLP 768, vocab
# 4096, fp32): a decode row is 8.4 MFLOP plus 4096 bytes of K and V per context position.
SMALL_DEMO = ForwardShape(layers=4, hidden=256, q_dim=256, kv_dim=128, intermediate=768, vocab=4096, dtype_bytes=4)


@pytest.mark.parametrize("gflop_s", [120.0, 180.0, 250.0])
@pytest.mark.parametrize("kv_gb_s", [12.0, 17.0, 22.0])
def test_the_default_threshold_separates_the_measured_regimes_under_calibration_noise(gflop_s: float, kv_gb_s: float) -> None:
    """The regimes the default was placed between (docs/EN/results.md, "Threads per forward"), over
    the spread of rates start-up measured on the development VM: 64 decode rows of ~1100 positions
    ran 18-20 ms per step wide against 23-26 ms narrow; 128 rows of ~160-192 lost 3-16% wide."""
    rule = WideForwardRule(ForwardCostModel(SMALL_DEMO, MachineRates(gflop_s * 1e9, kv_gb_s * 1e9)))
    assert SMALL_DEMO.matmul_flops_per_token() == 8_388_608 and SMALL_DEMO.kv_bytes_per_position() == 4096
    assert rule.decode_is_wide(rows=64, context_positions=64 * 1024)
    assert not rule.decode_is_wide(rows=128, context_positions=128 * 192)


def test_prefill_runs_wide_unless_it_streams_more_than_it_computes() -> None:
    rule = _rule(1.5)
    assert rule.prefill_is_wide(new_tokens=256, attended_positions=256 * 257 // 2, finished_prompts=0)
    assert not rule.prefill_is_wide(new_tokens=4, attended_positions=10, finished_prompts=4)  # four 1-token prompts
    assert rule.prefill_is_wide(new_tokens=40, attended_positions=220, finished_prompts=4)


def test_measured_rates_are_positive_and_scale_the_estimate() -> None:
    shape = ForwardShape(layers=2, hidden=64, q_dim=64, kv_dim=32, intermediate=128, vocab=100, dtype_bytes=4)
    rates = measure_rates(shape, torch.float32, TorchSdpaAttention(), head_dim=16, rows=8, repeats=2)
    assert rates.matmul_flops_per_s > 0 and rates.kv_scan_bytes_per_s > 0
    cost = ForwardCostModel(shape, rates)
    assert cost.decode_seconds(2, 0) == pytest.approx(2 * cost.decode_seconds(1, 0))
    with pytest.raises(ValueError, match="rates must be positive"):
        MachineRates(0.0, 1.0)


def test_wide_forwards_switch_and_restore_even_when_the_body_raises() -> None:
    before = torch.get_num_threads()
    try:
        threads = ForwardThreads(narrow=1, wide=2, rule=_rule(1.5))
        threads.apply()
        assert torch.get_num_threads() == 1
        with threads.prefill_forward(256, 256 * 257 // 2, 0):
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
        with threads.decode_forward(2, 98):
            assert torch.get_num_threads() == 1
        with threads.decode_forward(2, 100):
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
        with pytest.raises(RuntimeError, match="boom"):
            with threads.prefill_forward(256, 256 * 257 // 2, 0):
                raise RuntimeError("boom")
        assert torch.get_num_threads() == 1
        without_rule = ForwardThreads(narrow=1, wide=2)
        with without_rule.decode_forward(10**6, 10**9):
            assert torch.get_num_threads() == 1  # no rule: decode narrow, prefill wide
        with without_rule.prefill_forward(1, 1, 1):
            assert torch.get_num_threads() == 2
        with ForwardThreads(narrow=1, wide=1).prefill_forward(256, 0, 0):
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("narrow, wide", [(0, 1), (1, 0)])
def test_bad_settings_are_refused(narrow, wide) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        ForwardThreads(narrow, wide)
    with pytest.raises(ValueError, match="must be >= 0"):
        _rule(-1)


def test_the_executor_runs_prefill_forwards_with_the_prefill_count_and_decode_with_the_decode_count(tiny_llama_dir) -> None:
    """Each forward, and the sampling of its rows, runs under the count its kind and work decide."""
    from lightllm.common.req_manager import ReqManager
    from lightllm.common.sampling import SamplingParams
    from lightllm.common.sampling.sampler import Sampler
    from lightllm.models.registry import load_model
    from lightllm.server.model_rank.kv_cache.infer_context import InferenceContext
    from lightllm.server.model_rank.scheduling.prefill_queue_strategy import build_prefill_queue_strategy
    from lightllm.server.model_rank.execution.rank_backend import build_rank_backend
    from lightllm.server.model_rank.scheduling.step_planner import StepPlanner

    model = load_model(str(tiny_llama_dir), dtype=torch.float32)
    seen: list[tuple[int, int]] = []  # (tokens in the forward, torch threads during it)
    sampled_with: list[int] = []  # torch threads while each step's rows were sampled
    forward = model.forward

    class RecordingSampler(Sampler):
        def sample(self, logits, batch):
            sampled_with.append(torch.get_num_threads())
            return super().sample(logits, batch)

    def recording_forward(batch, *args, **kwargs):
        seen.append((int(batch.input_ids.numel()), torch.get_num_threads()))
        return forward(batch, *args, **kwargs)

    def run(threads):  # two prompts (5 and 3 tokens), 8 new tokens each
        context = InferenceContext(model.new_kv_cache(256), ReqManager(4, 128), use_prefix_cache=False)
        backend = build_rank_backend("normal", model, context, build_prefill_queue_strategy("default"),
                                     StepPlanner(64, 32), RecordingSampler(0), [2], 128, threads=threads)
        for request_id, prompt in enumerate([[5, 6, 7, 8, 9], [11, 12, 13]]):
            params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
            backend.add_request(request_id, RequestSpec(prompt, params))
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
        sampled_with.clear()
        # A two-row decode step costs 2 ms + 0.01 ms per position: at 1.1 ms per row it runs wide
        # from 20 positions in all. Prefill forwards finish their prompts and compute far more.
        threads = ForwardThreads(narrow=1, wide=2, rule=_rule(1.1))
        threads.apply()
        assert run(threads) == plain  # the thread count changes no result
        assert torch.get_num_threads() == 1
    finally:
        model.forward = forward
        torch.set_num_threads(before)
    # Both prompts in one wide prefill forward (8 tokens for 2 streamed); then decode forwards of
    # both rows, whose contexts sum to 5 + 3 = 8, 10, ..., 20 positions: narrow below 20.
    assert seen == [(8, 2)] + [(2, 1)] * 6 + [(2, 2)]
    # Sampling takes the count of the forward it follows.
    assert sampled_with == [2] + [1] * 6 + [2]
