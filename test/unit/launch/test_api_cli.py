"""The argument parser, argument validation and server sizing."""

from __future__ import annotations

import argparse

import pytest

from lightllm.common.basemodel.model_config import ModelConfig
from lightllm.server.argument_error import ArgumentError
from lightllm.server.launch.args_check import validate_args
from lightllm.server.launch.arg_parser import make_argument_parser, parse_server_args
from lightllm.server.launch.pd_master import check_master_flags
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import available_strategy_names
from lightllm.server.launch.sizing import plan_sizing


def _parse(*argv: str) -> argparse.Namespace:
    return make_argument_parser().parse_args(["--model_dir", "m", *argv])


def test_strategy_choices_come_from_the_registry():
    parser = make_argument_parser()
    action = next(a for a in parser._actions if a.dest == "prefill_queue_strategy")
    assert list(action.choices) == available_strategy_names()
    assert _parse().prefill_queue_strategy == "default"
    for name in available_strategy_names():
        assert _parse("--prefill_queue_strategy", name).prefill_queue_strategy == name


def test_unknown_strategy_is_rejected_listing_valid_ones(capsys):
    with pytest.raises(SystemExit) as exc:
        _parse("--prefill_queue_strategy", "sjf")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'sjf'" in err
    for name in available_strategy_names():
        assert name in err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--chunked_prefill_size", "4096", "--batch_max_tokens", "1024"], "cannot exceed --batch_max_tokens"),
        (["--tp", "0"], "--tp must be positive"),
        (["--mem_fraction", "1.5"], "--mem_fraction must be in (0, 1]"),
        (["--running_max_req_size", "-1"], "--running_max_req_size must be positive"),
        (["--port", "70000"], "--port must be in 1..65535"),
        (["--run_mode", "decode", "--pd_transfer_port", "29500"], "--pd_transfer_port is for prefill nodes"),
        (["--pd_transfer_port", "29500"], "--pd_transfer_port is for prefill nodes"),
    ],
)
def test_impossible_combinations_raise_one_line_errors(argv, message):
    with pytest.raises(ArgumentError) as exc:
        validate_args(_parse(*argv))
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_tp_larger_than_gpus_is_rejected():
    with pytest.raises(ArgumentError, match="needs 4 GPUs but only 2"):
        validate_args(_parse("--tp", "4"), cuda_device_count=2)


def test_sizing_defaults_and_limits(tiny_llama_dir):
    config = ModelConfig.from_dir(tiny_llama_dir)
    args = make_argument_parser().parse_args(["--model_dir", str(tiny_llama_dir), "--max_total_token_num", "4096"])
    sizing = plan_sizing(args, config, "cpu")
    assert sizing.max_req_total_len == config.max_position_embeddings
    assert sizing.batch_max_tokens == 2048 and sizing.max_total_token_num == 4096
    args.max_total_token_num = 100
    with pytest.raises(ArgumentError, match="fewer than one request may need"):
        plan_sizing(args, config, "cpu")
    args.max_total_token_num = None
    assert 1024 <= plan_sizing(args, config, "cpu").max_total_token_num <= 1 << 18
    args.disable_chunked_prefill, args.batch_max_tokens = True, 512
    with pytest.raises(ArgumentError, match="must be >= --max_req_total_len"):
        plan_sizing(args, config, "cpu")


def test_model_name_takes_a_list_of_served_names():
    parser = make_argument_parser()
    assert parser.parse_args(["--model_dir", "m", "--model_name", "a", "b"]).model_name == ["a", "b"]
    assert parser.parse_args(["--model_dir", "m"]).model_name is None


@pytest.mark.parametrize(
    "run_mode, flag, message",
    [
        ("normal", "pd_heartbeat_interval", "--pd_heartbeat_interval configures PD clusters"),
        ("normal", "pd_master_ip", "--pd_master_ip configures PD clusters"),
        ("prefill", "pd_reserve_lease_seconds", "read by decode nodes only"),
        ("decode", "pd_prefill_timeout_seconds", "read by the PD master only"),
    ],
)
def test_a_flag_for_another_role_is_refused_even_at_its_default_value(run_mode, flag, message):
    # Written with the parser's own default: comparing values would let it through.
    argv = ["--model_dir", "/m", "--run_mode", run_mode, f"--{flag}", str(make_argument_parser().get_default(flag))]
    with pytest.raises(ArgumentError, match=message):
        validate_args(parse_server_args(argv))
    # A library caller's namespace (no record of what was written) keeps the value rule.
    validate_args(_parse(*argv))


def test_the_master_refuses_a_node_flag_written_with_its_default_value():
    args = parse_server_args(["--model_dir", "/m", "--run_mode", "pd_master", "--tp", "1"])
    with pytest.raises(ValueError, match="--tp configures prefill/decode nodes"):
        check_master_flags(args)
    check_master_flags(parse_server_args(["--model_dir", "/m", "--run_mode", "pd_master", "--port", "8000"]))
