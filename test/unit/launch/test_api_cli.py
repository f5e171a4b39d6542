"""The argument parser, argument validation and server sizing."""

from __future__ import annotations

import argparse
import re

import pytest

from lightllm.common.basemodel.model_config import ModelConfig
from lightllm.server.argument_error import ArgumentError
from lightllm.server.launch.args_check import resolve_args, validate_args
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
        (["--pd_transfer_port", "29500"], "--pd_transfer_port configures PD clusters and does nothing on --run_mode "
                                          "normal; give it to prefill nodes (--run_mode prefill)"),
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
    with pytest.raises(ArgumentError, match="fewer than one request may need .*raise --max_total_token_num"):
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
        # (--pd_reserve_lease_seconds has no default value to write: test_pd_startup_checks gives it one.)
        ("prefill", "pd_max_segment_tokens", "read by decode nodes only"),
        ("decode", "pd_prefill_timeout_seconds", "read by the PD master only"),
        ("decode", "prefill_queue_strategy", "a decode node never prefills a prompt"),
        ("decode", "prefill_overtake_fraction", "a decode node never prefills a prompt"),
        ("decode", "chunked_prefill_size", "no prefill step to shape"),
    ],
)
def test_a_flag_for_another_role_is_refused_even_at_its_default_value(run_mode, flag, message):
    # Written with the parser's own default: comparing values would let it through.
    argv = ["--model_dir", "/m", "--run_mode", run_mode, f"--{flag}", str(make_argument_parser().get_default(flag))]
    with pytest.raises(ArgumentError, match=message):
        validate_args(parse_server_args(argv))
    # A library caller's namespace (no record of what was written) keeps the value rule.
    validate_args(make_argument_parser().parse_args(argv))


@pytest.mark.parametrize(
    "run_mode, flags, message",
    [
        ("decode", ["--batch_max_tokens", "4096"], "--batch_max_tokens: a decode node never prefills a prompt"),
        ("decode", ["--disable_chunked_prefill", "--batch_max_tokens", "8192"],
         "--batch_max_tokens, --disable_chunked_prefill: a decode node never prefills"),
        ("decode", ["--disable_mixed_batches"], "--disable_mixed_batches: a decode node never prefills"),
        ("prefill", ["--disable_mixed_batches"], "--disable_mixed_batches: a prefill node never decodes"),
    ],
)
def test_prefill_step_flags_are_refused_where_no_such_step_runs(run_mode, flags, message):
    # A decode node's forwards are decode steps; a prefill node's requests leave after one token.
    argv = ["--model_dir", "/m", "--run_mode", run_mode, "--pd_master_ip", "127.0.0.1", *flags]
    with pytest.raises(ArgumentError, match=message):
        validate_args(parse_server_args(argv))


def test_a_plan_from_validated_flags_takes_the_chunk_the_server_uses(tiny_llama_dir):
    """Sizing reads the chunk through chunked_prefill_size_for, so a caller that validated the flags
    without resolve_args (a tool checking flags) plans the chunk the server runs, not 1024 > 512."""
    args = make_argument_parser().parse_args(["--model_dir", str(tiny_llama_dir), "--batch_max_tokens", "512",
                                              "--max_total_token_num", "8192"])
    validate_args(args)
    sizing = plan_sizing(args, ModelConfig.from_dir(tiny_llama_dir), "cpu")
    assert (sizing.batch_max_tokens, sizing.chunked_prefill_size) == (512, 512)


def test_a_smaller_step_budget_alone_brings_the_default_chunk_down_with_it():
    args = parse_server_args(["--model_dir", "/m", "--batch_max_tokens", "512"])
    validate_args(args)
    assert args.chunked_prefill_size == 1024  # the check writes nothing: resolve_args does
    resolve_args(args)
    assert (args.batch_max_tokens, args.chunked_prefill_size) == (512, 512)
    args = parse_server_args(["--model_dir", "/m", "--batch_max_tokens", "4096"])
    validate_args(args)
    resolve_args(args)
    assert args.chunked_prefill_size == 1024
    # A chunk the user typed is never changed: too large for the budget is still refused.
    with pytest.raises(ArgumentError, match=r"--chunked_prefill_size \(1024\) cannot exceed --batch_max_tokens \(512\)"):
        validate_args(parse_server_args(["--model_dir", "/m", "--batch_max_tokens", "512", "--chunked_prefill_size",
                                         "1024"]))


def test_prefill_step_flags_stay_with_the_prefill_node_and_a_normal_server():
    for argv in (["--run_mode", "prefill", "--pd_master_ip", "127.0.0.1"], []):
        validate_args(parse_server_args(["--model_dir", "/m", *argv, "--chunked_prefill_size", "256",
                                         "--batch_max_tokens", "512"]))
    validate_args(parse_server_args(["--model_dir", "/m", "--disable_mixed_batches"]))


def test_the_master_refuses_a_node_flag_written_with_its_default_value():
    args = parse_server_args(["--model_dir", "/m", "--run_mode", "pd_master", "--tp", "1"])
    with pytest.raises(ValueError, match="--tp configures model nodes .* give it to the prefill and decode nodes"):
        check_master_flags(args)
    check_master_flags(parse_server_args(["--model_dir", "/m", "--run_mode", "pd_master", "--port", "8000"]))


# --- the overtaking-bound flags: upper limits, and argparse's own errors in one line ----------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prefill_max_overtake_tokens", str(2**63)],
         "--prefill_max_overtake_tokens must be at most 1,000,000,000,000 (for no bound use "
         "--disable_prefill_overtake_bound), got 9223372036854775808"),
        (["--prefill_max_overtake_tokens", str(10**12 + 1)], "--prefill_max_overtake_tokens must be at most"),
        (["--prefill_overtake_fraction", "1e13"],
         "--prefill_overtake_fraction must be at most 1000 (for no bound use --disable_prefill_overtake_bound), "
         "got 10000000000000.0"),
        (["--prefill_overtake_fraction", "1000.5"], "--prefill_overtake_fraction must be at most 1000"),
        (["--prefill_max_overtake_tokens", "-1"], "--prefill_max_overtake_tokens must be >= 0, got -1"),
    ],
)
def test_bound_flags_past_their_limits_are_refused_naming_the_flag(argv, message):
    # Past the limits rank 0 crashed publishing them to the int64 stats block after the model loaded.
    with pytest.raises(ArgumentError) as exc:
        validate_args(parse_server_args(["--model_dir", "/m", *argv]))
    assert str(exc.value).startswith(message) and "\n" not in str(exc.value)


def test_bound_flags_at_their_limits_are_accepted_and_publish_to_the_stats_block():
    import os

    from lightllm.server.core.objs.shm_stats import ShmStats
    from lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound import (
        MAX_PREFILL_OVERTAKE_FRACTION,
        MAX_PREFILL_OVERTAKE_TOKENS,
    )
    from lightllm.server.launch.plan import overtake_bound_from_args
    from lightllm.server.model_rank.prefill_wait_tracker import PrefillWaitTracker

    args = parse_server_args(["--model_dir", "/m", "--prefill_max_overtake_tokens", str(MAX_PREFILL_OVERTAKE_TOKENS),
                              "--prefill_overtake_fraction", str(MAX_PREFILL_OVERTAKE_FRACTION)])
    validate_args(args)
    stats = ShmStats(f"lightllm_test_bound_limits_{os.getpid()}", create=True)
    try:
        for name, value in PrefillWaitTracker(overtake_bound_from_args(args)).fields().items():
            stats.set(name, value)  # what rank 0 does on every publish: no OverflowError
    finally:
        stats.close()
        stats.unlink()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prefill_overtake_fraction", "abc"], "error: argument --prefill_overtake_fraction: invalid float value: 'abc'"),
        (["--prefill_max_overtake_tokens", "1.5"],
         "error: argument --prefill_max_overtake_tokens: invalid int value: '1.5'"),
        (["--prefill_queue_strategy", "foo"], "error: argument --prefill_queue_strategy: invalid choice: 'foo'"),
        (["--no_such_flag"], "error: unrecognized arguments: --no_such_flag"),
    ],
)
def test_argparse_usage_errors_are_one_line_naming_the_flag(capsys, argv, message):
    """docs/*/failure_handling.md: invalid flags, argparse's usage errors too, end in one line on
    stderr naming the flag, with exit code 2 (argparse alone prints its usage block first)."""
    with pytest.raises(SystemExit) as exc:
        parse_server_args(["--model_dir", "/m", *argv])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), captured.err
    assert "usage:" not in captured.err


def test_help_still_prints_the_full_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_server_args(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m lightllm.server.api_server")
    assert "--prefill_overtake_fraction" in out and "--log_level" in out and len(out.splitlines()) > 100


def test_a_model_dir_without_a_checkpoint_is_refused_naming_the_flag(tmp_path):
    from lightllm.server.launch.checkpoint_reading import read_checkpoint

    with pytest.raises(ValueError, match=r"^--model_dir \S+missing: no such directory"):
        read_checkpoint(make_argument_parser().parse_args(["--model_dir", str(tmp_path / "missing")]))
    with pytest.raises(ValueError, match=r"^--model_dir \S+: no config.json there"):
        read_checkpoint(make_argument_parser().parse_args(["--model_dir", str(tmp_path)]))


@pytest.mark.parametrize("address, reason", [
    ("", "not an IP address"), ("not a host!", "not an IP address"), ("node_1", "not an IP address"),
    ("a" * 64 + ".example.com", "not an IP address"), ("10.0.0.256", "not an IPv4 address"),
    # As the PD contract's host:port refuses them (pd/protocol/host_port.py): one rule for both.
    ("[node1]", "only an IPv6 address goes in brackets"), ("[1.2.3.4]", "only an IPv6 address goes in brackets"),
    ("fe80::1%", "an IPv6 zone .* must be an interface name"), ("fe80::1%e th0", "an IPv6 zone"),
    # The zone as a URL escapes it: read as zone "25eth0", it failed only when the node dialled.
    ("fe80::1%25eth0", r"an IPv6 zone starting %25 \(write the zone as %eth0 on the command line"),
])
def test_a_pd_master_address_that_is_no_host_is_refused_at_start(address, reason):
    """A node built its registration URL from it and retried forever, or (an IPv6 literal) failed
    silently and printed a traceback only when stopped."""
    with pytest.raises(ArgumentError, match=rf"^--pd_master_ip .*: {reason}"):
        validate_args(parse_server_args(["--model_dir", "/m", "--run_mode", "decode", "--pd_master_ip", address]))


def test_pd_master_addresses_of_every_kind_reach_a_url():
    from lightllm.utils.host_names import bare_host, url_host

    # A zone names the node's own interface to the master (it dials the master itself): refused
    # once as meaningless "on another machine", though http://[fe80::1%eth0]:port/ works.
    for address, url in [("::1", "[::1]"), ("[::1]", "[::1]"), ("10.0.0.7", "10.0.0.7"), ("master-0.pd", "master-0.pd"),
                         ("fe80::1%eth0", "[fe80::1%eth0]"), ("[fe80::1%eth0]", "[fe80::1%eth0]")]:
        validate_args(parse_server_args(["--model_dir", "/m", "--run_mode", "prefill", "--pd_master_ip", address]))
        assert url_host(bare_host(address)) == url


@pytest.mark.parametrize("interval", ["0.01", "0.4", "61", "1e9"])
def test_a_heartbeat_interval_outside_its_range_is_refused(interval):
    """At 0.01 s the master dropped healthy nodes and failed every request; at 1e9 a dead node stayed."""
    with pytest.raises(ArgumentError, match="--pd_heartbeat_interval must be 0.5 to 60 seconds"):
        validate_args(parse_server_args(["--model_dir", "/m", "--run_mode", "pd_master", "--pd_heartbeat_interval",
                                         interval]))


@pytest.mark.parametrize("value", ["-inf", "-Infinity", "-nan"])
def test_a_negative_infinity_or_nan_gets_the_flags_own_refusal(value, capsys):
    # argparse took "-inf" for a flag and said "expected one argument".
    with pytest.raises(SystemExit) as exited:
        parse_server_args(["--model_dir", "/m", "--prefill_overtake_fraction", value])
    assert exited.value.code == 2
    assert capsys.readouterr().err.startswith(
        f"error: argument --prefill_overtake_fraction: must be a finite number, got '{value}'")
    # Negative numbers still parse as values, and flags still as flags.
    assert parse_server_args(["--model_dir", "/m", "--router_token_ratio", "-0.5"]).router_token_ratio == -0.5


@pytest.mark.parametrize("run_mode", ["normal", "prefill", "decode", "pd_master"])
@pytest.mark.parametrize("host, reason", [
    ("[1.2.3.4]", "only an IPv6 address goes in brackets"), ("[node-1]", "only an IPv6 address goes in brackets"),
    ("[::1", r"unbalanced brackets \(only an IPv6 address goes in brackets"), ("::1]", "unbalanced brackets"),
    ("[[::1]]", "only an IPv6 address goes in brackets"),
])
def test_a_bracketed_host_that_is_no_ipv6_address_is_refused_for_every_role(run_mode, host, reason):
    """"--host [1.2.3.4]" served as a normal server but stopped a PD node saying it "would advertise"
    an address the master cannot use."""
    with pytest.raises(ArgumentError, match=rf"^--host {re.escape(repr(host))}: {reason}"):
        validate_args(parse_server_args(["--model_dir", "/m", "--run_mode", run_mode, "--host", host]))


_URL_ESCAPED_ZONE = r"an IPv6 zone starting %25 \(write the zone as %eth0 on the command line; %25 is its URL escaping\)$"


@pytest.mark.parametrize("run_mode", ["normal", "prefill", "decode", "pd_master"])
@pytest.mark.parametrize("host", ["fe80::1%25eth0", "[fe80::1%25eth0]", "fd00::1%25en0"])
def test_a_host_with_its_zone_in_url_escaping_is_refused_with_the_hint_bracketed_or_not(run_mode, host):
    """"--host fe80::1%25eth0" (no brackets) got "cannot resolve it to an address to listen on: Name
    or service not known" (exit 3): only a bracketed --host was read by the flags' rule."""
    # A PD node advertises its --host, where no zone is taken: the hint must not lead to a zone
    # that is refused next ("write the zone as %eth0", then "an IPv6 address with a zone").
    zone = host.rstrip("]").partition("%25")[2]
    hint = (_URL_ESCAPED_ZONE if run_mode in ("normal", "pd_master") else
            r"this node would advertise its address as .*, which the master cannot use: host .*: an IPv6 zone starting "
            rf"%25 \(%25 is its URL escaping: a host writes zone {zone} as %{zone}\), and no address with a zone is "
            "taken here")
    with pytest.raises(ArgumentError, match=rf"^--host {re.escape(repr(host))}: {hint}"):
        validate_args(parse_server_args(["--model_dir", "/m", "--run_mode", run_mode, "--host", host]))


@pytest.mark.parametrize("host", ["[::1]:80", "localhost:8000", "1.2.3.4:80", "[fe80::1%eth0]:80"])
def test_a_host_given_with_a_port_is_told_to_give_the_host_alone(host):
    # "[::1]:80" said "unbalanced brackets"; "localhost:80" that it was no host name.
    with pytest.raises(ArgumentError, match=rf"^--host {re.escape(repr(host))}: a host with a port: give the host "
                                            r"alone \(the port has its own flag\)$"):
        validate_args(parse_server_args(["--model_dir", "/m", "--host", host]))


@pytest.mark.parametrize("flag, run_mode", [("--pd_master_ip", "prefill"), ("--pd_master_ip", "decode")])
@pytest.mark.parametrize("host", ["fe80::1%25eth0", "[fe80::1%25eth0]"])
def test_the_url_escaped_zone_hint_is_the_same_for_the_master_address(flag, run_mode, host):
    with pytest.raises(ArgumentError, match=rf"^{flag} {re.escape(repr(host))}: {_URL_ESCAPED_ZONE}"):
        validate_args(parse_server_args(["--model_dir", "/m", "--run_mode", run_mode, flag, host]))


@pytest.mark.parametrize("host", ["fe80::1%25eth0", "[fe80::1%25eth0]"])
def test_the_url_escaped_zone_hint_is_the_same_for_the_rendezvous_address(host):
    from lightllm.server.launch.nccl_rendezvous import check_nccl_rendezvous

    with pytest.raises(ArgumentError, match=rf"^--nccl_host {re.escape(repr(host))}: {_URL_ESCAPED_ZONE}"):
        check_nccl_rendezvous(parse_server_args(["--model_dir", "/m", "--tp", "2", "--nccl_host", host]))


@pytest.mark.parametrize("run_mode", ["prefill", "decode"])
@pytest.mark.parametrize("host, reason", [
    ("fe80::1", "a link-local address cannot be dialled from another machine"),
    ("[fe80::1]", "a link-local address cannot be dialled from another machine"),
    ("fe80::1%eth0", r"an IPv6 address with a zone \(%\.\.\.\)"),
])
def test_a_pd_nodes_link_local_host_is_refused_at_start_zone_or_not(run_mode, host, reason):
    """A node advertises its --host: a link-local one without a zone failed at the bind with EINVAL,
    reported as "is another server running on this port?" (exit 3), and one with a zone only after
    the model's config was read; both are the one-line refusal of an address the master cannot use."""
    with pytest.raises(ArgumentError, match=rf"^--host {re.escape(repr(host))}: this node would advertise its "
                                            rf"address as .*which the master cannot use: host .*: {reason}"):
        validate_args(parse_server_args(["--model_dir", "/m", "--run_mode", run_mode, "--host", host]))


@pytest.mark.parametrize("run_mode", ["normal", "pd_master"])
def test_a_link_local_host_is_left_to_the_bind_where_it_is_not_advertised(run_mode):
    # As --pd_master_ip and --nccl_host: the zone is this machine's to give; the bind says what is missing.
    for host in ("fe80::1", "fe80::1%eth0", "[fe80::1%eth0]"):
        validate_args(parse_server_args(["--model_dir", "/m", "--run_mode", run_mode, "--host", host]))


@pytest.mark.parametrize("host", ["[::1]", "[::]", "[fe80::1%eth0]", "::1", "node-1"])
def test_a_bracketed_ipv6_host_is_taken(host):
    validate_args(parse_server_args(["--model_dir", "/m", "--host", host]))


@pytest.mark.parametrize(("argv", "warned"), [
    (["--router_token_ratio", "2"], True),
    (["--router_token_ratio", "1"], False),
    (["--router_token_ratio", "2", "--disable_prefill_overtake_bound"], False),
    (["--router_token_ratio", "2", "--run_mode", "prefill", "--pd_master_ip", "127.0.0.1"], True),
])
def test_an_overcommitted_kv_cache_is_warned_to_void_the_bound_for_paused_requests(argv, warned):
    from lightllm.server.launch.plan import overtake_bound_caveat

    args = parse_server_args(["--model_dir", "/m", *argv])
    validate_args(args)
    caveat = overtake_bound_caveat(args)
    assert (caveat is not None) == warned
    if warned:
        assert caveat.startswith("--router_token_ratio 2 overcommits the KV cache: a request paused for lack of KV "
                                 "is not covered by the prefill overtaking bound")
