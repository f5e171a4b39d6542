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
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from lightllm.benchmark.cli_args import OneLineErrorParser, argument_type, output_file, shell_words
from lightllm.benchmark.deployment import stop_servers_on_sigterm
from lightllm.benchmark.port_range import PortRange, confined_port_flags, ports_of_model_process
from lightllm.benchmark.server_process import ServerProcess
from lightllm.utils.free_ports import free_port

ENGINES = ("ours", "vllm_default", "vllm_every_core")
METRICS = ("duration", "output_throughput", "median_ttft_ms", "median_tpot_ms", "total_input_tokens", "completed")
WARMUP_SEED_OFFSET = 1000  # far from every case's seed, so the warm-up's prompts share no prefix
_REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Case:
    """``prompts`` requests of ``input_len`` tokens, each generating ``output_len`` tokens.

    With ``prefix_len`` every prompt starts with the same ``prefix_len`` tokens (the client's
    ``--random-prefix-len``: a few-shot or system prompt) before its own ``input_len``.
    """

    prompts: int
    input_len: int
    output_len: int
    prefix_len: int = 0

    @property
    def label(self) -> str:
        shared = f"{self.prefix_len}+" if self.prefix_len else ""
        return f"{self.prompts}x{shared}{self.input_len}x{self.output_len}"


def parse_cases(text: str) -> List[Case]:
    """``"64x128x64,64x1024+128x64"`` -> cases (``PREFIX+INPUT``: a shared prefix); ``ValueError`` naming a bad item."""
    cases = []
    for item in text.split(","):
        parts = item.strip().split("x")
        lengths = parts[1].split("+") if len(parts) == 3 else []
        numbers = [parts[0], *lengths, parts[2]] if len(parts) == 3 and len(lengths) <= 2 else []
        if not numbers or not all(p.isdigit() and int(p) > 0 for p in numbers):
            raise ValueError(f"case {item!r} is not PROMPTSxINPUTxOUTPUT (or PROMPTSxPREFIX+INPUTxOUTPUT, a shared "
                             "prefix) with positive integers (e.g. 64x128x64, 64x1024+128x64)")
        prefix = int(lengths[0]) if len(lengths) == 2 else 0
        cases.append(Case(int(parts[0]), int(lengths[-1]), int(parts[2]), prefix))
    if not cases:
        raise ValueError("--cases needs at least one case")
    return cases


def parse_engines(text: str) -> List[str]:
    """Comma-separated engine names, in run order; repeats allowed (a second run of ours)."""
    engines = [e.strip() for e in text.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown or not engines:
        raise ValueError(f"--engines must list names from {', '.join(ENGINES)}; got {text!r}")
    return engines


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
            except RuntimeError as error:  # the server was stopped; the message has its log's tail
                raise RuntimeError(f"ours exited with no server ready: {error}") from None
            return self
        # serve_vllm.sh returns once vLLM answers /health, or fails with its log's tail.
        started = subprocess.run(
            ["bash", str(self.scripts_dir / "serve_vllm.sh"), self.model_dir, str(self.port), "float32"],
            env=self._peer_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        if started.returncode != 0:
            self.__exit__()
            raise RuntimeError(f"{self.engine} did not start: {started.stdout.strip()[-1500:]}")
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
    subprocess.run(client_command(vllm_bin, server.base_url, server.model_dir, warmup, seed + WARMUP_SEED_OFFSET,
                                  result_dir, f"warmup_{run_index}.json"), check=True, capture_output=True)
    results = {}
    for index, case in enumerate(cases):
        name = f"run{run_index}_{server.engine}_{case.label}.json"
        done = subprocess.run(client_command(vllm_bin, server.base_url, server.model_dir, case, seed + index,
                                             result_dir, name), capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"client failed on {server.engine} {case.label}: {done.stderr[-2000:]}")
        results[case.label] = read_client_result(result_dir / name, case)
        print(f"{server.engine} {case.label}: {results[case.label]}", file=sys.stderr, flush=True)
    return results


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


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = OneLineErrorParser(prog="python -m lightllm.benchmark.side_by_side", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_dir", required=True, help="checkpoint directory both engines serve")
    parser.add_argument("--cases", required=True, help="comma-separated PROMPTSxINPUTxOUTPUT, e.g. 64x128x64,8x1024x8; "
                        "PROMPTSxPREFIX+INPUTxOUTPUT gives every prompt the same PREFIX tokens first (64x1024+128x64)")
    parser.add_argument("--engines", default="ours,vllm_every_core,vllm_default,ours",
                        help=f"run order, names from {', '.join(ENGINES)} (repeats allowed)")
    parser.add_argument("--seed", type=int, default=0, help="case i uses seed + i")
    parser.add_argument("--peer_dir", default=os.path.join(tempfile.gettempdir(), "peer"),
                        help="where setup_vllm_cpu.sh put vLLM's virtual environment")
    parser.add_argument("--peer_scripts", default=str(_REPO_ROOT.parent / "shared" / "peer"),
                        help="directory of serve_vllm.sh and stop_vllm.sh")
    parser.add_argument("--server_args", type=shell_words, default="", help="extra flags for our server, one shell-quoted string")
    parser.add_argument("--out", type=output_file, default=None, help="also write every run's metrics here (JSON)")
    parser.add_argument("--ports", type=argument_type(PortRange.parse), default=None, metavar="FIRST-LAST",
                        help="take each engine's HTTP port (and ours' --nccl_port with --tp above 1) from this range, "
                        "each checked free first (default: any free port)")
    args = parser.parse_args(argv)
    try:
        cases, engines = parse_cases(args.cases), parse_engines(args.engines)
        if args.ports is not None:
            # Every engine run gets ports of its own, also a second run of the same engine.
            ours = ports_of_model_process(shlex.split(args.server_args))
            args.ports.check_room(sum(ours if engine == "ours" else 1 for engine in engines),
                                  f"--engines {','.join(engines)}")
    except ValueError as error:
        parser.error(str(error))
    if args.ports is not None and args.ports.ephemeral_overlap_warning():
        print(args.ports.ephemeral_overlap_warning(), file=sys.stderr)
    model_dir = str(Path(args.model_dir).resolve())
    if not Path(model_dir, "config.json").is_file():
        parser.error(f"--model_dir {args.model_dir}: no config.json there")
    vllm_bin = Path(args.peer_dir) / "venv-vllm" / "bin" / "vllm"
    if not vllm_bin.is_file():
        parser.error(f"{vllm_bin} not found: run shared/peer/setup_vllm_cpu.sh first (the client is vLLM's)")
    scripts = Path(args.peer_scripts)
    if any(e != "ours" for e in engines) and not (scripts / "serve_vllm.sh").is_file():
        parser.error(f"--peer_scripts {scripts}: no serve_vllm.sh there")
    runs: List[Dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="side_by_side_") as work:
        work_dir = Path(work)
        for index, engine in enumerate(engines):
            started = time.strftime("%H:%M:%S")
            try:
                with EngineServer(engine, model_dir, Path(args.peer_dir), scripts, shlex.split(args.server_args),
                                  work_dir, args.ports) as server:
                    results = run_engine(server, cases, args.seed, vllm_bin, work_dir, index)
            except (RuntimeError, subprocess.CalledProcessError) as error:
                print(f"side_by_side: {engine}: {error}", file=sys.stderr)
                return 1
            runs.append({"engine": engine, "started": started, "results": results})
    print(markdown_table(cases, runs))
    if args.out:
        Path(args.out).write_text(json.dumps({"model_dir": model_dir, "seed": args.seed, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    stop_servers_on_sigterm()
    sys.exit(main())
