"""--ports FIRST-LAST: the parser, the picker, and every port a launch gives its processes (no servers started).

On a shared host compare_strategies (and side_by_side) could not be confined to an allotted range:
they picked any free port and refused --port in --server-args.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from cli_refusal_support import one_line_refusal

from lightllm.benchmark import compare_strategies, pd_cluster, process_footprint, side_by_side
from lightllm.benchmark.deployment import ServerSpec, flag_value
from lightllm.benchmark.port_range import (
    PortRange,
    PortsExhaustedError,
    confined_port_flags,
    ports_of_model_process,
)
from lightllm.benchmark.server_launcher import NormalTopology
from lightllm.benchmark.server_process import ServerProcess, ServerStartError
from lightllm.benchmark.topologies import make_topology

HOST = "127.0.0.1"


def _free_block(count: int) -> tuple[int, int]:
    """A range of ``count`` ports that are free now (found by scanning from a high base)."""
    for first in range(43200, 60000, count):
        if all(_bindable(port) for port in range(first, first + count)):
            return first, first + count - 1
    pytest.skip("no free block of ports on this host")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


# --- parsing ----------------------------------------------------------------------------------------


def test_a_range_is_two_integers_with_a_dash():
    ports = PortRange.parse("43200-43399")
    assert (ports.first, ports.last, len(ports), str(ports)) == (43200, 43399, 200, "43200-43399")
    assert len(PortRange.parse(" 1024 - 1024 ")) == 1
    assert str(PortRange.parse("65535-65535")) == "65535-65535"


@pytest.mark.parametrize("text, message", [
    ("43200", "must be FIRST-LAST, two integers"),
    ("a-b", "must be FIRST-LAST, two integers"),
    ("43200-", "must be FIRST-LAST, two integers"),
    ("-1-5", "must be FIRST-LAST, two integers"),
    ("80-100", "1024 <= FIRST <= LAST <= 65535, got 80-100"),
    ("43300-43200", "1024 <= FIRST <= LAST <= 65535, got 43300-43200"),
    ("60000-65536", "1024 <= FIRST <= LAST <= 65535, got 60000-65536"),
])
def test_a_malformed_range_is_refused_in_one_line(text, message):
    with pytest.raises(ValueError, match=message):
        PortRange.parse(text)


def _model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")  # the flag's type asks for a checkpoint directory
    return tmp_path


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as refused:
        compare_strategies.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert refused.value.code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


@pytest.mark.parametrize("value, message", [
    ("43200", "argument --ports: must be FIRST-LAST, two integers (e.g. 23200-23399), got '43200'"),
    ("80-100", "argument --ports: must be FIRST-LAST with 1024 <= FIRST <= LAST <= 65535, got 80-100"),
])
def test_compare_strategies_refuses_a_bad_range_while_parsing(tmp_path, capsys, value, message):
    argv = ["--model_dir", str(_model_dir(tmp_path)), "--workload", "long_first", "--out-dir", str(tmp_path / "out"),
            "--ports", value]
    assert message in _refused(argv, capsys)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra, message", [
    (["--ports", "43200-43202", "--strategies", "default"], "--ports 43200-43202 holds 3 ports, fewer than the 4 --topology 1p1d with 1 "
                                 "strategy needs; give a wider range"),
    # Per cluster: master 1; prefill 1 + --nccl_port 1 + a --pd_transfer_port block of 2; decode 1 + 1.
    (["--ports", "43200-43209", "--server-args", "--tp 2", "--strategies", "default,hrrn"],
     "--ports 43200-43209 holds 10 ports, fewer than the 14 --topology 1p1d with 2 strategies needs"),
])
def test_compare_strategies_refuses_a_range_too_small_for_the_topology_before_anything_starts(
    tmp_path, capsys, monkeypatch, extra, message
):
    def never(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("the run was reached")

    monkeypatch.setattr(compare_strategies, "run_comparison", never)
    argv = ["--model_dir", str(_model_dir(tmp_path)), "--workload", "long_first", "--out-dir", str(tmp_path / "out"),
            "--topology", "1p1d", *extra]
    assert message in _refused(argv, capsys)
    assert not (tmp_path / "out").exists()


def test_the_cli_hands_the_range_to_the_topology_only_when_given(tmp_path):
    base = ["--model_dir", str(_model_dir(tmp_path)), "--workload", "long_first", "--out-dir", str(tmp_path / "out")]
    without = compare_strategies.topology_kwargs(compare_strategies.build_parser().parse_args(base))
    assert "ports" not in without and "ports" not in make_topology("normal", **without).describe()
    args = compare_strategies.build_parser().parse_args([*base, "--ports", "43200-43399", "--topology", "2p1d"])
    kwargs = compare_strategies.topology_kwargs(args)
    assert str(kwargs["ports"]) == "43200-43399"
    assert make_topology("2p1d", **kwargs).describe()["ports"] == "43200-43399"


def test_process_footprint_takes_its_ports_from_the_range_it_is_given(tiny_llama_dir, tmp_path, capsys):
    """It had no --ports: every launch took any free port, outside a tester's allotted range."""
    first, last = _free_block(12)
    ports = PortRange(first, last)
    with pytest.raises(process_footprint.FootprintStartError):
        # Refused by the server at once; its --port and --nccl_port (tp 2) came from the range.
        process_footprint.launch_and_measure(str(tiny_llama_dir), ["--tp", "2", "--max_total_token_num", "abc"],
                                             tmp_path / "server.log", 120.0, ports)
    assert ports.take("127.0.0.1") == first + 2
    argv = ["--model_dir", str(tiny_llama_dir), "--skip_imports", "--launches", "3", "--ports", f"{first}-{first + 1}"]
    line = one_line_refusal(process_footprint.main, argv, capsys)
    assert f"--ports {first}-{first + 1} holds 2 ports, fewer than the 3 --launches 3 needs" in line


# --- the picker ---------------------------------------------------------------------------------------


def test_every_port_taken_is_in_the_range_free_and_handed_out_once():
    first, last = _free_block(6)
    ports = PortRange(first, last)
    taken = [ports.take(HOST) for _ in range(6)]
    assert sorted(taken) == list(range(first, last + 1))
    exhausted = f"^--ports {first}-{last} has no free port left for the hrrn server \\(6 handed out"
    with pytest.raises(PortsExhaustedError, match=exhausted):
        ports.take(HOST, what="the hrrn server")


def test_a_port_another_program_holds_is_skipped():
    first, last = _free_block(2)
    with socket.socket() as holder:
        holder.bind((HOST, first))
        holder.listen()
        ports = PortRange(first, last)
        assert ports.take(HOST) == last
        with pytest.raises(PortsExhaustedError) as exhausted:
            ports.take(HOST, what="the default server")
    assert isinstance(exhausted.value, ServerStartError)  # a launch failure: one line, every server stopped
    assert str(exhausted.value).startswith(f"--ports {first}-{last} has no free port left for the default server")


def test_a_block_is_consecutive_and_disjoint_from_single_ports():
    first, last = _free_block(5)
    ports = PortRange(first, last)
    single = ports.take(HOST)
    block = ports.take(HOST, 3, what="a transfer block")
    assert first <= block and block + 2 <= last and single not in range(block, block + 3)
    with pytest.raises(PortsExhaustedError, match="no 3 consecutive free ports left for a transfer block"):
        ports.take(HOST, 3, what="a transfer block")


def test_a_range_with_exactly_the_room_counted_always_fits_its_block():
    """Singles first, then a block, in a range no larger than their sum: no single may split the block's room.

    Ports drawn at random failed here in about one run in five (a single in the middle of 5 ports).
    """
    first, last = _free_block(5)
    for _ in range(40):
        ports = PortRange(first, last)
        ports.check_room(5, "two servers and a transfer block")
        singles = [ports.take(HOST), ports.take(HOST)]
        block = ports.take(HOST, 3, what="a transfer block")
        assert sorted(singles + [block, block + 1, block + 2]) == list(range(first, last + 1))


def test_room_is_checked_in_one_line():
    PortRange(43200, 43203).check_room(4, "x")
    with pytest.raises(ValueError, match="^--ports 43200-43203 holds 4 ports, fewer than the 5 x needs"):
        PortRange(43200, 43203).check_room(5, "x")


# --- which ports a process takes ----------------------------------------------------------------------


@pytest.mark.parametrize("flags, prefill, count, added", [
    ([], False, 1, []),
    (["--tp", "2"], False, 2, ["--nccl_port"]),
    (["--tp=2", "--nccl_port", "5000"], False, 1, []),  # the user's own port is kept
    ([], True, 2, ["--pd_transfer_port"]),  # one rank: no rendezvous (the server refuses --nccl_port)
    (["--tp", "4"], True, 6, ["--nccl_port", "--pd_transfer_port"]),
    (["--tp", "2", "--pd_transfer_port", "6000"], True, 2, ["--nccl_port"]),
])
def test_the_ports_a_model_process_would_pick_itself_are_counted_and_given(flags, prefill, count, added):
    first, last = _free_block(8)
    assert ports_of_model_process(flags, prefill_node=prefill) == count
    extra = confined_port_flags(PortRange(first, last), HOST, flags, prefill_node=prefill)
    assert extra[::2] == added
    for value in extra[1::2]:
        assert first <= int(value) <= last


class _FakeProcess:
    """What a launch needs of a started server."""

    def __init__(self, args: list[str], port: int | None) -> None:
        self.args, self.port = args, port

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def wait_ready(self, *_args: Any, **_kwargs: Any) -> None:
        pass

    def stop(self, *_args: Any) -> None:
        pass


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[_FakeProcess]:
    """Every process a launch starts (nothing is spawned)."""
    processes: list[_FakeProcess] = []

    def start(args: list[str], _log_path: Path, *, port: int | None = None, **_kwargs: Any) -> _FakeProcess:
        processes.append(_FakeProcess(list(args), port))
        return processes[-1]

    monkeypatch.setattr(ServerProcess, "start", staticmethod(start))
    monkeypatch.setattr(pd_cluster, "_wait_for_nodes", lambda *_args: None)
    return processes


def _listening_ports(process: _FakeProcess) -> list[int]:
    ports = [process.port]
    for flag in ("--nccl_port", "--pd_transfer_port"):
        value = flag_value(process.args, flag)
        if value is not None:
            ports.append(int(value))
    return ports


def test_a_normal_server_without_a_range_picks_any_port_as_before(started, tmp_path):
    NormalTopology().launch(ServerSpec("/m", "hrrn", ("--tp", "2")), tmp_path)
    [server] = started
    assert server.port is None and "--nccl_port" not in server.args  # ServerProcess and the server pick them


def test_a_normal_server_in_a_range_gets_its_http_and_rendezvous_ports_from_it(started, tmp_path):
    first, last = _free_block(4)
    topology = NormalTopology(ports=PortRange(first, last))
    spec = ServerSpec("/m", "hrrn", ("--tp", "2"))
    assert topology.ports_needed(spec) == 2
    topology.launch(spec, tmp_path)
    [server] = started
    ports = _listening_ports(server)
    assert len(ports) == 2 and len(set(ports)) == 2 and all(first <= p <= last for p in ports)


@pytest.mark.parametrize("name", ["1p1d", "2p2d"])
def test_every_port_of_a_pd_cluster_comes_from_the_range(started, tmp_path, name):
    first, last = _free_block(40)
    topology = make_topology(name, ports=PortRange(first, last), prefill_args=["--tp", "2"],
                             decode_args=["--tp", "2"])
    spec = ServerSpec("/m", "hrrn", ("--max_total_token_num", "4096"))
    topology.launch(spec, tmp_path)
    master = started[0]
    assert flag_value(master.args, "--run_mode") == "pd_master"
    nodes = started[1:]
    for node in nodes:
        assert flag_value(node.args, "--pd_master_port") == str(master.port)
        assert flag_value(node.args, "--nccl_port") is not None
        assert (flag_value(node.args, "--pd_transfer_port") is not None) == (flag_value(node.args, "--run_mode")
                                                                            == "prefill")
    listening = [port for process in started for port in _listening_ports(process)]
    # A prefill node's transfer block is --tp (2) ports from its base.
    blocks = [int(flag_value(node.args, "--pd_transfer_port")) + 1 for node in nodes
              if flag_value(node.args, "--run_mode") == "prefill"]
    every = listening + blocks
    assert len(every) == len(set(every)) == topology.ports_needed(spec)
    assert all(first <= port <= last for port in every)


def test_side_by_side_takes_each_engine_port_from_the_range(tmp_path):
    first, last = _free_block(4)
    ports = PortRange(first, last)
    ours = side_by_side.EngineServer("ours", "/m", tmp_path, tmp_path, ["--tp", "2"], tmp_path, ports)
    vllm = side_by_side.EngineServer("vllm_default", "/m", tmp_path, tmp_path, [], tmp_path, ports)
    used = [ours.port, vllm.port, int(flag_value(ours.server_args, "--nccl_port"))]
    assert len(set(used)) == 3 and all(first <= port <= last for port in used)
    assert flag_value(vllm.server_args, "--nccl_port") is None


def test_side_by_side_refuses_a_range_too_small_for_its_engines(tmp_path):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "lightllm.benchmark.side_by_side", "--model_dir", str(tmp_path), "--cases", "8x64x8",
         "--engines", "ours,vllm_default,ours", "--ports", "43200-43201"],
        capture_output=True, text=True,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--ports 43200-43201 holds 2 ports, fewer than the 3 --engines ours,vllm_default,ours needs" in done.stderr


def test_a_range_in_the_kernels_ephemeral_range_is_warned_about():
    warning = PortRange(43200, 43399).ephemeral_overlap_warning((32768, 60999))
    assert warning is not None and warning.startswith("warning: --ports 43200-43399 overlaps")
    assert "a range below 32768" in warning
    assert PortRange(23200, 23399).ephemeral_overlap_warning((32768, 60999)) is None
    assert PortRange(61000, 61100).ephemeral_overlap_warning((32768, 60999)) is None
