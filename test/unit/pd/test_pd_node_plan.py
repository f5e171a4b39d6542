"""What a PD node decides before any process starts: its transfer port and its registration."""

from __future__ import annotations

import ipaddress

import pytest

from ipv6_support import link_local_address, needs_ipv6_loopback, needs_link_local
from lightllm.common.basemodel.model_config import ModelConfig
from lightllm.server.argument_error import ArgumentError
from lightllm.server.launch.arg_parser import make_argument_parser
from lightllm.server.launch.pd_node import advertised_host, prepare_pd_node
from lightllm.server.launch.sizing import plan_sizing


def _prepare(model_dir, *flags: str):
    args = make_argument_parser().parse_args(["--model_dir", str(model_dir), *flags])
    config = ModelConfig.from_dir(model_dir)
    info, ports = prepare_pd_node(args, config, plan_sizing(args, config, "cpu"))
    return args, config, info, ports


def test_registration_carries_the_model_shape_and_a_resolved_transfer_port(tiny_llama_dir) -> None:
    args, config, info, ports = _prepare(tiny_llama_dir, "--run_mode", "decode", "--port", "8100")
    # A decode node hosts no transfer group (its ranks join the prefill node's): no port, no address.
    assert ports is None and args.pd_transfer_port is None
    assert info.kv_transfer_address == ""
    assert info.node_id == "decode-127.0.0.1:8100" and info.http_address == "127.0.0.1:8100"
    assert (info.role, info.model_name, info.dtype, info.tp_size) == ("decode", tiny_llama_dir.name, "float32", 1)
    assert (info.num_layers, info.num_kv_heads, info.head_dim) == (
        config.num_hidden_layers, config.num_key_value_heads, config.head_dim)


def test_registration_carries_the_request_length_the_node_takes(tiny_llama_dir) -> None:
    # The master refuses a node that would refuse requests it admits (pd_master.served_model_admission).
    args = make_argument_parser().parse_args(["--model_dir", str(tiny_llama_dir), "--run_mode", "decode"])
    config = ModelConfig.from_dir(tiny_llama_dir)
    default = plan_sizing(args, config, "cpu").max_req_total_len
    assert _prepare(tiny_llama_dir, "--run_mode", "decode")[2].max_req_total_len == default
    assert _prepare(tiny_llama_dir, "--run_mode", "decode", "--max_req_total_len", "1024")[2].max_req_total_len == 1024


def test_flags_given_are_used_and_a_prefill_node_holds_its_ports(tiny_llama_dir) -> None:
    args, _, info, ports = _prepare(tiny_llama_dir, "--run_mode", "prefill", "--pd_transfer_port", "29400", "--tp", "2",
                                    "--pd_node_id", "p-east-1", "--model_name", "served-a", "served-b")
    try:
        assert args.pd_transfer_port == 29400 and info.kv_transfer_address == "127.0.0.1:29400"
        assert (info.node_id, info.role, info.model_name) == ("p-east-1", "prefill", "served-a")
        assert [ports.socket_for(rank).getsockname() for rank in range(2)] == [("127.0.0.1", 29400), ("127.0.0.1", 29401)]
        # Held from here on: a second node given the same port is refused at once, naming it.
        with pytest.raises(ArgumentError, match="--pd_transfer_port 29400: cannot listen on 127.0.0.1:29400..29401"):
            _prepare(tiny_llama_dir, "--run_mode", "prefill", "--pd_transfer_port", "29400", "--tp", "2", "--port", "8001")
    finally:
        ports.close()
    args, _, info, ports = _prepare(tiny_llama_dir, "--run_mode", "prefill")
    assert ports.base == args.pd_transfer_port and info.kv_transfer_address == f"127.0.0.1:{ports.base}"
    ports.close()


@pytest.mark.parametrize("flags, fragment", [
    (["--pd_transfer_port", "8000", "--port", "8000"], "overlaps the HTTP --port"),
    (["--pd_transfer_port", "65535", "--tp", "2"], "leaves no room for 2 TP ranks"),
    # Rank 1's transfer port is the rendezvous: it failed after the children started (EADDRINUSE).
    (["--pd_transfer_port", "23660", "--tp", "2", "--nccl_port", "23661"],
     r"--pd_transfer_port 23660 overlaps --nccl_port 23661 \(the TP rendezvous; rank r's KV transfer uses port \+ r"),
    (["--pd_transfer_port", "23660", "--tp", "2", "--nccl_port", "23660"], "overlaps --nccl_port 23660"),
])
def test_impossible_transfer_ports_are_refused(tiny_llama_dir, flags, fragment) -> None:
    args = make_argument_parser().parse_args(["--model_dir", str(tiny_llama_dir), "--run_mode", "prefill", *flags])
    config = ModelConfig.from_dir(tiny_llama_dir)
    sizing = plan_sizing(args, config, "cpu")
    with pytest.raises(ArgumentError, match=fragment):
        prepare_pd_node(args, config, sizing)


def test_a_wildcard_host_advertises_the_route_to_the_master() -> None:
    args = make_argument_parser().parse_args(["--model_dir", "x", "--host", "0.0.0.0", "--pd_master_ip", "127.0.0.1"])
    assert advertised_host(args) == "127.0.0.1"
    args.host = "10.1.2.3"
    assert advertised_host(args) == "10.1.2.3"




@needs_ipv6_loopback
@pytest.mark.parametrize("master", ["::1", "[::1]"])
def test_a_wildcard_host_advertises_its_ipv6_route_to_an_ipv6_master(tiny_llama_dir, master: str) -> None:
    """The route is probed in the master's family: an IPv4 probe socket cannot connect to ::1 at all,
    and the node stopped with "no route to --pd_master_ip"."""
    args = make_argument_parser().parse_args(["--model_dir", "x", "--host", "::", "--pd_master_ip", master])
    assert advertised_host(args) == "::1"
    _, _, info, _ = _prepare(tiny_llama_dir, "--run_mode", "decode", "--host", "::", "--port", "8100",
                             "--pd_master_ip", master)
    assert info.http_address == "[::1]:8100"  # bracketed, as the master reads it back
    assert info.node_id == "decode-::1:8100"


@needs_link_local
def test_a_wildcard_host_facing_a_link_local_master_is_refused_naming_host(tiny_llama_dir) -> None:
    """--host :: with --pd_master_ip fe80::X%eth0 advertised this node's link-local address without
    its zone ([fe80::...]:8100), which the master took and nobody could dial (EINVAL)."""
    master = link_local_address()
    args = make_argument_parser().parse_args(["--model_dir", "x", "--host", "::", "--pd_master_ip", master])
    assert ipaddress.IPv6Address(advertised_host(args)).is_link_local  # the route to the master's link
    with pytest.raises(ArgumentError, match=r"^--host '::': this node would advertise its address as 'fe80:.*a "
                                            r"link-local address cannot be dialled from another machine.*pass --host "
                                            r"with a routable address of this node\)$"):
        _prepare(tiny_llama_dir, "--run_mode", "decode", "--host", "::", "--port", "8100", "--pd_master_ip", master)


def test_an_ipv6_wildcard_host_advertises_its_ipv4_route_to_an_ipv4_master() -> None:
    # "::" listens on a dual-stack socket, so an IPv4 master reaches it at its IPv4 address.
    args = make_argument_parser().parse_args(["--model_dir", "x", "--host", "::", "--pd_master_ip", "127.0.0.1"])
    assert advertised_host(args) == "127.0.0.1"


def test_an_ipv4_wildcard_host_with_an_ipv6_master_is_refused_naming_the_flags() -> None:
    # 0.0.0.0 listens on IPv4 only: an IPv6 address it advertised would not answer.
    args = make_argument_parser().parse_args(["--model_dir", "x", "--host", "0.0.0.0", "--pd_master_ip", "::1"])
    with pytest.raises(ArgumentError, match=r"^--host '0\.0\.0\.0' listens on every IPv4 interface and no route "
                                            r"to --pd_master_ip '::1'.*or --host ::"):
        advertised_host(args)


def test_the_pd_node_modules_log_under_their_module_names() -> None:
    # A logger name that is no module's cannot be found from the code, nor configured by package.
    from lightllm.server.launch import pd_node
    from lightllm.server.pd.node import service

    assert pd_node.log.name == pd_node.__name__
    assert service.log.name == service.__name__
