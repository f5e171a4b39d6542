"""Footprint of each server process: memory, whether it maps libtorch, start-up and import cost.

``python -m lightllm.benchmark.process_footprint --model_dir DIR [--out FILE.json] [--repeats N]``

It starts one tp=1 ``python -m lightllm.server.api_server`` on a free loopback port, times the
launch until ``/health/ready`` answers 200, then reads ``/proc`` for every process of the tree
(RSS, anon, whether ``libtorch*.so`` is mapped, when it started, CPU spent so far) and stops the
server.  Afterwards, with the server gone so the timings do not compete with it, it imports each
process's entry module in a fresh interpreter (median of ``--repeats``) and records whether that
import alone pulls in torch.  A markdown table goes to stdout and next to the JSON (``.md``).

The numbers exist to compare the server before and after a restructuring, so everything that
names code lives in :data:`ENTRY_MODULES` and the script reports which ``lightllm`` it measured.
Children are started with the ``spawn`` method, which re-imports the launcher's main module
(``lightllm.server.api_server``) in every child before the child's own module, so a child's
start-up cost is at least that of the ``main`` row.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import httpx

from lightllm.benchmark.cli_args import (OneLineErrorParser, argument_type, checkpoint_dir, missing_module,
                                         output_file_in_new_dirs, positive_float, shell_words)
from lightllm.benchmark.footprint_report import READY_PATH, markdown_report
from lightllm.benchmark.port_range import PortRange, PortsExhaustedError, confined_port_flags, ports_of_model_process
from lightllm.benchmark.process_snapshot import read_text_quietly, snapshot
from lightllm.benchmark.server_process import startup_error_line
from lightllm.utils.free_ports import free_port

# Process label (as lightllm.benchmark.process_memory labels it, trailing rank digits removed)
# -> the module that process runs.
# ``http`` and ``pd_master`` are not separate processes of a tp=1 normal server (the HTTP app
# runs in ``main``; the PD master is another run mode) but their import cost is still measured.
ENTRY_MODULES: Dict[str, str] = {
    "main": "lightllm.server.api_server",
    "http": "lightllm.server.http.app",
    "detokenization": "lightllm.server.detokenization.manager",
    "router": "lightllm.server.router.manager",
    "model_rank": "lightllm.server.model_rank.rank_assembly",
    "pd_master": "lightllm.server.launch.pd_master",
}

# Flags launch_and_measure gives the server; --server_args setting them again would be ambiguous.
OWNED_SERVER_FLAGS = ("--model_dir", "--host", "--port")
# Small enough for a 2-core CPU box: the KV pool is sized by this, and it is what the integration
# tests start with.
DEFAULT_SERVER_ARGS = "--max_total_token_num 4096"
_IMPORT_SNIPPET = (
    "import importlib, json, sys, time\n"
    "t0 = time.perf_counter()\n"
    "importlib.import_module({module!r})\n"
    "dt = time.perf_counter() - t0\n"
    "import lightllm\n"
    "print(json.dumps({{'import_s': dt, 'loads_torch': 'torch' in sys.modules, "
    "'modules_loaded': len(sys.modules), 'lightllm_path': lightllm.__file__}}))\n"
)


def entry_module_for(label: str, table: Dict[str, str] = ENTRY_MODULES) -> Optional[str]:
    """The entry module of a process label; ``model_rank3`` uses the ``model_rank`` entry."""
    if label in table:
        return table[label]
    return table.get(label.rstrip("0123456789"))


class FootprintStartError(RuntimeError):
    """A launch that never became ready; ``refused`` when the server printed its one-line refusal.

    The message is one line: the refusal itself (the log then adds nothing), or the exit code
    or timeout with the log to read.
    """

    def __init__(self, message: str, refused: bool) -> None:
        super().__init__(message)
        self.refused = refused


def _start_failure(proc: subprocess.Popen, log_path: Path) -> FootprintStartError:
    refusal = startup_error_line(read_text_quietly(log_path))
    if refusal is not None:
        refusal = refusal.removeprefix("error: ")
        return FootprintStartError(f"the server refused to start (exit code {proc.returncode}): {refusal}", True)
    return FootprintStartError(f"the server exited with code {proc.returncode} during start-up (log {log_path})", False)


def _stop(proc: subprocess.Popen, timeout_s: float = 60.0) -> float:
    """SIGTERM the launcher and wait; kill its session if it hangs. Returns the seconds it took."""
    t0 = time.monotonic()
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            # start_new_session made the session id the launcher's pid: only its processes die.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(10)
    return time.monotonic() - t0


def launch_and_measure(
    model_dir: str, server_args: Sequence[str], log_path: Path, timeout_s: float = 300.0,
    ports: Optional[PortRange] = None,
) -> Dict[str, Any]:
    """Start one server, time it to ``/health/ready`` == 200, snapshot its processes, stop it.

    ``ports``: the range its HTTP port (and a TP rendezvous port) come from; None: any free port.

    Raises:
        FootprintStartError: the server exited or stayed unready (it is stopped by then).
        PortsExhaustedError: ``ports`` has no free port left.
    """
    own_ports: List[str] = []
    if ports is None:
        port = free_port()
    else:
        port = ports.take("127.0.0.1")
        own_ports = confined_port_flags(ports, "127.0.0.1", server_args)
    command = [sys.executable, "-m", "lightllm.server.api_server", "--model_dir", model_dir,
               "--host", "127.0.0.1", "--port", str(port), *server_args, *own_ports]
    url = f"http://127.0.0.1:{port}{READY_PATH}"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log_file:
        t0 = time.monotonic()
        proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    try:
        ready_s = None
        # trust_env=False: a proxy from the environment must not intercept loopback probes.
        with httpx.Client(trust_env=False, timeout=2.0) as client:
            while time.monotonic() - t0 < timeout_s:
                if proc.poll() is not None:
                    raise _start_failure(proc, log_path)
                try:
                    if client.get(url).status_code == 200:
                        ready_s = time.monotonic() - t0
                        break
                except httpx.HTTPError:
                    pass
                # A short poll: the interval bounds the error of time-to-ready.
                time.sleep(0.05)
        if ready_s is None:
            raise FootprintStartError(f"no 200 from {READY_PATH} within {timeout_s:.0f}s (log {log_path})", False)
        processes = snapshot(proc.pid, ENTRY_MODULES)
    finally:
        stop_s = _stop(proc)
    return {
        "command": command,
        "log": str(log_path),
        "time_to_ready_s": ready_s,
        "stop_s": stop_s,
        "exit_code": proc.returncode,
        "processes": [asdict(p) for p in processes],
    }


def measure_import(module: str, repeats: int) -> Dict[str, Any]:
    """Cold import of ``module`` in ``repeats`` fresh interpreters (medians; error text if it fails)."""
    runs = []
    for _ in range(repeats):
        t0 = time.monotonic()
        done = subprocess.run([sys.executable, "-c", _IMPORT_SNIPPET.format(module=module)],
                              capture_output=True, text=True, env=os.environ.copy())
        wall_s = time.monotonic() - t0
        if done.returncode != 0:
            # A module that moved is a finding, not a reason to lose the other rows.
            last_line = done.stderr.strip().splitlines()[-1:]
            return {"module": module, "error": last_line or [f"exit code {done.returncode}"]}
        run = json.loads(done.stdout.strip().splitlines()[-1])
        run["wall_s"] = wall_s
        runs.append(run)
    return {
        "module": module,
        "import_s": statistics.median(r["import_s"] for r in runs),
        "wall_s": statistics.median(r["wall_s"] for r in runs),
        "loads_torch": runs[-1]["loads_torch"],
        "modules_loaded": runs[-1]["modules_loaded"],
        "lightllm_path": runs[-1]["lightllm_path"],
        "runs": runs,
    }


def parse_entry_overrides(items: Sequence[str]) -> Dict[str, str]:
    """``["router=pkg.mod", ...]`` -> ``{"router": "pkg.mod"}``; raises ValueError on a malformed item."""
    result = {}
    for item in items:
        label, sep, module = item.partition("=")
        if not sep or not label.strip() or not module.strip():
            raise ValueError(f"--entry wants LABEL=MODULE, got {item!r}")
        result[label.strip()] = module.strip()
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point."""
    parser = OneLineErrorParser(prog="python -m lightllm.benchmark.process_footprint", description=__doc__.splitlines()[0])
    parser.add_argument("--model_dir", required=True, type=checkpoint_dir, help="local checkpoint directory to serve")
    parser.add_argument("--out", type=output_file_in_new_dirs,
                        help="JSON result file (missing directories are created); the markdown goes next to it as .md")
    parser.add_argument("--repeats", type=int, default=3, help="fresh interpreters per import timing")
    parser.add_argument("--launches", type=int, default=1, help="server launches (time to ready per launch)")
    parser.add_argument("--server_args", type=shell_words, default=DEFAULT_SERVER_ARGS,
                        help="extra api_server flags, one shell-quoted string")
    parser.add_argument("--timeout_s", type=positive_float, default=300.0, help="start-up limit per launch, seconds")
    parser.add_argument("--skip_imports", action="store_true", help="measure the server only, not the import costs")
    parser.add_argument("--entry", action="append", default=[], metavar="LABEL=MODULE",
                        help="override or add an ENTRY_MODULES item for this run (repeatable)")
    parser.add_argument("--ports", type=argument_type(PortRange.parse), default=None, metavar="FIRST-LAST",
                        help="take every launch's HTTP port (and --nccl_port at --tp above 1) from this range, "
                        "each launch new ones; default: any free port")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.launches < 1:
        parser.error("--repeats and --launches must be >= 1")
    try:
        overrides = parse_entry_overrides(args.entry)
    except ValueError as exc:
        parser.error(str(exc))
    for word in shlex.split(args.server_args):
        if word.split("=", 1)[0] in OWNED_SERVER_FLAGS:
            parser.error(f"--server_args must not set {word.split('=', 1)[0]}: this tool sets it itself")
    if args.ports is not None:
        try:
            args.ports.check_room(args.launches * ports_of_model_process(shlex.split(args.server_args)),
                                  f"--launches {args.launches}")
        except ValueError as exc:
            parser.error(str(exc))
        if args.ports.ephemeral_overlap_warning():
            print(args.ports.ephemeral_overlap_warning(), file=sys.stderr)
    # Before any launch: a typo would cost one and show up only as an error cell of the import table.
    for why in filter(None, (missing_module(module) for module in overrides.values())):
        parser.error(f"--entry: {why}")
    # Rows of the process table look their module up in ENTRY_MODULES, so the override goes there.
    ENTRY_MODULES.update(overrides)
    import lightllm

    # The point is to measure a particular tree (a frozen baseline vs. the working one).
    print(f"lightllm imported from {lightllm.__file__}", flush=True)
    log_dir = Path(tempfile.mkdtemp(prefix="footprint_"))
    result: Dict[str, Any] = {
        "lightllm_path": lightllm.__file__,
        "python": sys.executable,
        "model_dir": args.model_dir,
        "server_args": shlex.split(args.server_args),
        "repeats": args.repeats,
        "entry_modules": dict(ENTRY_MODULES),
        "launches": [],
        "imports": [],
    }
    for i in range(args.launches):
        log_path = log_dir / f"server_{i}.log"
        try:
            launch = launch_and_measure(args.model_dir, result["server_args"], log_path, args.timeout_s, args.ports)
        except PortsExhaustedError as exc:
            if i == 0:
                shutil.rmtree(log_dir, ignore_errors=True)  # no launch wrote a log
                print(f"error: launch {i + 1}: {exc}", file=sys.stderr)
            else:
                print(f"error: launch {i + 1}: {exc} (earlier launches' logs in {log_dir})", file=sys.stderr)
            return 1
        except FootprintStartError as exc:
            if exc.refused:  # the line says it all: no log directory is left behind unnamed
                shutil.rmtree(log_dir, ignore_errors=True)
            print(f"error: launch {i + 1}: {exc}", file=sys.stderr)
            return 1
        print(f"launch {i + 1}: ready after {launch['time_to_ready_s']:.2f} s", flush=True)
        result["launches"].append(launch)
    result["time_to_ready_s"] = statistics.median(l["time_to_ready_s"] for l in result["launches"])
    if not args.skip_imports:
        for label, module in ENTRY_MODULES.items():
            item = measure_import(module, args.repeats)
            result["imports"].append({"label": label, **item})
            print(f"import {module}: {item.get('import_s', 'error')}", flush=True)
    report = markdown_report(result)
    print(report)
    print(f"server logs in {log_dir}")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        out.with_suffix(".md").write_text(report)
        print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
