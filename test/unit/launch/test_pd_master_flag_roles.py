"""The PD master refuses a model node's flag naming the node role that takes it.

It used to say every such flag "configures prefill/decode nodes" and to "give it to the nodes",
though a decode node refuses the prefill-queue flags: the master and the nodes now derive each
flag's roles from its one declaration (flag_roles), and this test holds the two together.
"""

from __future__ import annotations

from typing import List

import pytest

from lightllm.server.argument_error import ArgumentError
from lightllm.server.launch.arg_parser import parse_server_args
from lightllm.server.launch.args_check import validate_args
from lightllm.server.launch.pd_master import check_master_flags, node_roles_taking

# A flag of each kind a node role may refuse, with a value it takes on the role that reads it.
_NODE_FLAGS = {
    "prefill_queue_strategy": ["hrrn"],
    "prefill_max_overtake_tokens": ["100"],
    "prefill_overtake_fraction": ["0.2"],
    "disable_prefill_overtake_bound": [],
    "chunked_prefill_size": ["256"],
    "batch_max_tokens": ["2048"],
    "disable_chunked_prefill": [],
    "disable_mixed_batches": [],
    "pd_kv_page_size": ["64"],
    "pd_transfer_port": ["40123"],
    "pd_reserve_lease_seconds": ["5"],
    "pd_max_segment_tokens": ["8"],
    "tp": ["1"],
    "running_max_req_size": ["8"],
}


def _flag(name: str) -> List[str]:
    return [f"--{name}", *_NODE_FLAGS[name]]


def _node_refuses(role: str, name: str) -> bool:
    args = parse_server_args(["--model_dir", "/m", "--run_mode", role, "--pd_master_ip", "127.0.0.1", *_flag(name)])
    try:
        validate_args(args)
    except ArgumentError as exc:
        assert f"--{name}" in str(exc), exc  # refused for this flag, not for something else
        return True
    return False


@pytest.mark.parametrize("name", sorted(_NODE_FLAGS))
def test_the_master_sends_each_flag_to_the_roles_that_take_it(name):
    takes = node_roles_taking(name)
    for role in ("prefill", "decode"):
        assert (role in takes) == (not _node_refuses(role, name)), (name, role)


@pytest.mark.parametrize("argv, message", [
    (["--prefill_queue_strategy", "hrrn"],
     "--prefill_queue_strategy configures model nodes and does nothing on --run_mode pd_master; give it to the "
     "prefill nodes (--run_mode prefill: a decode node refuses it)"),
    (["--prefill_overtake_fraction", "0.2", "--disable_chunked_prefill"],
     "give them to the prefill nodes (--run_mode prefill: a decode node refuses them)"),
    (["--tp", "1"], "--tp configures model nodes and does nothing on --run_mode pd_master; give it to the prefill "
                    "and decode nodes"),
    (["--pd_max_segment_tokens", "8", "--tp", "1", "--prefill_max_overtake_tokens", "5"],
     "give --tp to the prefill and decode nodes; --pd_max_segment_tokens to the decode nodes (--run_mode decode: a "
     "prefill node refuses it); --prefill_max_overtake_tokens to the prefill nodes"),
    (["--disable_mixed_batches"], "give it to a normal server (--run_mode normal: every PD node refuses it)"),
])
def test_the_master_names_the_role_that_takes_each_flag(argv, message):
    args = parse_server_args(["--model_dir", "/m", "--run_mode", "pd_master", *argv])
    with pytest.raises(ValueError) as refused:
        check_master_flags(args)
    assert message in str(refused.value)
    assert "prefill/decode nodes" not in str(refused.value)


def test_the_master_s_own_check_names_the_role_of_pd_transfer_port():
    """validate_args used to refuse it first, with the words meant for a decode node."""
    args = parse_server_args(["--model_dir", "/m", "--run_mode", "pd_master", *_flag("pd_transfer_port")])
    validate_args(args)
    with pytest.raises(ValueError, match=r"--pd_transfer_port configures model nodes and does nothing on "
                                         r"--run_mode pd_master; give it to the prefill nodes"):
        check_master_flags(args)
