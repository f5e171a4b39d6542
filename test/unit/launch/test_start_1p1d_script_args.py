"""scripts/start_1p1d.sh refuses bad options with a one-line error before starting anything."""

from __future__ import annotations

import itertools
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ipv6_support import needs_ipv6_loopback
from script_process_support import stop_script
from lightllm.utils.free_ports import free_port
from lightllm.utils.wildcard_hosts import is_wildcard, loopback_for

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "start_1p1d.sh"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_help_lists_every_option():
    proc = _run("--help")
    assert proc.returncode == 0
    for option in ("--model_dir", "--master_port", "--prefill_port", "--decode_port", "--prefill_devices",
                   "--decode_devices", "--node_args", "--decode_args", "--master_args", "--log_dir",
                   "--start_timeout", "--stop_timeout"):
        assert option in proc.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--master_port", "70000"], "--master_port must be a port in 1..65535, got '70000'"),
        (["--decode_port", "x"], "--decode_port must be a port in 1..65535, got 'x'"),
        (["--prefill_port", "1212"], "ports must differ"),
        (["--start_timeout", "0"], "--start_timeout must be a whole number of seconds >= 1"),
        (["--node_args", "'unclosed"], "--node_args is not a valid shell-quoted string"),
        (["--node_args", "--tp 1 --port 9"], "--port is set by the script"),
        (["--master_args", "--run_mode=normal"], "--run_mode is set by the script"),
        (["--", "--pd_master_port", "5"], "--pd_master_port is set by the script"),
        (["--model_dir"], "--model_dir needs a value"),
        (["--bogus"], "unknown option --bogus"),
        (["--host", "[127.0.0.1]"], "only an IPv6 address goes in brackets"),
        (["--host", "[::1"], "unbalanced brackets"),
        # One pair is stripped; what is left used to pass and stop the nodes later, less clearly.
        (["--host", "[::1]]"], "--host: only one IPv6 address in one pair of brackets, got '::1]'"),
        (["--host", "[[::1]"], "--host: only one IPv6 address in one pair of brackets, got '[::1'"),
    ],
)
def test_bad_options_are_refused(args, message, tmp_path):
    proc = _run("--log_dir", str(tmp_path / "logs"), *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "logs").exists()  # nothing was started


def test_missing_model_dir_is_refused(tmp_path):
    proc = _run("--model_dir", str(tmp_path / "missing"))
    assert proc.returncode == 2 and "is not a directory" in proc.stderr


# A stand-in for "python -m lightllm.server.api_server": prints its argv (into the script's log of
# that process) and answers 200 to every GET on its --host/--port, in that host's address family.
_STUB_SERVER = r'''
import http.server, socket, sys
argv = sys.argv[1:]
print("ARGV", " ".join(argv), flush=True)
host, port = argv[argv.index("--host") + 1], int(argv[argv.index("--port") + 1])
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
class Server(http.server.HTTPServer):
    address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
Server((host, port), Handler).serve_forever()
'''


def _fake_python(tmp_path: Path) -> Path:
    stub = tmp_path / "stub_server.py"
    stub.write_text(_STUB_SERVER)
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/bash\nif [ "$1" = -m ] && [ "$2" = lightllm.server.api_server ]; then\n'
                    f'  shift 2; exec {sys.executable} {stub} "$@"\nfi\nexec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    return fake



# Hosts, wildcards and not, in the spellings an operator might write (the test adds bracketed and zoned forms).
_HOST_SPELLINGS = [
    "", "0", "0.0.0.0", "00.0.0.0", "0.0.0.00", "0.0.0.1", "127.0.0.1", "1.2.3.4", "localhost", "0x0", "0.0.0.0.0",
    "::", ":::", "::::", ":", "::0", "0::", "0::0", "::0:0", "0:0::0:0", "0000::", "00000::", "::00000", "::1", "1::",
    "::01", "0:0:0:0:0:0:0:0", "0000:0000:0000:0000:0000:0000:0000:0000", "0:0:0:0:0:0:0", "0:0:0:0:0:0:0:0:0",
    "0:0:0:0:0:0:0:1", "0::0:0:0:0:0:0", "0::0:0:0:0:0:0:0", ":0::", "::0:", ":0:0:0:0:0:0:0:0", "0:0:0:0:0:0:0:0:",
    "0::0::0", "::0.0.0.0", "::0.0.0.1", "::ffff:0.0.0.0", "::ffff:0:0", "0:0:0:0:0:0:0.0.0.0", "0:0:0:0:0:0:0:0.0.0.0",
    "0:0:0:0:0:0.0.0.0", "::0:0.0.0.0", "0::0.0.0.0", ":0.0.0.0", "::00.0.0.0", "::0.0.0.00", "::0.0.0", "0.0.0.0::",
    "fe80::1", "fd00::", "::a", "[", "]", "[]", "[[::]]",
]
_ZONES = ["", "%eth0", "%1", "%", "%%", "%a%b", "%a/b", "% x", "%25eth0"]


def _host_spellings() -> list:
    """Every spelling above bare and bracketed, with and without zones; then generated groups of zeros."""
    spellings = {f"{b}{h}{z}{e}" for h in _HOST_SPELLINGS for z in _ZONES for b, e in (("", ""), ("[", "]"))}
    rng = random.Random(1212)
    groups = ["", "", "0", "0", "00", "0000", "00000", "1", "0.0.0.0", "0.0.0.1"]
    for count in range(1, 11):
        for _ in range(150):
            spellings.add(":".join(rng.choice(groups) for _ in range(count)))
    spellings.update(":".join(p) for n in range(2, 10) for p in itertools.product(["", "0"], repeat=n))
    return sorted(spellings)


def test_the_scripts_wildcards_are_those_of_wildcard_hosts():
    """The script's wildcard rule (read in bash) and lightllm.utils.wildcard_hosts.is_wildcard agree on every spelling.

    The bash test took zeros and colons only, so "::0.0.0.0", "0:0:0:0:0:0:0.0.0.0" and "[::0.0.0.0]", which
    is_wildcard calls wildcards, were advertised as http://[::0.0.0.0]:PORT instead of reached on [::1].
    """
    spellings = _host_spellings()
    assert all("\t" not in h and "\x01" not in h for h in spellings)
    proc = subprocess.run(
        ["bash", "-c", f'source "{SCRIPT}"; for h; do printf "%s\\t" "$h"; wildcard_loopback "$h" || exit 1; printf "\\x01"; done',
         "_", *spellings],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    got = {}
    for line in proc.stdout.split("\x01")[:-1]:  # host TAB (loopback NL, or nothing) \x01
        host, _, reach = line.rpartition("\t")
        got[host] = reach.rstrip("\n")
    assert sorted(got) == spellings
    wrong = {h: got[h] for h in spellings if got[h] != (loopback_for(h.strip("[]")) if is_wildcard(h) else "")}
    assert not wrong, wrong
    assert sum(1 for h in spellings if is_wildcard(h)) > 100  # the comparison covers many wildcards


@needs_ipv6_loopback
@pytest.mark.parametrize("host, listen, reach", [("::1", "::1", "::1"), ("[::1]", "::1", "::1"), ("::", "::", "::1"),
                                                 ("::0", "::0", "::1"), ("[0::]", "0::", "::1"),
                                                 ("::0.0.0.0", "::0.0.0.0", "::1"),
                                                 ("[0:0:0:0:0:0:0.0.0.0]", "0:0:0:0:0:0:0.0.0.0", "::1")])
def test_an_ipv6_host_gets_bracketed_urls_and_a_reachable_master_ip(host, listen, reach, tmp_path):
    """--host ::1 (or [::1], or ::) reaches ready: the script polled http://::1:PORT, no URL curl parses,
    and gave the nodes --pd_master_ip ::, a wildcard to listen on and no address to reach (and "::0"
    or "0::", spellings its list of wildcards missed, as they were; and "::0.0.0.0", which its bash rule missed)."""
    _start_and_check(host, listen, reach, tmp_path)


def test_an_ipv4_wildcard_host_has_the_nodes_dial_ipv4_loopback(tmp_path):
    """--host 0.0.0.0 is where the servers listen; the nodes and the script reach the master on 127.0.0.1."""
    _start_and_check("0.0.0.0", "0.0.0.0", "127.0.0.1", tmp_path)


def _start_and_check(host: str, listen: str, reach: str, tmp_path: Path) -> None:
    """Run the script with the stub servers until ready; check what it listened on and dialled."""
    master, prefill, decode = free_port(), free_port(), free_port()
    log_dir = tmp_path / "logs"
    out_path = tmp_path / "script.out"
    with open(out_path, "w") as out:
        proc = subprocess.Popen(
            ["bash", str(SCRIPT), "--model_dir", str(tmp_path), "--log_dir", str(log_dir), "--host", host,
             "--master_port", str(master), "--prefill_port", str(prefill), "--decode_port", str(decode),
             "--start_timeout", "20", "--stop_timeout", "5"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHON": str(_fake_python(tmp_path))},
        )
    try:
        deadline = time.monotonic() + 40
        while "cluster ready" not in out_path.read_text():
            assert proc.poll() is None, out_path.read_text()
            assert time.monotonic() < deadline, out_path.read_text()
            time.sleep(0.2)
        text = out_path.read_text()
        reach_url = f"[{reach}]" if ":" in reach else reach
        for port in (master, prefill, decode):
            assert f"http://{reach_url}:{port}" in text
        if ":" in reach:
            assert f"http://{reach}:" not in text
        for role in ("master", "prefill", "decode"):
            assert f"--host {listen} " in (log_dir / f"{role}.log").read_text()
        for role in ("prefill", "decode"):
            assert f"--pd_master_ip {reach} " in (log_dir / f"{role}.log").read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, out_path.read_text()
    finally:
        stop_script(proc, 30)
