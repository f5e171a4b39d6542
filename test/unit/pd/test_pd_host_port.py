"""The PD contract's one ``host:port`` rule, and the readers that use it.

A node advertises ``host:port`` (an IPv6 host in brackets, as a URL needs it); the master calls
it and hands a prefill node's transfer address to the decode node, whose ranks connect to the
host with sockets and ``TCPStore``.  Three copies of the rule disagreed, and the decode node's
kept the brackets, so a decode node could not join a prefill node on IPv6: every connect to
``"[::1]"`` failed until the deadline, reported as "did not accept a connection".
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any, Callable, Dict

import pytest
from pydantic import ValidationError

from ipv6_support import needs_ipv6_loopback
from lightllm.common.basemodel.model_config import ModelConfig
from lightllm.server.argument_error import ArgumentError
from lightllm.server.launch.arg_parser import make_argument_parser
from lightllm.server.launch.pd_node import prepare_pd_node
from lightllm.server.launch.sizing import plan_sizing
from lightllm.server.pd.node.host_contract import parse_transfer_address
from lightllm.server.pd.protocol.host_port import HostPortError, format_host_port, parse_host_port
from lightllm.server.pd.protocol.node_info import NodeInfo, NodeInfoError
from lightllm.server.pd.protocol.stream_lines import TransferSetupBody
from lightllm.utils.host_names import host_problem

ACCEPTED = {
    "10.0.0.1:7000": ("10.0.0.1", 7000),
    "node-1.example:1": ("node-1.example", 1),
    "localhost:65535": ("localhost", 65535),
    "[fd00::1]:7000": ("fd00::1", 7000),
    "[::1]:8100": ("::1", 8100),
    "[::ffff:10.0.0.1]:80": ("::ffff:10.0.0.1", 80),
}

REFUSED = {
    "fd00::1:7000": "IPv6 host in brackets",  # which colon starts the port?
    "::1:8100": "IPv6 host in brackets",
    "[1.2.3.4]:80": "only an IPv6 address goes in brackets",
    "[node-1]:80": "only an IPv6 address goes in brackets",
    "[]:80": "only an IPv6 address goes in brackets",
    "[fe80::1%eth0]:80": "zone",
    "1.2.3.4]:80": "unbalanced brackets",
    "[::1:80": "unbalanced brackets",
    "10.0.0.256:80": "not an IPv4 address",
    "1234:80": "not an IPv4 address",
    "node_1:80": "not an IP address or a host name",
    "h:0": r"port in \[1, 65535\]",
    "h:65536": r"port in \[1, 65535\]",
    "h:080": "no leading zeros",
    "h:+80": r"port in \[1, 65535\]",
    "h:": r"port in \[1, 65535\]",
    "h:80\n": r"port in \[1, 65535\]",
    "h": "must be 'host:port'",
    ":7000": "must be 'host:port'",
}


@pytest.mark.parametrize("value, expected", ACCEPTED.items())
def test_ipv4_host_names_and_bracketed_ipv6_are_read_with_a_bare_host(value: str, expected: Any) -> None:
    assert parse_host_port(value) == expected
    assert format_host_port(*expected) == value  # written back as it was read


@pytest.mark.parametrize("value, fragment", REFUSED.items())
def test_anything_else_is_refused_saying_why(value: str, fragment: str) -> None:
    with pytest.raises(HostPortError, match=fragment):
        parse_host_port(value)


# Hosts as a flag gives them (--pd_master_ip, --nccl_host): None where taken, else the reason.
HOSTS = {
    "10.0.0.1": None, "node-1.example": None, "localhost": None, "::1": None, "[::1]": None,
    "fd00::1": None, "[fd00::1]": None, "::ffff:10.0.0.1": None,
    "fe80::1%eth0": "zone", "[fe80::1%eth0]": "zone",
    # Without its zone a link-local address names no interface to dial it through: connect raises EINVAL.
    "fe80::fc:ff:fe00:1": "^a link-local address cannot be dialled", "[fe80::1]": "^a link-local address cannot be dialled",
    "[1.2.3.4]": "only an IPv6 address goes in brackets",
    "[node-1]": "only an IPv6 address goes in brackets", "[]": "only an IPv6 address goes in brackets",
    "[::1": "unbalanced brackets", "::1]": "unbalanced brackets", "10.0.0.256": "not an IPv4 address",
    "1234": "not an IPv4 address", "node_1": "not an IP address or a host name",
}


@pytest.mark.parametrize("host, refused", HOSTS.items())
def test_the_flags_and_the_host_port_contract_take_the_same_hosts_for_the_same_reasons(host: str, refused) -> None:
    """host_problem (the flags) took "fe80::1%eth0" and "[1.2.3.4]", which every host:port reader refused."""
    # The host as host:port carries it: an IPv6 address bracketed, anything else as given.
    written = f"[{host}]:7000" if ":" in host and "[" not in host and "]" not in host else f"{host}:7000"
    problem = host_problem(host)
    if refused is None:
        assert problem is None
        assert parse_host_port(written) == (host.strip("[]"), 7000)
        assert format_host_port(host, 7000) == written
        return
    assert problem is not None and re.search(refused, problem)
    with pytest.raises(HostPortError) as read:
        parse_host_port(written)
    assert f"({problem})" in str(read.value)  # the same words, from the same rule
    with pytest.raises(HostPortError, match=re.escape(problem)):
        format_host_port(host, 7000)


def test_the_zone_reason_says_why_it_is_refused() -> None:
    # Not "cannot be put in a URL": httpx reads http://[fe80::1%eth0]:8000/ fine.
    assert "the zone names a network interface of one machine" in host_problem("fe80::1%eth0")


@pytest.mark.parametrize("host", ["fe80::1%eth0", "[fe80::1%eth0]", "fe80::1%2"])
def test_a_zone_is_taken_where_this_machine_dials_or_listens_and_refused_in_an_advertised_address(host: str) -> None:
    """--pd_master_ip and --nccl_host are used on this machine, where the zone names its interface;
    they were refused with the reason that holds only for an address told to another machine."""
    assert host_problem(host, allow_zone=True) is None
    with pytest.raises(HostPortError, match="zone"):
        format_host_port(host, 7000)
    with pytest.raises(HostPortError, match="zone"):
        parse_host_port(f"[{host.strip('[]')}]:7000")


def test_a_link_local_address_is_taken_where_this_machine_dials_or_listens() -> None:
    # Its zone is this machine's to give (or its default); only an advertised address refuses it.
    assert host_problem("fe80::1", allow_zone=True) is None and host_problem("[fe80::1]", allow_zone=True) is None
    # Not an IPv4 link-local address, which routes without a zone.
    assert host_problem("169.254.1.1") is None


@pytest.mark.parametrize("host", ["fe80::1%25eth0", "[fe80::1%25eth0]", "fe80::1%25en0"])
def test_a_zone_in_its_url_escaping_is_refused_saying_how_to_write_it(host: str) -> None:
    """"%25eth0" was taken as zone "25eth0", an interface no machine has, and failed only on connect."""
    assert "write the zone as %eth0 on the command line; %25 is its URL escaping" in host_problem(host, allow_zone=True)
    # An all-digit zone is an interface index, whatever its digits.
    assert host_problem("fe80::1%25", allow_zone=True) is None and host_problem("fe80::1%251", allow_zone=True) is None


@pytest.mark.parametrize("host", ["fe80::1%25eth0", "[fe80::1%25eth0]", "fd00::1%25en0"])
def test_a_zone_in_its_url_escaping_is_named_in_an_advertised_address_too(host: str) -> None:
    """parse_host_port("[fe80::1%25eth0]:7") said only that an advertised address takes no zone: the
    %25 slip, which the docs say is named everywhere, was named only where a zone is taken."""
    zone = host.strip("[]").partition("%25")[2]
    problem = host_problem(host)
    assert problem.startswith(f"an IPv6 zone starting %25 (%25 is its URL escaping: a host writes zone {zone} as "
                              f"%{zone}), and no address with a zone is taken here")
    assert "the zone names a network interface of one machine" in problem
    with pytest.raises(HostPortError, match=re.escape(problem)):
        parse_host_port(f"[{host.strip('[]')}]:7")
    with pytest.raises(HostPortError, match=re.escape(problem)):
        format_host_port(host, 7)
    # An all-digit zone is an interface index: refused as any zone is, with no word of %25.
    assert "%25" not in host_problem("fe80::1%25")


def test_a_percent_sign_outside_an_ipv6_address_is_read_as_a_bad_name_not_a_bad_zone() -> None:
    assert "IPv6 zone" in host_problem("fe80::1%a b", allow_zone=True)
    assert host_problem("foo%bar", allow_zone=True).startswith("not an IP address or a host name")


def test_a_non_string_is_refused() -> None:
    with pytest.raises(HostPortError, match="string"):
        parse_host_port(7000)


def test_the_written_form_brackets_an_ipv6_host_and_refuses_what_no_reader_takes() -> None:
    assert format_host_port("::1", 7000) == "[::1]:7000"
    assert format_host_port("[::1]", 7000) == "[::1]:7000"
    assert format_host_port("node-1", 7000) == "node-1:7000"
    for host, port in [("node_1", 7000), ("::1", 0), ("10.0.0.1", 70000)]:
        with pytest.raises(HostPortError):
            format_host_port(host, port)


def _node_info(address: str) -> None:
    NodeInfo(node_id="p0", role="prefill", model_name="m", dtype="float16", num_layers=2, num_kv_heads=2,
             head_dim=8, tp_size=1, http_address=address, kv_transfer_address=address)


def _setup_body(address: str) -> None:
    TransferSetupBody(epoch=1, peer_node_id="p0", prefill_transfer_address=address)


READERS: Dict[str, Callable[[str], Any]] = {
    "registration": _node_info,
    "transfer_setup body": _setup_body,
    "decode node's service": parse_transfer_address,
}


@pytest.mark.parametrize("reader", READERS)
def test_every_reader_of_an_address_keeps_the_one_rule(reader: str) -> None:
    """The registration, the transfer-setup body and the decode node agree on every value."""
    for value in ACCEPTED:
        READERS[reader](value)
    for value in REFUSED:
        with pytest.raises((NodeInfoError, ValidationError, ValueError)):
            READERS[reader](value)


def test_a_refused_registration_address_names_its_field() -> None:
    with pytest.raises(NodeInfoError, match="^http_address must be 'host:port' with an IPv6 host in brackets") as refused:
        _node_info("fd00::1:7000")
    assert refused.value.param == "http_address"
    with pytest.raises(ValueError, match="^prefill_transfer_address must be 'host:port'"):
        parse_transfer_address("fd00::1:7000")




@needs_ipv6_loopback
def test_a_transfer_store_on_ipv6_is_joined_through_the_advertised_address() -> None:
    """The repro: a store listening on ::1, reached from ``[::1]:port`` as the decode node reads it."""
    dist = pytest.importorskip("torch.distributed")
    from lightllm.server.pd.kv_transfer.group_join import connect_store

    server = dist.TCPStore("::1", 0, None, True, timedelta(seconds=5), wait_for_workers=False)
    host, port = parse_transfer_address(format_host_port("::1", server.port))
    client = connect_store(host, port, 3.0)
    client.set("joined", "yes")
    assert server.get("joined") == b"yes"


@needs_ipv6_loopback
def test_a_node_on_an_ipv6_host_advertises_bracketed_addresses(tiny_llama_dir) -> None:
    args = make_argument_parser().parse_args(["--model_dir", str(tiny_llama_dir), "--run_mode", "prefill",
                                              "--host", "::1", "--port", "8100"])
    config = ModelConfig.from_dir(tiny_llama_dir)
    info, ports = prepare_pd_node(args, config, plan_sizing(args, config, "cpu"))
    try:
        assert info.http_address == "[::1]:8100"
        assert info.kv_transfer_address == f"[::1]:{ports.base}"
        assert info.node_id == "prefill-::1:8100"  # bare: a node id has no brackets
        assert parse_transfer_address(info.kv_transfer_address) == ("::1", ports.base)
    finally:
        ports.close()


def test_a_host_the_master_could_not_read_is_refused_naming_the_flag(tiny_llama_dir) -> None:
    args = make_argument_parser().parse_args(["--model_dir", str(tiny_llama_dir), "--run_mode", "decode",
                                              "--host", "node_1"])
    config = ModelConfig.from_dir(tiny_llama_dir)
    with pytest.raises(ArgumentError, match="^--host 'node_1': this node would advertise its address as 'node_1'"):
        prepare_pd_node(args, config, plan_sizing(args, config, "cpu"))
