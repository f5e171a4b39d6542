"""Our server and vLLM's CPU build side by side: same checkpoint, same client, one run.

``python -m lightllm.benchmark.side_by_side --model_dir DIR --cases 64x128x64,8x1024x8
--engines ours,vllm_every_core,ours [--peer_dir /tmp/peer] [--out FILE.json]`` starts each engine
in turn (one at a time: they share the machine's cores), warms it up, runs every case with
``vllm bench serve`` (random dataset, all prompts at once, greedy, ``--ignore-eos``), stops it,
and prints output tok/s, TTFT p50 and TPOT p50 per engine and case, with ours / vLLM ratios.
Engines: ``ours`` (``lightllm.server.api_server``, default flags plus ``--server_args``),
``vllm_default`` (vLLM as users start it: one core reserved for its front end) and
``vllm_every_core`` (``VLLM_CPU_NUM_OF_RESERVED_CPU=0``).  vLLM is started and stopped with the
peer scripts (``../shared/peer/serve_vllm.sh``); its virtual environment gives the client.
``--ports FIRST-LAST`` takes each engine's HTTP port (and the ``--nccl_port`` of ours with
``--tp`` above 1) from that range instead of any free port; vLLM's internal ports stay its own.

Why every case has its own seed: the random dataset builds prompt ``i`` as a run of the
vocabulary starting at a seeded offset, and with a fixed input length the offsets are the
generator's first draws.  Two cases run with the same seed therefore send prompts that start
with the same tokens, so a later case hits the prefix cache its predecessor filled (in both
engines: vLLM's CPU build caches prefixes by default too) and measures cached prefills, not
the case it names.  Each case here uses seed ``--seed + its index``; the warm-up uses a seed
no case uses.

Whatever would fail only after an engine started is refused in one line first
(:mod:`lightllm.benchmark.side_by_side_checks`).  A failure after a start is one ``error:`` line
(exit 1) naming a log in the run's working directory, which is kept then (removed after a run
that succeeded).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from lightllm.benchmark.cli_args import OneLineErrorParser, argument_type, non_negative_int, output_file, shell_words
from lightllm.benchmark.deployment import stop_servers_on_sigterm
from lightllm.benchmark.port_range import PortRange, confined_port_flags, ports_of_model_process
from lightllm.benchmark.server_process import ServerProcess
from lightllm.benchmark.side_by_side_cases import ENGINES, WARMUP_SEED_OFFSET, Case, parse_cases, parse_engines
from lightllm.benchmark.side_by_side_checks import (
    check_cases_fit,
    check_client_lengths,
    check_peer_runs,
    check_seeds,
    check_server_args,
    exit_description,
)
from lightllm.benchmark.special_tokens import tokenizer_special_tokens
from lightllm.utils.free_ports import free_port

METRICS = ("duration", "output_throughput", "median_ttft_ms", "median_tpot_ms", "total_input_tokens", "completed")
_REPO_ROOT = Path(__file__).resolve().parents[2]
# A traceback's exception line (pydantic_core.ValidationError: ...) or a tool's "error: ..." line.
_ERROR_LINE = re.compile(r"^([\w.]*(Error|Exception)\b|error:)")


def _error_line(text: str) -> str:
    """The last error line of ``text`` (a traceback's exception line; else its last line), for a one-line error."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if _ERROR_LINE.match(line)]
    return (errors or lines or ["(no output)"])[-1]


def client_command(vllm_bin: Path, base_url: str, model_dir: str, case: Case, seed: int, result_dir: Path,
                   result_name: str) -> List[str]:
    """The ``vllm bench serve`` line of one case (the same for every engine)."""
    return [
        str(vllm_bin), "bench", "serve", "--backend", "openai", "--base-url", base_url, "--model", model_dir,
        "--tokenizer", model_dir, "--dataset-name", "random", "--random-input-len", str(case.input_len),
        "--random-output-len", str(case.output_len), "--num-prompts", str(case.prompts), "--ignore-eos",
        "--temperature", "0", "--seed", str(seed), "--request-rate", "inf", "--save-result",
        "--result-dir", str(result_dir), "--result-filename", result_name,
        *(["--random-prefix-len", str(case.prefix_len)] if case.prefix_len else []),
    ]


def read_client_result(path: Path, case: Case) -> Dict[str, float]:
    """The metrics of one ``--save-result`` file; raises if the client did not finish every prompt."""
    data = json.loads(path.read_text())
    missing = [m for m in METRICS if m not in data]
    if missing:
        raise RuntimeError(f"{path}: the client's result has no {missing}")
    if data["completed"] != case.prompts:
        raise RuntimeError(f"{path}: {data['completed']} of {case.prompts} prompts completed")
    return {m: float(data[m]) for m in METRICS}


class EngineServer:
    """One engine's server for the length of a ``with`` block.

    ``ports``: the range its ports come from (default: any free port).
    """

    def __init__(self, engine: str, model_dir: str, peer_dir: Path, scripts_dir: Path, server_args: Sequence[str],
                 log_dir: Path, ports: Optional[PortRange] = None) -> None:
        self.engine, self.model_dir, self.peer_dir, self.scripts_dir = engine, model_dir, peer_dir, scripts_dir
        self.server_args, self.log_dir = list(server_args), log_dir
        self.port = free_port() if ports is None else ports.take("127.0.0.1", what=engine)
        if ports is not None and engine == "ours":
            self.server_args += confined_port_flags(ports, "127.0.0.1", self.server_args, what=engine)
        self._ours: Optional[ServerProcess] = None

    @property
    def base_url(self) -> str:
        """The engine's URL on the loopback port picked for it."""
        return f"http://127.0.0.1:{self.port}"

    def _peer_env(self) -> Dict[str, str]:
        env = dict(os.environ, PEER=str(self.peer_dir))
        if self.engine == "vllm_every_core":
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        else:
            env.pop("VLLM_CPU_NUM_OF_RESERVED_CPU", None)
        return env

    def __enter__(self) -> "EngineServer":
        if self.engine == "ours":
            try:
                self._ours = ServerProcess.start(
                    ["--model_dir", self.model_dir, "--model_name", self.model_dir, *self.server_args],
                    self.log_dir / f"ours_{self.port}.log", port=self.port,
                )
            except RuntimeError as error:  # the server was stopped; the message's first line names its log
                raise RuntimeError(f"ours exited with no server ready: {str(error).splitlines()[0]}") from None
            return self
        # serve_vllm.sh returns once vLLM answers /health, or fails with its log's tail.
        started = subprocess.run(
            ["bash", str(self.scripts_dir / "serve_vllm.sh"), self.model_dir, str(self.port), "float32"],
            env=self._peer_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        if started.returncode != 0:
            self.__exit__()
            log = self.log_dir / f"{self.engine}_{self.port}_start.log"
            log.write_text(started.stdout)
            raise RuntimeError(f"vLLM did not start: {_error_line(started.stdout)} (log {log})")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.engine == "ours":
            if self._ours is not None:
                self._ours.stop()
            return
        subprocess.run(["bash", str(self.scripts_dir / "stop_vllm.sh"), str(self.port)], env=self._peer_env(),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run_engine(server: EngineServer, cases: Sequence[Case], seed: int, vllm_bin: Path, result_dir: Path,
               run_index: int) -> Dict[str, Dict[str, float]]:
    """Warm up, then every case once; metrics per case label."""
    warmup = Case(8, 64, 16)
    _run_client(client_command(vllm_bin, server.base_url, server.model_dir, warmup, seed + WARMUP_SEED_OFFSET,
                               result_dir, f"warmup_{run_index}.json"), result_dir / f"warmup_{run_index}.log",
                f"{server.engine} warm-up")
    results = {}
    for index, case in enumerate(cases):
        name = f"run{run_index}_{server.engine}_{case.label}.json"
        _run_client(client_command(vllm_bin, server.base_url, server.model_dir, case, seed + index, result_dir, name),
                    result_dir / f"run{run_index}_{server.engine}_{case.label}.log", f"{server.engine} {case.label}")
        results[case.label] = read_client_result(result_dir / name, case)
        print(f"{server.engine} {case.label}: {results[case.label]}", file=sys.stderr, flush=True)
    return results


def _run_client(command: List[str], log: Path, what: str) -> None:
    """Run the client with its output in ``log``; ``RuntimeError`` with its last line and the log's path."""
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log.write_text(done.stdout)
    if done.returncode != 0:
        said = _error_line(done.stdout) if done.stdout.strip() else f"it {exit_description(done.returncode)}"
        raise RuntimeError(f"client failed on {what}: {said} (log {log})")


def markdown_table(cases: Sequence[Case], runs: Sequence[Dict[str, object]]) -> str:
    """Output tok/s, TTFT p50, TPOT p50 per run, and each run of ours over each vLLM run."""
    head = "| case | run | engine | output tok/s | TTFT p50 (ms) | TPOT p50 (ms) | ours / this |"
    lines = [head, "| --- | --- | --- | ---: | ---: | ---: | --- |"]
    for case in cases:
        ours = [r["results"][case.label]["output_throughput"] for r in runs if r["engine"] == "ours"]
        for number, run in enumerate(runs, 1):
            m = run["results"][case.label]
            ratio = ""
            if run["engine"] != "ours" and ours:
                ratio = ", ".join(f"{o / m['output_throughput']:.2f}x" for o in ours)
            lines.append(
                f"| {case.label} | {number} | {run['engine']} | {m['output_throughput']:.1f} | "
                f"{m['median_ttft_ms']:.0f} | {m['median_tpot_ms']:.1f} | {ratio} |"
            )
    return "\n".join(lines)


def build_parser() -> OneLineErrorParser:
    """The command-line flags."""
    parser = OneLineErrorParser(prog="python -m lightllm.benchmark.side_by_side", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_dir", required=True, help="checkpoint directory both engines serve")
    parser.add_argument("--cases", required=True, help="comma-separated PROMPTSxINPUTxOUTPUT, e.g. 64x128x64,8x1024x8; "
                        "PROMPTSxPREFIX+INPUTxOUTPUT gives every prompt the same PREFIX tokens first (64x1024+128x64); "
                        "PREFIX + INPUT + OUTPUT must fit the context of every engine")
    parser.add_argument("--engines", default="ours,vllm_every_core,vllm_default,ours",
                        help=f"run order, names from {', '.join(ENGINES)} (repeats allowed)")
    parser.add_argument("--seed", type=non_negative_int, default=0,
                        help=f"case i uses seed + i, the warm-up seed + {WARMUP_SEED_OFFSET} (at most 2**32 - 1)")
    parser.add_argument("--peer_dir", default=os.path.join(tempfile.gettempdir(), "peer"),
                        help="where setup_vllm_cpu.sh put vLLM's virtual environment")
    parser.add_argument("--peer_scripts", default=str(_REPO_ROOT.parent / "shared" / "peer"),
                        help="directory of serve_vllm.sh and stop_vllm.sh")
    parser.add_argument("--server_args", type=shell_words, default="",
                        help="extra flags for our server, one shell-quoted string (not the --model_dir, --model_name, "
                        "--host, --port or --run_mode side_by_side sets)")
    parser.add_argument("--out", type=output_file, default=None, help="also write every run's metrics here (JSON)")
    parser.add_argument("--ports", type=argument_type(PortRange.parse), default=None, metavar="FIRST-LAST",
                        help="take each engine's HTTP port (and ours' --nccl_port with --tp above 1) from this range, "
                        "each checked free first (default: any free port)")
    return parser


def _check_run(args: argparse.Namespace, model_dir: str) -> Tuple[List[Case], List[str]]:
    """The cases and engines of the run; ``ValueError`` (one line) for anything it would fail on after a start."""
    cases, engines = parse_cases(args.cases), parse_engines(args.engines)
    server_args = shlex.split(args.server_args)
    check_seeds(args.seed, cases)
    check_server_args(server_args)
    if args.ports is not None:
        # Every engine run gets ports of its own, also a second run of the same engine.
        ours = ports_of_model_process(server_args)
        args.ports.check_room(sum(ours if engine == "ours" else 1 for engine in engines),
                              f"--engines {','.join(engines)}")
    if not Path(model_dir, "config.json").is_file():
        raise ValueError(f"--model_dir {args.model_dir}: no config.json there")
    check_cases_fit(model_dir, cases, engines, server_args)
    try:
        special_tokens = tokenizer_special_tokens(model_dir)
    except ValueError:  # our server refuses such a checkpoint itself, in one line, at its start
        special_tokens = None
    if special_tokens is not None:
        check_client_lengths(cases, special_tokens)
    return cases, engines


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point: 0 once every engine ran every case, 1 when one failed, 2 for a refused flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    model_dir = str(Path(args.model_dir).resolve())
    try:
        cases, engines = _check_run(args, model_dir)
    except ValueError as error:
        parser.error(str(error))
    vllm_bin = Path(args.peer_dir) / "venv-vllm" / "bin" / "vllm"
    if not vllm_bin.is_file():
        parser.error(f"{vllm_bin} not found: run shared/peer/setup_vllm_cpu.sh first (the client is vLLM's)")
    try:
        check_peer_runs(vllm_bin)
    except ValueError as error:
        parser.error(str(error))
    scripts = Path(args.peer_scripts)
    if any(e != "ours" for e in engines) and not (scripts / "serve_vllm.sh").is_file():
        parser.error(f"--peer_scripts {scripts}: no serve_vllm.sh there")
    # Said only once every flag passed, so a refusal stays the one line on stderr.
    if args.ports is not None and args.ports.ephemeral_overlap_warning():
        print(args.ports.ephemeral_overlap_warning(), file=sys.stderr)
    runs: List[Dict[str, object]] = []
    # Removed only after a run that succeeded: a failure's message names a log in it.
    work_dir = Path(tempfile.mkdtemp(prefix="side_by_side_"))
    failed = False
    try:
        for index, engine in enumerate(engines):
            started = time.strftime("%H:%M:%S")
            try:
                with EngineServer(engine, model_dir, Path(args.peer_dir), scripts, shlex.split(args.server_args),
                                  work_dir, args.ports) as server:
                    results = run_engine(server, cases, args.seed, vllm_bin, work_dir, index)
            except RuntimeError as error:  # every engine is stopped by now
                failed = True
                print(f"error: {engine}: {error}; the run's logs are kept in {work_dir}", file=sys.stderr)
                return 1
            runs.append({"engine": engine, "started": started, "results": results})
    finally:
        if not failed:
            shutil.rmtree(work_dir, ignore_errors=True)
    print(markdown_table(cases, runs))
    if args.out:
        Path(args.out).write_text(json.dumps({"model_dir": model_dir, "seed": args.seed, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    stop_servers_on_sigterm()
    sys.exit(main())
