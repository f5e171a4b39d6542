"""compare_strategies on PD topologies: which node role gets which flags, and what is refused.

``--server-args`` reaches every prefill and decode node (never the master), ``--prefill-args`` /
``--decode-args`` only the nodes of their role, ``--master-args`` only the master.  The role
options are refused on the normal topology, and a flag the launch would override or make
ambiguous is refused before anything starts (exit 2); a flag a role refuses is the node's own
one-line error at its start, which the run reports with where the flag goes.  No server is
started here (the integration test test_compare_strategies_1p1d.py starts them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightllm.benchmark import compare_strategies, comparison_runner
from lightllm.benchmark.comparison_options import ComparisonOptions
from lightllm.benchmark.comparison_runner import run_comparison
from lightllm.benchmark.deployment import ServerSpec
from lightllm.benchmark.pd_cluster import cluster_commands
from lightllm.benchmark.report_writer import render_markdown
from lightllm.benchmark.server_process import ServerRefusedError, ServerStartError
from lightllm.benchmark.topologies import make_topology
from lightllm.benchmark.workloads import WorkloadConfig

PREFILL_ONLY = ["--prefill_max_overtake_tokens", "64"]
DECODE_ONLY = ["--pd_max_segment_tokens", "64"]
SPEC = ServerSpec("/m", "hrrn", ("--max_total_token_num", "4096", "--running_max_req_size=8"))


@pytest.fixture()
def model_dir(tmp_path: Path) -> Path:
    """A directory the --model_dir flag takes as a checkpoint (its type checks for config.json)."""
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one stderr line of a compare_strategies run refused with exit status 2."""
    with pytest.raises(SystemExit) as refused:
        compare_strategies.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert refused.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def _argv(model_dir: Path, *extra: str) -> list[str]:
    return ["--model_dir", str(model_dir), "--workload", "long_first", "--long-count", "1", "--short-count", "1",
            "--out-dir", str(model_dir / "out"), "--strategies", "default,hrrn", *extra]


# --- which process gets which flags ---------------------------------------------------------------


def test_each_role_gets_its_own_flags_after_the_shared_ones_and_the_master_gets_neither():
    commands = cluster_commands(SPEC, ["--pd_heartbeat_interval", "1"], "127.0.0.1", 4321,
                                prefill_args=PREFILL_ONLY, decode_args=DECODE_ONLY)
    membership = ["--pd_master_ip", "127.0.0.1", "--pd_master_port", "4321"]
    assert commands["master"] == ["--run_mode", "pd_master", "--model_dir", "/m", "--pd_heartbeat_interval", "1"]
    assert commands["prefill"] == ["--run_mode", "prefill", "--model_dir", "/m", "--prefill_queue_strategy", "hrrn",
                                   *SPEC.extra_args, *PREFILL_ONLY, *membership]
    assert commands["decode"] == ["--run_mode", "decode", "--model_dir", "/m", *SPEC.extra_args, *DECODE_ONLY,
                                  *membership]


def test_every_node_of_a_role_gets_the_role_flags_in_an_xpyd_cluster():
    topology = make_topology("2p2d", prefill_args=PREFILL_ONLY, decode_args=DECODE_ONLY)
    commands = topology.commands(SPEC, 9000)
    for name in ("prefill", "prefill_2"):
        assert "--prefill_max_overtake_tokens" in commands[name] and "--pd_max_segment_tokens" not in commands[name]
    for name in ("decode", "decode_2"):
        assert "--pd_max_segment_tokens" in commands[name] and "--prefill_max_overtake_tokens" not in commands[name]
    topology.check_spec(SPEC)


def test_the_cli_hands_the_role_options_to_the_topology_and_the_report_records_them(model_dir):
    args = compare_strategies.build_parser().parse_args(_argv(
        model_dir, "--topology", "1p1d", "--prefill-args", " ".join(PREFILL_ONLY),
        "--decode-args=--pd_max_segment_tokens=64"))
    kwargs = compare_strategies.topology_kwargs(args)
    assert (kwargs["prefill_args"], kwargs["decode_args"]) == (PREFILL_ONLY, ["--pd_max_segment_tokens=64"])
    described = make_topology("1p1d", **kwargs).describe()
    assert (described["prefill_args"], described["decode_args"]) == (PREFILL_ONLY, ["--pd_max_segment_tokens=64"])
    meta = {"strategies": ["default"], "baseline": "default", "repeats": 1, "warmup": 0,
            "server_args": ["--max_total_token_num", "4096"], "topology": described}
    text = render_markdown({"meta": meta, "workloads": {}})
    assert "- Server args (identical for every strategy; every prefill and decode node): `--max_total_token_num 4096`" \
        in text
    assert ("- PD flags (identical for every strategy): master ``; prefill nodes add "
            "`--prefill_max_overtake_tokens 64`; decode nodes add `--pd_max_segment_tokens=64`") in text
    normal = render_markdown({"meta": {**meta, "topology": {"name": "normal"}}, "workloads": {}})
    assert "PD flags" not in normal and "Server args (identical for every strategy):" in normal


# --- refusals, before anything starts ------------------------------------------------------------


@pytest.mark.parametrize("extra, message", [
    (["--server-args", "--running_max_req_size 8", "--decode-args=--running_max_req_size=16"],
     "--running_max_req_size given in both --server-args and --decode-args; give each flag once"),
    (["--prefill-args", "--max_total_token_num 4096"], "--prefill-args must not set --max_total_token_num"),
    (["--prefill-args", "--prefill_queue_strategy lpm"], "--prefill-args must not set --prefill_queue_strategy"),
    (["--decode-args", "--pd_master_port 1"], "--decode-args must not set --pd_master_port"),
    (["--decode-args", "'unclosed"], "--decode-args is not a valid shell-quoted string"),
])
def test_a_flag_the_launch_would_override_is_refused_before_anything_starts(model_dir, capsys, extra, message):
    line = _refused(_argv(model_dir, "--topology", "1p1d", *extra), capsys)
    assert message in line, line
    assert not (model_dir / "out").exists()  # refused before the output directory (and any server)


@pytest.mark.parametrize("topology, error, hint", [
    ("1p1d", ServerRefusedError("server refused to start (exit code 2, log server_hrrn_decode.log): error: "
                                "--prefill_max_overtake_tokens: a decode node never prefills a prompt"), True),
    ("2p1d", ServerRefusedError("server refused to start: error: --pd_max_segment_tokens: read by decode nodes only"),
     True),
    ("normal", ServerRefusedError("server refused to start: error: unrecognized arguments: --bogus"), False),
    ("1p1d", ServerStartError("server exited with code 1 during start-up"), False),
])
def test_a_node_refusing_its_flags_ends_the_run_in_one_line_saying_where_flags_go(
    model_dir, monkeypatch, capsys, topology, error, hint
):
    """The tester's repro (--server-args=--prefill_max_overtake_tokens=10 on 1p1d) ended with the decode
    node's refusal, which says "give it to the prefill node" but not which option reaches it."""

    def run_comparison(*_args: Any, **_kwargs: Any) -> None:
        raise error

    monkeypatch.setattr(compare_strategies, "run_comparison", run_comparison)
    extra = [] if topology == "normal" else ["--topology", topology]
    assert compare_strategies.main(_argv(model_dir, *extra)) == 1
    [line] = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("note:")]
    assert line.startswith(f"error: {error}")
    assert ("--server-args reach every prefill and decode node; give a flag only one role takes in --prefill-args "
            "or --decode-args" in line) is hint, line


@pytest.mark.parametrize("option", ["--prefill-args", "--decode-args"])
def test_the_role_options_are_refused_on_the_normal_topology(model_dir, capsys, option):
    line = _refused(_argv(model_dir, option, "--running_max_req_size 8"), capsys)
    assert f"{option} only apply with a PD topology" in line
    # An empty string is the default, not a choice.
    args = compare_strategies.build_parser().parse_args(_argv(model_dir, option, ""))
    assert compare_strategies.topology_kwargs(args) == {"host": "127.0.0.1", "start_timeout_s": 300.0}


def test_several_nodes_of_a_role_keep_the_ids_the_launcher_gives_them():
    with pytest.raises(ValueError, match="prefill_args must not set --pd_node_id"):
        make_topology("2p1d", prefill_args=["--pd_node_id", "p"])
    with pytest.raises(ValueError, match="extra_args must not set --pd_node_id"):
        make_topology("1p2d").check_spec(ServerSpec("/m", "hrrn", ("--pd_node_id", "n")))
    make_topology("1p1d", decode_args=["--pd_node_id", "d"]).check_spec(SPEC)  # one node: its own name is fine


def test_run_comparison_checks_every_spec_before_launching(monkeypatch, tmp_path, model_dir):
    """A library caller gets the same refusal as the CLI, before any process starts."""

    def never(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("launch_all must not run")

    monkeypatch.setattr(comparison_runner, "launch_all", never)
    options = ComparisonOptions(model_dir=str(model_dir), workloads=[WorkloadConfig(name="long_first")],
                                out_dir=str(tmp_path / "out"), strategies=["default", "hrrn"],
                                server_args=["--running_max_req_size", "8"])
    with pytest.raises(ValueError, match="--running_max_req_size given in both extra_args and prefill_args"):
        run_comparison(options, make_topology("1p1d", prefill_args=["--running_max_req_size=4"]))


def test_the_where_flags_go_hint_follows_only_a_refusal_of_another_roles_flag():
    from lightllm.benchmark.compare_strategies import _pd_refusal_hint
    from lightllm.benchmark.server_process import ServerRefusedError

    role = ServerRefusedError("server refused to start (x_decode.log): error: --prefill_max_overtake_tokens: a decode "
                              "node never prefills a prompt (it receives the KV), so it has no prefill queue to order")
    assert "--prefill-args or --decode-args" in _pd_refusal_hint("1p1d", role)
    assert _pd_refusal_hint("normal", role) == ""
    # A bad value is the node's own problem: no hint pointing at the role options.
    value = ServerRefusedError("server refused to start (x_prefill.log): error: --tp 3 must divide "
                               "num_attention_heads (4), num_key_value_heads (2) and intermediate_size (64)")
    assert _pd_refusal_hint("1p1d", value) == ""


@pytest.mark.parametrize("flag", [["--prefill_queue_strategy", "hrrn"], ["--tp", "1"],
                                  ["--pd_max_segment_tokens", "8"]])
def test_the_hint_follows_the_masters_own_refusal_of_a_node_flag(flag):
    """The master's wording is matched by text: this holds the two together."""
    from lightllm.benchmark.compare_strategies import _pd_refusal_hint
    from lightllm.benchmark.server_process import ServerRefusedError
    from lightllm.server.launch.arg_parser import parse_server_args
    from lightllm.server.launch.pd_master import check_master_flags

    with pytest.raises(ValueError) as refused:
        check_master_flags(parse_server_args(["--model_dir", "/m", "--run_mode", "pd_master", *flag]))
    error = ServerRefusedError(f"server refused to start (x_master.log): error: {refused.value}")
    assert "--master-args" in _pd_refusal_hint("1p1d", error)
