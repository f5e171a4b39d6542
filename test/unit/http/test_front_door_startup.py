"""Start-up checks of the real launcher: ports are bound before anything loads, exit codes, the open-host warning.

Each test runs ``python -m lightllm.server.api_server`` and reads its output; none of them loads a
model: that the process stopped before loading is checked on its output lines, not on time.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from ipv6_support import link_local_address, needs_ipv6_loopback, needs_link_local
from lightllm.server.http.transport.listen_sockets import PortUnavailableError, bind_listeners, is_loopback
from lightllm.server.launch.arg_parser import parse_server_args
from lightllm.server.launch.nccl_rendezvous import check_nccl_rendezvous
from lightllm.server.launch.exit_codes import EXIT_INVALID_CONFIG, EXIT_PORT_UNAVAILABLE
from lightllm.utils.free_ports import free_port

# Lines the launcher logs once it plans or loads the model.
LOADING_MARKERS = ("starting: model=", "children ready", "serving on")


def _launch(args: List[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lightllm.server.api_server", *args], capture_output=True,
                          text=True, timeout=300)


def _lines(proc: subprocess.CompletedProcess) -> List[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]


def test_a_taken_http_port_exits_3_with_one_line_before_the_model_loads(tiny_llama_dir: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        proc = _launch(["--model_dir", str(tiny_llama_dir), "--port", str(port)])
    assert proc.returncode == EXIT_PORT_UNAVAILABLE == 3
    errors = [line for line in _lines(proc) if line.startswith("error:")]
    assert errors == [f"error: cannot listen on 127.0.0.1:{port} (--host/--port): Address already in use; "
                      "is another server running on this port?"], _lines(proc)
    assert not any(marker in line for line in _lines(proc) for marker in LOADING_MARKERS)


def test_a_taken_transfer_port_exits_3_naming_it(tiny_llama_dir: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        proc = _launch(["--model_dir", str(tiny_llama_dir), "--run_mode", "prefill", "--port", str(free_port()),
                        "--pd_transfer_port", str(port)])
    assert proc.returncode == EXIT_PORT_UNAVAILABLE
    errors = [line for line in _lines(proc) if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: --pd_transfer_port {port}: cannot listen on"), errors
    assert not any(marker in line for line in _lines(proc) for marker in LOADING_MARKERS)


def test_listening_beyond_loopback_without_a_key_warns_once(tmp_path: Path) -> None:
    missing = str(tmp_path / "no_model_here")  # the config read fails after the warning: nothing loads
    proc = _launch(["--model_dir", missing, "--host", "0.0.0.0", "--port", str(free_port())])
    assert proc.returncode == EXIT_INVALID_CONFIG
    warnings = [line for line in _lines(proc) if "beyond loopback" in line]
    assert len(warnings) == 1 and "without an API key" in warnings[0] and "--api_key" in warnings[0]
    keyed = _launch(["--model_dir", missing, "--host", "0.0.0.0", "--port", str(free_port()), "--api_key", "k1"])
    assert keyed.returncode == EXIT_INVALID_CONFIG
    assert not any("beyond loopback" in line for line in _lines(keyed))
    local = _launch(["--model_dir", missing, "--port", str(free_port())])
    assert not any("beyond loopback" in line for line in _lines(local))


def test_an_invalid_per_client_limit_is_refused_in_one_line(tiny_llama_dir: Path) -> None:
    proc = _launch(["--model_dir", str(tiny_llama_dir), "--port", str(free_port()), "--http_max_connections", "8",
                    "--http_max_connections_per_client", "9"])
    assert proc.returncode == EXIT_INVALID_CONFIG
    assert [line for line in _lines(proc) if line.startswith("error:")] == [
        "error: --http_max_connections_per_client must be in 1..--http_max_connections (8), got 9"]
    proc = _launch(["--model_dir", str(tiny_llama_dir), "--port", str(free_port()),
                    "--http_max_preparing_per_client", "-1"])
    assert proc.returncode == EXIT_INVALID_CONFIG
    assert [line for line in _lines(proc) if line.startswith("error:")] == [
        "error: --http_max_preparing_per_client must be >= 0 (0: no limit), got -1"]


def test_loopback_names_and_binding() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("127.0.0.2") and is_loopback("::1") and is_loopback("[::1]")
    assert is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("10.0.0.1")
    # IPv4-mapped: judged by the IPv4 part (Python's is_loopback is False for all of them).
    assert is_loopback("::ffff:127.0.0.1") and is_loopback("[::ffff:127.0.0.1]")
    assert not is_loopback("::ffff:10.0.0.1") and not is_loopback("::ffff:0.0.0.0")
    sockets = bind_listeners("127.0.0.1", 0)
    try:
        assert len(sockets) == 1 and sockets[0].getsockname()[0] == "127.0.0.1"
    finally:
        for sock in sockets:
            sock.close()


@needs_ipv6_loopback
def test_a_link_local_host_without_its_zone_is_told_to_name_the_interface() -> None:
    """bind refuses fe80::X without a zone with EINVAL, which said "is another server running on this port?"."""
    with pytest.raises(PortUnavailableError) as refused:
        bind_listeners("fe80::1:2:3:4", 0)
    message = str(refused.value)
    assert message.startswith("cannot listen on [fe80::1:2:3:4]:0 (--host/--port): Invalid argument; a link-local "
                              "address needs its zone, the interface it is on (as --host fe80::1:2:3:4%eth0 for eth0), "
                              "but no interface of this machine has fe80::1:2:3:4"), message
    assert "another server" not in message


@needs_link_local
def test_a_link_local_host_of_this_machine_without_its_zone_is_given_the_zone_to_write() -> None:
    host, _, zone = link_local_address().partition("%")
    for spelling in (host, f"[{host}]"):
        with pytest.raises(PortUnavailableError, match=re.escape(
                f"Invalid argument; a link-local address is listened on through its interface, written as its zone: "
                f"--host {host}%{zone}")):
            bind_listeners(spelling, 0)
    args = parse_server_args(["--model_dir", "/m", "--tp", "2", "--nccl_host", host])
    with pytest.raises(PortUnavailableError, match=re.escape(f"cannot listen there (Invalid argument); a link-local "
                                                             f"address is listened on through its interface, written "
                                                             f"as its zone: --nccl_host {host}%{zone}")):
        check_nccl_rendezvous(args)


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6 on this machine")
def test_the_ipv6_wildcard_listens_for_ipv4_clients_too() -> None:
    """``--host ::`` is the usual dual-stack setting (containers): IPv4 probes must reach it, as uvicorn's."""
    try:
        sockets = bind_listeners("::", 0)
    except PortUnavailableError:
        pytest.skip("IPv6 cannot be bound here")
    try:
        (listener,) = sockets
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        for sock in sockets:
            sock.close()


def test_a_machine_name_that_resolves_to_loopback_only_is_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    """A name such as Debian's machine name (127.0.1.1 in /etc/hosts) must not warn "beyond loopback"."""
    answers = {"vm": ["127.0.1.1"], "both": ["127.0.0.1", "10.1.2.3"]}

    def getaddrinfo(name: str, *args: object, **kwargs: object) -> list:
        if name not in answers:
            raise socket.gaierror("unknown")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, 0)) for address in answers[name]]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    assert is_loopback("vm")
    assert not is_loopback("both") and not is_loopback("nohost") and not is_loopback("")
