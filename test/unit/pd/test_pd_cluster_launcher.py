"""Argument handling of the 1p1d benchmark topology and compare_strategies' --topology (no servers)."""

from __future__ import annotations

import pytest

from lightllm.benchmark.compare_strategies import build_parser, topology_kwargs
from lightllm.benchmark.pd_cluster import PdCluster, PdTopology, cluster_commands
from lightllm.benchmark.deployment import ServerSpec
from lightllm.benchmark.topologies import TOPOLOGIES, make_topology


def test_1p1d_is_a_registered_topology():
    assert set(TOPOLOGIES) == {"normal", "1p1d", "2p1d", "1p2d", "2p2d"}
    topology = make_topology("1p1d", start_timeout_s=5, master_args=["--pd_heartbeat_interval", "1"])
    assert isinstance(topology, PdTopology)
    assert topology.describe() == {
        "name": "1p1d", "prefill_nodes": 1, "decode_nodes": 1, "host": "127.0.0.1", "start_timeout_s": 5,
        "master_args": ["--pd_heartbeat_interval", "1"], "prefill_args": [], "decode_args": [],
        "prefill_devices": None, "decode_devices": None,
    }


def test_cluster_commands_put_the_strategy_on_the_prefill_node_only():
    spec = ServerSpec("/m", "hrrn", ("--max_total_token_num", "4096", "--chunked_prefill_size=32"))
    commands = cluster_commands(spec, ["--pd_heartbeat_interval", "1"], "127.0.0.1", 4321)
    membership = ["--pd_master_ip", "127.0.0.1", "--pd_master_port", "4321"]
    assert commands["master"] == ["--run_mode", "pd_master", "--model_dir", "/m", "--pd_heartbeat_interval", "1"]
    assert commands["prefill"] == [
        "--run_mode", "prefill", "--model_dir", "/m", "--prefill_queue_strategy", "hrrn",
        "--max_total_token_num", "4096", "--chunked_prefill_size=32", *membership,
    ]
    assert commands["decode"] == [
        "--run_mode", "decode", "--model_dir", "/m", "--max_total_token_num", "4096", "--chunked_prefill_size=32",
        *membership,
    ]


@pytest.mark.parametrize("flag", ["--pd_master_port", "--pd_master_ip=10.0.0.1", "--port"])
def test_cluster_commands_refuse_flags_the_launcher_sets(flag):
    with pytest.raises(ValueError, match="extra_args must not set"):
        cluster_commands(ServerSpec("/m", "default", (flag, "1")), [], "127.0.0.1", 1)
    with pytest.raises(ValueError, match="master_args must not set"):
        PdTopology(master_args=[flag, "1"])
    for role in ("prefill", "decode"):
        with pytest.raises(ValueError, match=f"{role}_args must not set"):
            PdTopology(**{f"{role}_args": [flag, "1"]})


def test_topology_checks():
    with pytest.raises(ValueError, match="start_timeout_s"):
        PdTopology(start_timeout_s=0)
    with pytest.raises(ValueError, match="missing"):
        PdCluster({})


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory) -> str:
    """A directory the --model_dir flag takes as a checkpoint (its type checks for config.json)."""
    path = tmp_path_factory.mktemp("checkpoint")
    (path / "config.json").write_text("{}")
    return str(path)


@pytest.fixture()
def _parse(checkpoint_dir):
    def parse(*argv):
        return build_parser().parse_args(["--model_dir", checkpoint_dir, "--workload", "long_first", "--out-dir", "/o",
                                          *argv])
    return parse


def test_compare_strategies_topology_flag(_parse):
    assert _parse().topology == "normal"
    assert topology_kwargs(_parse()) == {"host": "127.0.0.1", "start_timeout_s": 300.0}
    kwargs = topology_kwargs(_parse(
        "--topology", "1p1d", "--master-args", "--pd_prefill_timeout_seconds 60", "--prefill-devices", "0",
        "--decode-devices", "1", "--start-timeout", "90",
    ))
    assert kwargs == {
        "host": "127.0.0.1", "start_timeout_s": 90.0, "master_args": ["--pd_prefill_timeout_seconds", "60"],
        "prefill_args": [], "decode_args": [], "prefill_devices": "0", "decode_devices": "1",
    }
    topology = make_topology("1p1d", **kwargs)
    assert topology.devices == {"prefill": "0", "decode": "1"}
    assert topology._env("prefill") == {"CUDA_VISIBLE_DEVICES": "0"}


def test_cpu_nodes_sharing_the_machine_keep_one_thread_count_unless_the_user_set_one(monkeypatch):
    topology = make_topology("1p1d", host="127.0.0.1", start_timeout_s=30.0)
    monkeypatch.delenv("LIGHTLLM_TORCH_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 6)
    assert topology._env("prefill") == topology._env("decode") == {"LIGHTLLM_TORCH_THREADS": "5"}
    # The wide forwards' count set lower: every forward takes it too (the server refuses wide
    # forwards narrower than the rest, naming a variable this user never set).
    monkeypatch.setenv("LIGHTLLM_PREFILL_TORCH_THREADS", "2")
    assert topology._env("prefill") == {"LIGHTLLM_TORCH_THREADS": "2"}
    monkeypatch.setenv("LIGHTLLM_TORCH_THREADS", "2")
    assert topology._env("prefill") is None  # the user's setting reaches both nodes unchanged


def test_compare_strategies_refuses_pd_flags_without_1p1d_and_bad_values(_parse):
    with pytest.raises(ValueError, match="--master-args, --decode-devices only apply with a PD topology"):
        topology_kwargs(_parse("--master-args", "--pd_heartbeat_interval 1", "--decode-devices", "1"))
    with pytest.raises(ValueError, match="master_args is not a valid shell-quoted string"):
        topology_kwargs(_parse("--topology", "1p1d", "--master-args", "'unclosed"))
    with pytest.raises(SystemExit):
        _parse("--topology", "3p3d")


def test_compare_strategies_cli_reports_a_bad_topology_flag_in_one_line(tmp_path, capsys):
    from lightllm.benchmark.compare_strategies import main

    (tmp_path / "config.json").write_text("{}")
    argv = ["--model_dir", str(tmp_path), "--workload", "long_first", "--out-dir", str(tmp_path / "o"),
            "--master-args", "--pd_heartbeat_interval 1"]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "only apply with a PD topology" in capsys.readouterr().err


def test_xpyd_topologies_name_their_nodes_and_give_each_its_own_id():
    topology = make_topology("2p2d", start_timeout_s=5)
    assert (topology.prefill_nodes, topology.decode_nodes) == (2, 2)
    spec = ServerSpec(strategy="hrrn", model_dir="/models/m", extra_args=("--max_total_token_num", "4096"))
    commands = cluster_commands(spec, [], "127.0.0.1", 9000, prefill_nodes=2, decode_nodes=2)
    assert list(commands) == ["master", "prefill", "prefill_2", "decode", "decode_2"]
    for name in ("prefill", "prefill_2", "decode", "decode_2"):
        assert commands[name][-2:] == ["--pd_node_id", name]
    assert all("hrrn" in commands[name] for name in ("prefill", "prefill_2"))
    assert not any("hrrn" in commands[name] for name in ("decode", "decode_2"))
