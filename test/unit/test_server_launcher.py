"""Server specs, topology registry, and the launcher's start-up failure path."""

from __future__ import annotations

import pytest

from lightllm.benchmark.server_launcher import NormalTopology, ServerProcess, ServerSpec, make_topology


def test_spec_builds_identical_flags_apart_from_the_strategy():
    extra = ("--chunked_prefill_size", "256", "--max_total_token_num=4096")
    a = ServerSpec("/m", "default", extra).server_args()
    b = ServerSpec("/m", "hrrn", list(extra)).server_args()
    assert a == ["--model_dir", "/m", "--prefill_queue_strategy", "default", *extra]
    assert [x for x in a if x != "default"] == [x for x in b if x != "hrrn"]


def test_spec_has_flag_understands_both_spellings():
    spec = ServerSpec("/m", "default", ("--max_total_token_num=4096", "--batch_max_tokens", "32"))
    assert spec.has_flag("--max_total_token_num")
    assert spec.has_flag("--batch_max_tokens")
    assert not spec.has_flag("--batch_max")


@pytest.mark.parametrize("flag", ["--port", "--prefill_queue_strategy", "--model_dir", "--host=0.0.0.0"])
def test_spec_rejects_flags_the_launcher_owns(flag):
    with pytest.raises(ValueError, match="extra_args must not set"):
        ServerSpec("/m", "default", (flag, "1"))


def test_spec_rejects_empty_fields():
    with pytest.raises(ValueError, match="model_dir"):
        ServerSpec("", "default")
    with pytest.raises(ValueError, match="strategy"):
        ServerSpec("/m", "")


def test_topology_registry():
    topology = make_topology("normal", start_timeout_s=5)
    assert isinstance(topology, NormalTopology)
    assert topology.describe() == {"name": "normal", "host": "127.0.0.1", "start_timeout_s": 5}
    with pytest.raises(ValueError, match="topology must be one of"):
        make_topology("1p1d")
    with pytest.raises(ValueError, match="start_timeout_s"):
        NormalTopology(start_timeout_s=0)


def test_a_server_that_cannot_start_raises_with_its_log(tmp_path):
    log = tmp_path / "server.log"
    with pytest.raises(RuntimeError, match="during start-up") as info:
        ServerProcess.start(["--model_dir", str(tmp_path / "missing")], log, start_timeout_s=60)
    assert str(log) in str(info.value)
    assert log.stat().st_size > 0
