"""Load and soak test of a running server: concurrent streams, abort storms, memory per round.

``python -m lightllm.benchmark.soak_server --model_dir /tmp/dm --rounds 3`` starts a server (or
``--base-url URL --server-pid PID`` targets one on loopback) and runs ``--rounds`` rounds.  Each
round sends, one phase after the other:

* ``--streams`` concurrent streaming completions, read to the end;
* an abort storm: ``--aborts`` concurrent streams whose clients disconnect after
  ``--abort-after-events`` events;
* ``--requests`` non-streaming completions, ``--concurrency`` at a time.

After each round it waits until the server is idle, lets it settle, and samples the RSS of every
server process (``/proc``) and the use of ``/dev/shm``.  The leak criterion holds when every
process's RSS after the last round is within ``--tolerance`` (default 5%) of its RSS after the
first round (the first round is the warm-up: caches, allocator pools and the prefix cache fill
there).  Results are printed and written as JSON and Markdown.  Not part of CI: it takes minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional
from urllib.parse import urlparse

import httpx

from lightllm.benchmark.cli_args import OneLineErrorParser, given_flags, non_negative_int, output_dir, output_file
from lightllm.utils.interrupts import report_interrupted
from lightllm.benchmark.output_writing import print_report, refuse_same_output, write_outputs_or_exit
from lightllm.benchmark.process_memory import leak_verdicts, read_memory, server_processes, shm_usage
from lightllm.benchmark.server_probe import NoModelListed, ServerRefused, fetch_default_model
from lightllm.utils.http_client_support import API_KEY_HELP, auth_headers, default_api_key, without_api_key
from lightllm.benchmark.soak_client import SoakClient, make_prompts
from lightllm.benchmark.soak_report import memory_info, render_markdown, round_line
from lightllm.utils.envs_utils import idle_malloc_trim_seconds
from lightllm.utils.owner_locks import SHM_DIR, SHM_LOCK_SUFFIX, shm_segment_prefix

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
SETTLE_PAST_TRIM_S = 3.0  # idle seconds a memory sample waits beyond the rank's idle heap trim
MAX_CLIENTS = 10_000  # per phase; beyond this the client, not the server, is what gets measured


def _bounded(name: str, low: int, high: int):
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{name} must be in [{low}, {high}], got {value}")
        return value

    return convert


def make_parser() -> argparse.ArgumentParser:
    """The script's argument parser."""
    parser = OneLineErrorParser(prog="python -m lightllm.benchmark.soak_server", description=__doc__.splitlines()[0])
    target = parser.add_argument_group("server")
    target.add_argument("--model_dir", default=None, help="start a server on this checkpoint (loopback, free port)")
    target.add_argument("--server-args", default="",
                        help="extra flags for the server --model_dir starts, one shell-quoted string (not with --base-url)")
    target.add_argument("--base-url", default=None, help="target a running server instead (loopback only)")
    target.add_argument("--server-pid", type=int, default=None, help="main pid of the targeted server (for RSS)")
    target.add_argument("--api-key", default=default_api_key(), help=API_KEY_HELP)
    target.add_argument("--log-dir", type=output_dir, default="soak_logs",
                        help="where the server --model_dir starts writes its log (created if missing; default "
                        "soak_logs; not with --base-url)")
    load = parser.add_argument_group("load")
    load.add_argument("--rounds", type=_bounded("--rounds", 2, 20), default=3,
                      help="rounds, 2 to 20; the first is the warm-up the others are compared with (default 3)")
    load.add_argument("--streams", type=_bounded("--streams", 0, MAX_CLIENTS), default=1000,
                      help="concurrent streaming completions per round, read to the end (default 1000)")
    load.add_argument("--aborts", type=_bounded("--aborts", 0, MAX_CLIENTS), default=200,
                      help="streams of the abort storm per round, whose clients disconnect early (default 200)")
    load.add_argument("--abort-after-events", type=_bounded("--abort-after-events", 1, 10_000), default=2,
                      help="events an abort-storm client reads before it disconnects (default 2)")
    load.add_argument("--requests", type=_bounded("--requests", 0, 100_000), default=1000,
                      help="non-streaming completions per round (default 1000)")
    load.add_argument("--concurrency", type=_bounded("--concurrency", 1, MAX_CLIENTS), default=256,
                      help="non-streaming completions in flight at once (default 256)")
    load.add_argument("--prompt-len", type=_bounded("--prompt-len", 1, 100_000), nargs=2, default=[8, 64],
                      metavar=("MIN", "MAX"), help="prompt lengths in tokens are drawn from [MIN, MAX]")
    load.add_argument("--output-len", type=_bounded("--output-len", 1, 100_000), default=8,
                      help="max_tokens of the streams and the non-streaming completions (default 8)")
    load.add_argument("--abort-output-len", type=_bounded("--abort-output-len", 1, 100_000), default=256,
                      help="max_tokens of the abort storm's streams (long, so the disconnect lands mid-stream)")
    load.add_argument("--vocab", type=_bounded("--vocab", 6, 10_000_000), default=None,
                      help="prompt ids from [5, vocab); default and upper bound: the served model's vocab_size "
                           "(config.json of --model_dir, or of the --model_dir the --server-pid process was started with)")
    load.add_argument("--seed", type=non_negative_int, default=0, help="seed of the prompts, >= 0 (default 0)")
    bounds = parser.add_argument_group("bounds and output")
    bounds.add_argument("--request-timeout-s", type=float, default=600.0, help="seconds one request may take (default 600)")
    bounds.add_argument("--idle-timeout-s", type=float, default=300.0, help="most seconds to wait for the server to go idle")
    bounds.add_argument("--settle-s", type=float, default=None,
                        help="idle seconds before each memory sample; default: 3 past the idle heap trim "
                             "(LIGHTLLM_IDLE_MALLOC_TRIM as this process sees it), so samples compare trimmed heaps")
    bounds.add_argument("--max-seconds", type=float, default=3600.0, help="stop starting new rounds after this long")
    bounds.add_argument("--tolerance", type=float, default=0.05, help="allowed RSS growth, last round vs first")
    # Checked while parsing: a soak takes minutes to lose at the end.
    bounds.add_argument("--output-json", type=output_file, default=None, help="also write the report here (JSON)")
    bounds.add_argument("--output-md", type=output_file, default=None,
                        help="also write the report here (Markdown; not the same file as --output-json)")
    return parser


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parse and cross-check arguments (exits with a one-line error on bad input)."""
    parser = make_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if (args.model_dir is None) == (args.base_url is None):
        parser.error("give exactly one of --model_dir (start a server) or --base-url (target one)")
    if args.base_url is not None:
        # Only the server --model_dir starts has flags and a log: with --base-url they would be ignored.
        for dest in ("server_args", "log_dir"):
            flag = given_flags(parser, argv).get(dest)
            if flag is not None:
                parser.error(f"{flag} only goes with --model_dir (it configures the server this tool starts; "
                             "--base-url targets a running one)")
        host = urlparse(args.base_url).hostname
        if host not in LOOPBACK_HOSTS:
            parser.error(f"--base-url must be a loopback address ({', '.join(LOOPBACK_HOSTS)}), got host {host!r}")
        if args.server_pid is None:
            parser.error("--base-url needs --server-pid: memory is read from /proc of the server's processes")
    elif args.server_pid is not None:
        parser.error("--server-pid only goes with --base-url")
    low, high = args.prompt_len
    if low > high:
        parser.error(f"--prompt-len MIN ({low}) must not exceed MAX ({high})")
    for name in ("request_timeout_s", "idle_timeout_s", "max_seconds"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.settle_s is None:
        try:
            trim_s = idle_malloc_trim_seconds()
        except ValueError as exc:
            parser.error(str(exc))
        args.settle_s = SETTLE_PAST_TRIM_S + (trim_s if trim_s != float("inf") else 0.0)
    if args.settle_s < 0 or args.tolerance < 0:
        parser.error("--settle-s and --tolerance must be >= 0")
    try:
        refuse_same_output([("--output-json", args.output_json), ("--output-md", args.output_md)])
    except ValueError as exc:
        parser.error(str(exc))
    if args.streams + args.aborts + args.requests == 0:
        parser.error("nothing to send: --streams, --aborts and --requests are all 0")
    if args.server_pid is not None and (args.server_pid < 1 or not Path(f"/proc/{args.server_pid}").exists()):
        parser.error(f"--server-pid {args.server_pid} is not a running process")
    try:
        shlex.split(args.server_args)
    except ValueError as exc:
        parser.error(f"--server-args is not a valid shell-quoted string: {exc}")
    # Checked here, not by the server it would start: that one's refusal is a start-up failure.
    if args.model_dir is not None and not Path(args.model_dir, "config.json").is_file():
        parser.error(f"--model_dir {args.model_dir!r} is not a local checkpoint directory (no config.json there)")
    return args


def server_model_dir(pid: int) -> Optional[str]:
    """The ``--model_dir`` process ``pid`` was started with (read from ``/proc``), or None."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None
    values = [b for a, b in zip(argv, argv[1:]) if a == "--model_dir"] + [
        a.split("=", 1)[1] for a in argv if a.startswith("--model_dir=")]
    return os.path.join(cwd, values[0]) if values else None


def resolve_vocab(args: argparse.Namespace) -> int:
    """``--vocab``, else the served model's vocab_size, read where the server reads it (config.json).

    A fixed default (4096 once) made every request to a smaller model fail with a 400 "outside the
    vocabulary". Raises ``ValueError`` (one line) when no size is known or ``--vocab`` exceeds it.
    """
    from lightllm.common.basemodel.model_config import ModelConfig

    model_dir = args.model_dir or server_model_dir(args.server_pid)
    try:
        if model_dir is None:
            raise ValueError(f"process {args.server_pid} (--server-pid) was not started with --model_dir")
        served = ModelConfig.from_dir(model_dir).vocab_size
    except (OSError, ValueError, KeyError, TypeError) as exc:
        if args.vocab is not None:
            return args.vocab
        raise ValueError(f"--vocab is needed: the served model's vocabulary size is unknown ({exc})") from None
    if (args.vocab or served) > served or served < 6:
        raise ValueError(f"--vocab {args.vocab or served} does not fit the served model's vocabulary ({served} ids, "
                         f"{model_dir}): prompt ids are drawn from [5, vocab)")
    return args.vocab or served


def sample_memory(root_pid: int) -> Dict[str, Dict[str, int]]:
    """Memory of every live server process, keyed by label."""
    samples = {}
    for label, pid in server_processes(root_pid):
        try:
            samples[label] = {"pid": pid, **read_memory(pid).to_dict()}
        except ProcessLookupError:
            continue
    return samples


def server_shm_usage(root_pid: int, root: str = str(SHM_DIR)) -> Dict[str, int]:
    """Bytes and number of the segments in ``root`` of the server whose launcher is ``root_pid``.

    They are named after the launcher's pid; the segments' owner lock file shares that prefix but
    is no segment (empty, and one per server), so it is not counted.
    """
    return shm_usage(root, prefix=shm_segment_prefix(root_pid), skip_suffix=SHM_LOCK_SUFFIX)


async def soak(base_url: str, root_pid: int, args: argparse.Namespace) -> Dict[str, Any]:
    """Run every round against a server; returns the report dictionary."""
    async with httpx.AsyncClient(trust_env=False, timeout=30, headers=auth_headers(args.api_key)) as probe:
        model = await fetch_default_model(probe, base_url)
    client = SoakClient(base_url, model, args)
    rng = random.Random(args.seed)
    low, high = args.prompt_len
    report: Dict[str, Any] = {"start": {"memory": sample_memory(root_pid), "shm": server_shm_usage(root_pid)},
                              "rounds": []}
    began = time.monotonic()
    try:
        for index in range(args.rounds):
            if time.monotonic() - began > args.max_seconds:
                report["stopped_early"] = f"--max-seconds {args.max_seconds} passed before round {index + 1}"
                break
            phases = {}
            for kind, count in (("streams", args.streams), ("aborts", args.aborts), ("requests", args.requests)):
                if count:
                    phases[kind] = (await client.run_phase(kind, make_prompts(count, low, high, args.vocab, rng))).__dict__
            idle = await client.wait_idle()
            await asyncio.sleep(args.settle_s)
            entry = {"round": index + 1, "phases": phases, "went_idle": idle,
                     "memory": sample_memory(root_pid), "shm": server_shm_usage(root_pid), "shm_all": shm_usage()}
            report["rounds"].append(entry)
            print(round_line(entry), flush=True)
    finally:
        await client.close()
    rss_rounds = [{label: m["rss_kib"] for label, m in r["memory"].items()} for r in report["rounds"]]
    if len(rss_rounds) >= 2:
        verdicts = leak_verdicts(rss_rounds, args.tolerance)
        report["verdicts"] = [v.__dict__ for v in verdicts]
        report["criterion_holds"] = all(v.holds for v in verdicts)
    else:
        report["verdicts"], report["criterion_holds"] = [], False
    report["errors"] = sum(p["errors"] for r in report["rounds"] for p in r["phases"].values())
    return report


def _raise_fd_limit() -> None:
    # Every concurrent stream holds a socket; the default soft limit (often 1024) is too low.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main(argv: Optional[List[str]] = None) -> int:
    """CLI entry point; exit code 0 when the leak criterion holds and no request failed (130 on Ctrl-C)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        # The server this tool started, if any, was stopped as the interrupt unwound (finally below).
        return report_interrupted("every server it started was stopped; no report was written")


def _main(argv: Optional[List[str]]) -> int:
    args = parse_args(argv)
    try:
        args.vocab = resolve_vocab(args)  # before a server starts: minutes to lose otherwise
    except ValueError as exc:
        make_parser().error(str(exc))
    _raise_fd_limit()
    from lightllm.benchmark.run_environment import git_info, machine_info

    server = None
    if args.model_dir is not None:
        from lightllm.benchmark.server_process import ServerProcess, ServerStartError

        server_args = ["--model_dir", args.model_dir, *shlex.split(args.server_args)]
        try:
            server = ServerProcess.start(server_args, Path(args.log_dir) / "soak_server.log")
        except ServerStartError as exc:
            # Its first line has the server's own refusal or names the log; nothing is left running.
            print(f"error: {str(exc).splitlines()[0].rstrip(':')}", file=sys.stderr)
            return 1
        base_url, root_pid = server.base_url, server.pid
    else:
        base_url, root_pid = args.base_url.rstrip("/"), args.server_pid
    try:
        report = asyncio.run(soak(base_url, root_pid, args))
        report["server_alive_after"] = server.is_alive() if server else True
    except httpx.TransportError as exc:
        # The server cannot be reached (or went away): one line, as for every refusal.
        print(f"error: cannot reach the server at {base_url}: {exc or type(exc).__name__}", file=sys.stderr)
        return 1
    except (ServerRefused, NoModelListed) as exc:  # /v1/models, asked for the model to soak (a 401 without --api-key)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.stop()
    if server is not None:
        report["shm_left_after_stop"] = server_shm_usage(root_pid)
        # Not a segment, but left behind all the same when the stop did not finish its cleanup.
        report["shm_owner_lock_left_after_stop"] = any(
            SHM_DIR.glob(f"{shm_segment_prefix(root_pid)}*{SHM_LOCK_SUFFIX}"))
    typed = without_api_key(argv if argv is not None else sys.argv[1:])
    report["command"] = "python -m lightllm.benchmark.soak_server " + " ".join(shlex.quote(a) for a in typed)
    # The key itself stays out of the report files.
    report["args"] = {**vars(args), "api_key": "<given>" if args.api_key else None}
    report["machine"] = {**machine_info(), **memory_info()}
    report["git"] = git_info()
    markdown = render_markdown(report)
    # The report first: a file that cannot be written is then one line naming its flag and path.
    print_report(markdown)
    write_outputs_or_exit(make_parser(), [("--output-json", args.output_json, json.dumps(report, indent=2)),
                                          ("--output-md", args.output_md, markdown)])
    return 0 if report["criterion_holds"] and report["errors"] == 0 else 1


if __name__ == "__main__":
    from lightllm.benchmark.deployment import stop_servers_on_sigterm

    stop_servers_on_sigterm()
    sys.exit(main())
