"""How long ``/health`` takes while a server is busy: N streams, and optionally one client holding many connections.

    python -m lightllm.benchmark.health_latency --model_dir /tmp/demo_small --streams 400 --duration 60
    python -m lightllm.benchmark.health_latency --url http://127.0.0.1:8000 --streams 400 --hold 2100

The stream load runs on this process's event loop (raw HTTP/1.1, one connection per stream; a stream
that ends is replaced at once, so N stay open). The probe runs in a process of its own and, like a
Kubernetes probe, opens a fresh connection for every ``GET /health`` (``--probe_path`` to probe another
path) and times it until the answer is read in full. ``--hold M`` opens M more connections from one
source address (``--hold_source``; 127.0.0.2 against an IPv4 server: another client than the streams), each sending one byte and then nothing, and replaces every one the server closes.
IPv6 has no second loopback address, so against an IPv6 server ``--hold`` needs ``--hold_source``.
The report is one JSON line: probe count, statuses, p50/p99/max latency in milliseconds.  A run that
measured nothing (no stream served, no held connection opened, no probe answered) prints one
``error:`` line instead and exits 1, as does a server that cannot be reached or refuses to start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import shlex
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple
from urllib.parse import urlsplit

from lightllm.benchmark.cli_args import (OneLineErrorParser, checkpoint_dir, given_flags, non_negative_float,
                                         non_negative_int, positive_float, server_url, shell_words)
from lightllm.benchmark.count_flags import positive_int
from lightllm.benchmark.hold_source import IPV4_HOLD_SOURCE, check_hold_source
from lightllm.utils.interrupts import interruptible


PROBE_TIMEOUT_SECONDS = 10.0
# Flags this tool gives the server it starts; --server_args setting them again would be ambiguous.
_OWNED_SERVER_FLAGS = ("--model_dir", "--host", "--port")


def _address(url: str) -> Tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


def probe_once(host: str, port: int, path: str, timeout: float = PROBE_TIMEOUT_SECONDS) -> Tuple[int, float]:
    """One probe on a fresh connection: (status or 0 on failure, seconds until the answer was read)."""
    start = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            data = b""
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
    except (OSError, ValueError, IndexError):
        status = 0
    return status, time.monotonic() - start


def _probe_loop(host: str, port: int, path: str, interval: float, duration: float, conn: Any,
                control_port: Optional[int] = None) -> None:
    # A Ctrl-C reaches the whole process group: the parent stops this process (no traceback of its own).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    results: List[Tuple[int, float]] = []
    control: List[Tuple[int, float]] = []
    end = time.monotonic() + duration
    while time.monotonic() < end:
        results.append(probe_once(host, port, path))
        if control_port is not None:
            control.append(probe_once("127.0.0.1", control_port, "/"))
        time.sleep(interval)
    conn.send((results, control))
    conn.close()


def _control_server(sock: socket.socket) -> None:
    """A trivial responder in a process of its own: what a probe costs on this machine right now."""
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # stopped by the parent, as the prober
    while True:
        client, _ = sock.accept()
        with client:
            client.recv(65536)
            client.sendall(answer)


async def _stream_forever(host: str, port: int, body: bytes, headers: str, stop: asyncio.Event,
                          counts: Dict[str, int]) -> None:
    request = (f"POST /generate_stream HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
               f"{headers}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            counts["connect_errors"] += 1
            await asyncio.sleep(0.1)
            continue
        try:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            counts["ok" if head.startswith(b"HTTP/1.1 200") else "refused"] += 1
            while not stop.is_set() and await reader.read(65536):
                pass
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            counts["broken"] += 1
        finally:
            writer.close()


async def _hold_forever(host: str, port: int, source: str, stop: asyncio.Event, counts: Dict[str, int]) -> None:
    """One connection from ``source`` that sends a byte and nothing more; reopened whenever the server closes it."""
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
        except OSError:
            await asyncio.sleep(0.05)
            continue
        counts["held"] += 1
        try:
            writer.write(b"G")
            await reader.read()  # returns once the server closes (408 after its head deadline, or 503)
        except OSError:
            pass
        finally:
            writer.close()


class ProberEnded(Exception):
    """The probe process ended without its results."""


async def _load(args: argparse.Namespace, host: str, port: int) -> Dict[str, Any]:
    body = json.dumps({"inputs": "The quick brown fox", "parameters": {
        "max_new_tokens": args.max_new_tokens, "ignore_eos": True}}).encode()
    headers = f"Authorization: Bearer {args.api_key}\r\n" if args.api_key else ""
    stop = asyncio.Event()
    counts: Dict[str, int] = {"ok": 0, "refused": 0, "broken": 0, "connect_errors": 0, "held": 0}
    tasks = [asyncio.ensure_future(_stream_forever(host, port, body, headers, stop, counts))
             for _ in range(args.streams)]
    tasks += [asyncio.ensure_future(_hold_forever(host, port, args.hold_source, stop, counts))
              for _ in range(args.hold)]
    await asyncio.sleep(args.warmup)
    ctx = mp.get_context("spawn")
    control_port = None
    children = []
    try:
        if args.control:
            listener = socket.create_server(("127.0.0.1", 0))
            control_port = listener.getsockname()[1]
            children.append(ctx.Process(target=_control_server, args=(listener,), daemon=True))
            children[-1].start()
        parent, child = ctx.Pipe(duplex=False)
        children.append(ctx.Process(target=_probe_loop, args=(host, port, args.probe_path, args.probe_interval,
                                                              args.duration, child, control_port)))
        children[-1].start()
        # Only the prober holds the write end now: when it ends (its results sent, or stopped on Ctrl-C)
        # the read below returns or fails instead of blocking the executor thread, and with it the exit.
        child.close()
        loop = asyncio.get_running_loop()
        try:
            results, control_results = await loop.run_in_executor(None, parent.recv)
        except EOFError:
            raise ProberEnded("the probe process ended without sending its results (see its output above)") from None
    finally:
        # Also on Ctrl-C: no prober nor control responder is left behind.
        for process in children:
            if process.is_alive():
                process.terminate()
            process.join()
    stop.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"results": results, "control": control_results, "counts": counts}


def summarize(results: List[Tuple[int, float]]) -> Dict[str, Any]:
    """Probe count, status counts and p50/p99/max latency (ms) of ``results``."""
    latencies = sorted(seconds * 1000 for _, seconds in results)
    statuses: Dict[str, int] = {}
    for status, _ in results:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    if not latencies:
        return {"probes": 0, "statuses": statuses}
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    return {"probes": len(latencies), "statuses": statuses, "p50_ms": round(statistics.median(latencies), 1),
            "p99_ms": round(p99, 1), "max_ms": round(latencies[-1], 1)}


def _raise_open_file_limit(needed: int) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed if hard == resource.RLIM_INFINITY else min(needed, hard), hard))


def _http_url(text: str) -> str:
    """``http://HOST[:PORT]``: the streams and the probe speak plain HTTP/1.1 on raw sockets (no TLS)."""
    try:
        return server_url(text, ("http",))
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (plain HTTP, no TLS)") from None


def _url_path(text: str) -> str:
    """A request path: starts with ``/`` and holds no whitespace (it goes into the request line as is)."""
    if not text.startswith("/") or any(char.isspace() for char in text):
        raise argparse.ArgumentTypeError(f"must be a path starting with / and without spaces, got {text!r}")
    return text


def _check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: List[str]) -> None:
    """The checks that need more than one flag (one-line refusal, exit 2), before any load is opened."""
    if args.url and args.server_args:
        parser.error("--server_args configures the server that --model_dir starts; with --url there is none")
    if not args.hold and given_flags(parser, argv).get("hold_source"):
        parser.error("--hold_source is the source address of the --hold connections; with --hold 0 none is held")
    for word in shlex.split(args.server_args):
        if word.split("=", 1)[0] in _OWNED_SERVER_FLAGS:
            parser.error(f"--server_args must not set {word.split('=', 1)[0]}: this tool sets it itself")
    if args.hold:
        # --model_dir starts its server on 127.0.0.1 (ServerProcess's default host).
        check_hold_source(parser, args, _address(args.url)[0] if args.url else "127.0.0.1")


def _reach_error(host: str, port: int, source: Optional[str] = None) -> Optional[str]:
    """Why no connection to ``host:port`` (from address ``source``, if given) opens (None when one does)."""
    try:
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_SECONDS,
                                      source_address=None if source is None else (source, 0)):
            return None
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__


def measured_nothing(args: argparse.Namespace, report: Dict[str, Any]) -> Optional[str]:
    """Why a finished run measured nothing (None when it measured what it was asked to).

    A run whose streams were all refused probed an idle server, and one whose probes all failed
    timed no answer: either would otherwise print a report that looks like a measurement.
    """
    load = report["load"]
    if args.streams and not load["ok"]:
        return (f"no stream was served ({load['refused']} refused, {load['broken']} broken, "
                f"{load['connect_errors']} connect errors): the probe latency would be that of an idle server")
    if args.hold and not load["held"]:
        return f"no held connection could be opened from --hold_source {args.hold_source}"
    if report["probes"] and set(report["statuses"]) == {"0"}:
        return f"none of the {report['probes']} probes got an answer: the server stopped answering"
    return None


def build_parser() -> OneLineErrorParser:
    """The command line; every value is checked while it is parsed."""
    parser = OneLineErrorParser(prog="python -m lightllm.benchmark.health_latency", description=__doc__.split("\n", 1)[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", type=_http_url, help="a running server, http://HOST[:PORT]")
    target.add_argument("--model_dir", type=checkpoint_dir, help="start a server on this checkpoint for the measurement")
    parser.add_argument("--server_args", type=shell_words, default="",
                        help="more flags for the server --model_dir starts (one string; not --host nor --port)")
    parser.add_argument("--streams", type=non_negative_int, default=400, help="streams kept open at once")
    parser.add_argument("--hold", type=non_negative_int, default=0,
                        help="connections one client holds open (one byte each)")
    parser.add_argument("--hold_source", default=None,
                        help="source address of the held connections (another client than the streams and the probe; "
                        f"only with --hold); default {IPV4_HOLD_SOURCE} against an IPv4 server, and required against "
                        "an IPv6 one (IPv6 has no second loopback address)")
    parser.add_argument("--max_new_tokens", type=positive_int, default=256, help="tokens per stream (>= 1)")
    parser.add_argument("--duration", type=positive_float, default=60.0, help="seconds of probing (> 0)")
    parser.add_argument("--warmup", type=non_negative_float, default=10.0,
                        help="seconds between opening the load and probing (>= 0)")
    parser.add_argument("--probe_interval", type=positive_float, default=0.1, help="seconds between two probes (> 0)")
    parser.add_argument("--probe_path", type=_url_path, default="/health", help="path the probe GETs")
    parser.add_argument("--api_key", default=None, help="key the streams send")
    parser.add_argument("--control", action="store_true",
                        help="also probe a trivial responder in a process of its own after each probe: the machine's "
                        "own scheduling delay under the same load")
    return parser


def _start_server(args: argparse.Namespace, log_dir: Path) -> Tuple[Any, Optional[str]]:
    """The server ``--model_dir`` asks for, or ``(None, error line)`` when it did not start."""
    from lightllm.benchmark.server_process import ServerProcess, ServerRefusedError, ServerStartError, startup_error_line

    log_path = log_dir / "server.log"
    try:
        return ServerProcess.start(["--model_dir", args.model_dir, *shlex.split(args.server_args)], log_path), None
    except ServerStartError as exc:
        if isinstance(exc, ServerRefusedError):
            # Its one line says it all; the log would be a leftover nobody is pointed at.
            refusal = (startup_error_line(log_path.read_text(errors="replace")) or str(exc)).removeprefix("error: ")
            shutil.rmtree(log_dir, ignore_errors=True)
            return None, f"the server refused to start: {refusal}"
        # The first line names the log, which is kept for it.
        return None, str(exc).splitlines()[0].rstrip(":")


@interruptible("every server it started was stopped; nothing was measured")
def main(argv: Optional[List[str]] = None) -> int:
    """Run the measurement and print one JSON line (exit 1, one ``error:`` line, when it measured nothing)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    _check_flags(parser, args, argv)
    _raise_open_file_limit(args.streams + args.hold + 256)
    server = None
    log_dir = Path(tempfile.mkdtemp(prefix="health_latency_")) if args.model_dir else None
    if log_dir is not None:
        server, failure = _start_server(args, log_dir)
        if server is None:
            print(f"error: {failure}", file=sys.stderr)
            return 1
        url = server.base_url
    else:
        url = args.url
    host, port = _address(url)
    try:
        why = _reach_error(host, port)
        if why is not None:
            print(f"error: cannot reach the server at {url}: {why}", file=sys.stderr)
            return 1
        # Checked before the run: a source that reaches nothing used to be found out only after it.
        why = _reach_error(host, port, args.hold_source) if args.hold else None
        if why is not None:
            print(f"error: no held connection can be opened from --hold_source {args.hold_source} to {url}: {why}",
                  file=sys.stderr)
            return 1
        try:
            outcome = asyncio.run(_load(args, host, port))
        except ProberEnded as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    finally:
        if server is not None:
            server.stop()
            shutil.rmtree(log_dir, ignore_errors=True)  # a server that started leaves nothing to read
    report = {"streams": args.streams, "hold": args.hold, "duration_s": args.duration,
              **summarize(outcome["results"]), "load": outcome["counts"]}
    failure = measured_nothing(args, report)
    if failure is not None:
        print(f"error: {failure}", file=sys.stderr)
        return 1
    if args.control:
        report["control"] = summarize(outcome["control"])
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    from lightllm.benchmark.deployment import stop_servers_on_sigterm

    stop_servers_on_sigterm()
    sys.exit(main())
