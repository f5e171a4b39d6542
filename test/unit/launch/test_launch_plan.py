"""What the launcher hands every process: one ServerLayout, the sampling seed, --slot_wait_seconds.

Real parser, real sizing of a real (tiny) checkpoint; no process is started.
"""

from __future__ import annotations

import re

import pytest

from lightllm.common.basemodel.model_config import ModelConfig
from lightllm.server.argument_error import ArgumentError
from lightllm.server.launch.args_check import validate_args
from lightllm.server.launch.arg_parser import make_argument_parser, parse_server_args
from lightllm.server.launch.plan import (
    ProcessConfigs,
    build_process_configs,
    child_process_names,
    plan_layout,
    resolve_sampling_seed,
)
from lightllm.server.launch.sizing import plan_sizing


def _args(model_dir, *extra: str):
    args = make_argument_parser().parse_args(
        ["--model_dir", str(model_dir), "--tp", "2", "--device", "cpu", "--max_total_token_num", "512",
         "--max_req_total_len", "256", *extra]
    )
    validate_args(args, 0)
    return args


def _start(args) -> ProcessConfigs:
    """What one server start decides (the launcher's steps up to spawning)."""
    model_config = ModelConfig.from_dir(args.model_dir)
    sizing = plan_sizing(args, model_config, "cpu")
    watched = child_process_names(args.tp) if args.watchdog_timeout > 0 else ()
    layout = plan_layout(sizing, "lightllm_test_plan", "/tmp/lightllm_test_plan", watched)
    return build_process_configs(args, sizing, model_config, layout, nccl_port=29999,
                                 sampling_seed=resolve_sampling_seed(args))


def _rank_seeds(configs: ProcessConfigs) -> set[int]:
    return {rank.sampling_seed for rank in configs.ranks}


def test_unseeded_starts_draw_different_seeds_shared_by_every_rank(tiny_llama_dir) -> None:
    args = _args(tiny_llama_dir)
    assert args.sampling_seed is None
    first, second = _start(args), _start(args)
    assert len(first.ranks) == 2
    assert len(_rank_seeds(first)) == 1 and len(_rank_seeds(second)) == 1  # every TP rank agrees
    assert _rank_seeds(first) != _rank_seeds(second)


def test_sampling_seed_flag_makes_starts_repeat(tiny_llama_dir) -> None:
    args = _args(tiny_llama_dir, "--sampling_seed", "1234")
    assert _rank_seeds(_start(args)) == _rank_seeds(_start(args)) == {1234}


@pytest.mark.parametrize("value", ["-1", str(2**64)])
def test_sampling_seed_out_of_range_is_refused(tiny_llama_dir, value) -> None:
    with pytest.raises(ArgumentError, match="--sampling_seed must be in"):
        _args(tiny_llama_dir, "--sampling_seed", value)


def test_every_process_gets_the_same_layout(tiny_llama_dir) -> None:
    configs = _start(_args(tiny_llama_dir))
    layouts = [configs.detokenization.layout, configs.router.layout, configs.http.layout,
               *(rank.layout for rank in configs.ranks)]
    assert all(layout is layouts[0] for layout in layouts)
    layout = layouts[0]
    assert (layout.max_req_total_len, layout.max_total_token_num) == (256, 512)
    assert configs.ranks[1].max_req_total_len == 256 and configs.ranks[1].max_total_token_num == 512
    assert layout.shm_req_name != layout.shm_stats_name
    addresses = {layout.router_address, layout.model_rank0_address, layout.detokenization_address,
                 layout.http_address}
    assert len(addresses) == 4


def test_slot_wait_seconds_reaches_the_http_manager(tiny_llama_dir) -> None:
    assert _start(_args(tiny_llama_dir)).http.slot_wait_seconds == 600.0
    assert _start(_args(tiny_llama_dir, "--slot_wait_seconds", "2.5")).http.slot_wait_seconds == 2.5


@pytest.mark.parametrize("value", ["0", "-3"])
def test_slot_wait_seconds_must_be_positive(tiny_llama_dir, value) -> None:
    with pytest.raises(ArgumentError, match="--slot_wait_seconds must be a positive"):
        _args(tiny_llama_dir, "--slot_wait_seconds", value)


@pytest.mark.parametrize("flag", ["--slot_wait_seconds", "--router_token_ratio", "--schedule_time_interval"])
@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_float_flags_refuse_non_finite_values_while_parsing(flag, value, capsys) -> None:
    # nan passes every range check written as a comparison, and then crashed the router after
    # the model loaded; every float flag refuses it in argparse, naming the flag.
    with pytest.raises(SystemExit) as exit_info:
        parse_server_args(["--model_dir", "x", f"{flag}={value}"])
    assert exit_info.value.code == 2
    assert f"argument {flag}: must be a finite number" in capsys.readouterr().err


def test_foreign_flags_are_refused_naming_the_equivalent(capsys) -> None:
    # No prefix matching (--max_new_tokens is not --max_new_tokens_default), and LightLLM's or
    # vLLM's spelling gets this server's flag named.
    for argv, expected in ((["--max_new_tokens", "64"], "unrecognized arguments: --max_new_tokens (and 1 value, not shown"),
                           (["--tensor-parallel-size", "2"], "--tensor-parallel-size: use --tp"),
                           (["--mode", "triton_int8kv"], "--mode: quantization and kernel modes are not supported")):
        with pytest.raises(SystemExit):
            parse_server_args(["--model_dir", "x", *argv])
        err = capsys.readouterr().err
        assert expected in err and err.count("\n") == 1, err


@pytest.mark.parametrize(("argv", "message"), [
    (["--max_new_tokens_default", "0"], "--max_new_tokens_default must be >= 1"),
    (["--nccl_port", "70000"], "--nccl_port must be in 1..65535"),
    (["--nccl_port", "8000", "--port", "8000"], "--nccl_port (8000) must differ from --port"),
    (["--disable_chunked_prefill", "--chunked_prefill_size", "512"], "--chunked_prefill_size does nothing"),
])
def test_flag_values_that_would_do_nothing_or_fail_later_are_refused(tiny_llama_dir, argv, message) -> None:
    with pytest.raises(ArgumentError, match=re.escape(message)):
        _args(tiny_llama_dir, *argv)


def test_top_logprob_rows_default_to_the_running_batch_and_follow_their_flag(tiny_llama_dir) -> None:
    layout = _start(_args(tiny_llama_dir, "--running_max_req_size", "8")).http.layout
    assert (layout.slot_num, layout.top_slot_num) == (64, 8)
    assert _start(_args(tiny_llama_dir, "--top_logprobs_slots", "3")).http.layout.top_slot_num == 3
    # More rows than request slots could never be used: refused, not silently lowered.
    with pytest.raises(ArgumentError, match=re.escape("--top_logprobs_slots 500 exceeds the request slot count 64 "
                                                      "(max(64, 4 x --running_max_req_size)); give at most 64")):
        _start(_args(tiny_llama_dir, "--running_max_req_size", "8", "--top_logprobs_slots", "500"))
    assert _start(_args(tiny_llama_dir, "--running_max_req_size", "8", "--top_logprobs_slots", "64")
                  ).http.layout.top_slot_num == 64


@pytest.mark.parametrize("value", ["0", "-2"])
def test_top_logprobs_slots_must_be_positive(tiny_llama_dir, value) -> None:
    with pytest.raises(ArgumentError, match="--top_logprobs_slots must be positive"):
        _args(tiny_llama_dir, "--top_logprobs_slots", value)


@pytest.mark.parametrize(("flags", "message"), [
    (["--schedule_time_interval", "0"], "--schedule_time_interval must be in [0.001, 1] seconds (a request arriving"),
    (["--schedule_time_interval", "1.5"], "--schedule_time_interval must be in [0.001, 1] seconds"),
    (["--max_request_body_bytes", "10"], "--max_request_body_bytes must be at least 1024, got 10"),
])
def test_degenerate_values_are_refused_instead_of_spinning_or_refusing_every_request(
        tiny_llama_dir, flags, message) -> None:
    with pytest.raises(ArgumentError, match=re.escape(message)):
        _args(tiny_llama_dir, *flags)


def test_each_child_gets_its_one_name_the_launcher_spawns_it_and_the_watchdog_watches_it_by(tiny_llama_dir) -> None:
    """Before, the names were spelled in four places: a drift left a child without a heartbeat field,
    and the watchdog took it for hung one timeout after the start."""
    configs = _start(_args(tiny_llama_dir))
    names = (configs.detokenization.process_name, configs.router.process_name,
             *(rank.process_name for rank in configs.ranks))
    assert names == child_process_names(2) == ("detokenization", "router", "model_rank0", "model_rank1")
    assert configs.router.layout.heartbeat_processes == names
    off = _start(_args(tiny_llama_dir, "--watchdog_timeout", "0"))
    assert off.router.process_name == "router" and off.router.layout.heartbeat_processes == ()
