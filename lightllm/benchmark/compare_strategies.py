"""Compare prefill-queue strategies side by side on the same machine, workload and flags.

Usage::

    python -m lightllm.benchmark.compare_strategies --model_dir DIR --workload long_first \\
        --long-count 16 --long-len 2048 --short-count 16 --short-len 64 --output-len 32 \\
        --strategies default,promote_shortest,hrrn --repeats 3 --warmup 1 \\
        --server-args "--chunked_prefill_size 256 --batch_max_tokens 256" --out-dir bench_results/run1

How a run is laid out (and why):

* One server per strategy is started once (the start-ups overlap; they are never
  measured), with identical flags apart from ``--prefill_queue_strategy``, and all
  stay up for the whole run. Only one is measured
  at a time; the others sit idle (their model ranks poll every few tens of ms), which
  costs far less than restarting every server for every visit and keeps a start-up
  (imports, allocation, first forward) out of every measurement. Running them
  concurrently under load would make them disturb each other, so they never do.
* Because all servers are up at once, their KV capacity must not be sized from free
  memory (the first server would take most of it): unless ``--server-args`` sets
  ``--max_total_token_num``, the runner adds ``--max_total_token_num <--kv-tokens>``.
* Each server gets ``--warmup`` full unmeasured passes of each workload first, with
  prompts from a separate namespace so they never warm the prefix cache for the
  measured prompts.
* Repeat ``r`` visits the strategies in the list rotated left by ``r``; with a number
  of repeats that is a multiple of the number of strategies every strategy holds every
  position equally often, so drift and position effects hit all of them alike.
* Within a repeat every strategy gets exactly the same schedule and prompts (workload
  seed ``--seed + r``, prompt namespace per repeat), and no two repeats share prompts,
  so prefix caching never helps across repeats.
* Each strategy is compared to the baseline of the *same repeat* (paired log ratios,
  see :mod:`lightllm.benchmark.paired_stats`).
* ``--topology 1p1d`` replaces each server by a PD cluster (:mod:`lightllm.benchmark.pd_cluster`):
  a master with ``--master-args``, a prefill node with the strategy, ``--server-args`` and
  ``--prefill-args``, and a decode node with ``--server-args`` and ``--decode-args``. On a PD
  topology ``--server-args`` must hold flags both node roles accept (the master never gets them);
  a flag only one role reads (``--prefill_max_overtake_tokens``, ``--pd_max_segment_tokens``)
  goes in that role's option; a node given a flag its role refuses exits at once with the
  server's one-line error, which ends the run (exit status 1) with a hint where the flag goes.
  The workload goes to the master, and everything else is the same. The logs are
  ``logs/server_<strategy>_{master,prefill,decode}.log``.

A workload with a request longer than the servers' context (the checkpoint's, or a smaller
``--max_req_total_len`` given to them) is refused in one line before any server starts: the servers
would answer such a request with HTTP 400, or cut its output (then the run would measure other
lengths than it reports).  So is a prompt the checkpoint's tokenizer cannot build
(:mod:`lightllm.benchmark.prompt_room`), which would otherwise end the run after its servers
started.  ``--ports FIRST-LAST`` confines every port the run gives its processes to that range
(see :mod:`lightllm.benchmark.port_range`).

A server that stops running mid-run ends the run with one ``error:`` line and exit status 1 after
every server is stopped; the report is still written from the repeats every strategy completed
(when there is one), marked as stopped early.  Ctrl-C or SIGTERM stops every server, also those
still starting.

Outputs in ``--out-dir``: ``report.json``, ``report.md``, ``ttft_cdf_<workload>.png``,
``throughput_<workload>.png``, ``runs/<workload>/<strategy>/repeat<r>.{jsonl,json}``
(raw per-request records and the run summary) and ``logs/server_<strategy>.log``.  Without
matplotlib the two PNGs are not written (one line says so before any server starts, and the
report says so); everything else is.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import signal
import sys
from pathlib import Path
from typing import Any, Sequence

from lightllm.benchmark.count_flags import positive_int
from lightllm.benchmark.bench_serving import PROMPT_FLAG_WORKLOADS
from lightllm.benchmark.serving_run import PROMPT_FORMATS, load_tokenizer
from lightllm.benchmark.cli_args import (
    OneLineErrorParser,
    argument_type,
    checkpoint_dir,
    finite_float,
    given_flags,
    listen_host,
    with_flag_names,
)
from lightllm.benchmark.comparison_options import (
    DEFAULT_KV_TOKENS,
    DEFAULT_STRATEGIES,
    MAX_SETTLE_S,
    ComparisonOptions,
    check_out_dir,
)
from lightllm.benchmark.comparison_runner import ComparisonRunner, ServerLostError, run_comparison
from lightllm.benchmark.port_range import PortRange
from lightllm.benchmark.prompt_room import check_prompt_room
from lightllm.benchmark.prompts import PromptBuilder
from lightllm.benchmark.report_writer import plots_unavailable, render_markdown
from lightllm.benchmark.topologies import TOPOLOGIES, make_topology
from lightllm.benchmark.workload_context import check_workloads_fit, servers_context
from lightllm.benchmark.workloads import FIELD_HELP, WORKLOADS, WorkloadConfig, workloads_using
from lightllm.benchmark.deployment import stop_servers_on_sigterm
from lightllm.benchmark.server_process import ServerRefusedError, ServerStartError

# The options and the runner live in their own modules; they stay importable from here, the
# module callers and docs have always named.
__all__ = [
    "DEFAULT_KV_TOKENS",
    "DEFAULT_STRATEGIES",
    "ComparisonOptions",
    "ComparisonRunner",
    "build_parser",
    "main",
    "options_from_args",
    "run_comparison",
    "topology_kwargs",
]

# CLI spellings of WorkloadConfig fields where they differ from "--" + field with dashes
# (kept identical to bench_serving's flags).
_FLAG_NAMES = {"duration_s": "--duration"}
_WORKLOAD_FIELDS = [f for f in dataclasses.fields(WorkloadConfig) if f.name not in ("name", "seed")]


def build_parser() -> argparse.ArgumentParser:
    """Command-line interface of ``python -m lightllm.benchmark.compare_strategies``."""
    p = OneLineErrorParser(prog="python -m lightllm.benchmark.compare_strategies", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_dir", required=True, type=checkpoint_dir, help="local checkpoint directory (also the tokenizer)")
    p.add_argument(
        "--workload", required=True,
        help=f"workload name(s), comma-separated, from {sorted(WORKLOADS)}; the flags below apply to all",
    )
    p.add_argument("--strategies", default=DEFAULT_STRATEGIES, help="comma-separated strategy names (default %(default)s)")
    p.add_argument("--baseline", default="default", help="strategy the others are compared with (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="measured repeats (rotated order; default %(default)s)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured full passes per strategy and workload (default %(default)s)")
    p.add_argument(
        "--server-args", default="",
        help="flags given to every server, as one shell-quoted string (use --server-args=--flag for a lone flag); "
        "on a PD topology to every prefill and decode node (not the master), so only flags both roles accept",
    )
    p.add_argument("--kv-tokens", type=int, default=DEFAULT_KV_TOKENS,
                   help="--max_total_token_num added to every server unless --server-args sets it (default %(default)s)")
    p.add_argument(
        "--topology", choices=sorted(TOPOLOGIES), default="normal",
        help="normal: one server per strategy; 1p1d: one PD cluster per strategy (master with --master-args + "
        "prefill node with the strategy, --server-args and --prefill-args + decode node with --server-args and "
        "--decode-args), measured through the master; 2p1d, 1p2d, 2p2d: the same with x prefill and y decode nodes",
    )
    p.add_argument("--master-args", default="",
                   help="PD topologies: flags of the PD master, as one shell-quoted string "
                   "(e.g. '--pd_prefill_timeout_seconds 60')")
    p.add_argument("--prefill-args", default="",
                   help="PD topologies: flags of every prefill node only, after --server-args, as one shell-quoted "
                   "string (e.g. '--prefill_max_overtake_tokens 64')")
    p.add_argument("--decode-args", default="",
                   help="PD topologies: flags of every decode node only, after --server-args, as one shell-quoted "
                   "string (e.g. '--pd_max_segment_tokens 64')")
    p.add_argument("--prefill-devices", default=None, help="PD topologies on GPUs: CUDA_VISIBLE_DEVICES of the prefill nodes")
    p.add_argument("--decode-devices", default=None, help="PD topologies on GPUs: CUDA_VISIBLE_DEVICES of the decode nodes")
    # Checked by binding a port there, as each launch will: before any prompt is built or server started.
    p.add_argument("--host", type=listen_host, default="127.0.0.1",
                   help="address the servers listen on: an IPv4 address or host name of this machine (default 127.0.0.1)")
    p.add_argument("--ports", type=argument_type(PortRange.parse), default=None, metavar="FIRST-LAST",
                   help="take every port the run gives its processes from this range (each checked free first): "
                   "every server's or PD master's and node's HTTP port, each prefill node's --pd_transfer_port "
                   "block and, with --tp above 1, each model process's --nccl_port (default: any free port, and "
                   "the servers pick their other ports themselves)")
    # finite_float: inf or nan would pass the range checks and wait forever, or not at all.
    p.add_argument("--start-timeout", type=finite_float, default=300.0,
                   help="seconds a server may take to become healthy (default %(default)g)")
    p.add_argument("--out-dir", required=True,
                   help="directory of the report, the raw runs and the server logs (created if missing)")
    p.add_argument("--seed", type=int, default=0, help="repeat r uses workload seed SEED + r (default %(default)s)")
    p.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="text",
                   help="text: prompts are sent as text; ids: as token ids (default text)")
    p.add_argument("--max-concurrency", type=positive_int, default=None,
                   help="most requests in flight at once (default: no limit, requests go at their scheduled times)")
    p.add_argument("--request-timeout", type=finite_float, default=3600.0,
                   help="seconds one request may take (default 3600)")
    # Still parsed, so a command line written for the former bootstrap interval is told why the flag
    # is gone instead of getting argparse's bare "unrecognized arguments".
    p.add_argument("--bootstrap-resamples", default=None, metavar="N",
                   help="no longer used: the intervals are Student-t intervals, which draw no resamples; "
                   "refused with that reason")
    p.add_argument("--confidence", type=float, default=0.95,
                   help="confidence level of the paired Student-t intervals on the per-repeat log ratios, a "
                   "fraction in (0, 1) (default 0.95)")
    p.add_argument("--sequential-start", action="store_true",
                   help="start the servers one after another instead of together (start-up is never measured)")
    p.add_argument("--settle", type=finite_float, default=1.0,
                   help=f"seconds to pause after each run, 0 to {MAX_SETTLE_S:g} (default 1)")
    p.add_argument("--progress", action="store_true", help="show a progress bar per run")
    load = p.add_argument_group("workload (same flags as bench_serving)")
    for field in _WORKLOAD_FIELDS:
        flag = _FLAG_NAMES.get(field.name, "--" + field.name.replace("_", "-"))
        kind = type(field.default) if field.default is not None else int
        default = "" if field.default is None else f" (default {field.default:g})"
        load.add_argument(flag, dest=field.name, type=kind, default=field.default, help=FIELD_HELP[field.name] + default)
    sharing = ", ".join(PROMPT_FLAG_WORKLOADS["shared_prefix_len"])
    load.add_argument("--shared-prefix-len", type=int, default=0,
                      help=f"tokens every prompt starts with, the same for every prompt of one pass (each warm-up and repeat has its own; default 0); only for --workload "
                      f"{sharing} (shared_prefix shares prefixes its own way)")
    return p


def options_from_args(args: argparse.Namespace, argv: Sequence[str]) -> ComparisonOptions:
    """Translate parsed CLI arguments into :class:`ComparisonOptions`."""
    if args.bootstrap_resamples is not None:
        raise ValueError("--bootstrap-resamples no longer applies: the intervals are paired Student-t intervals "
                         "on the per-repeat log ratios, which draw no resamples; drop the flag")
    knobs = {f.name: getattr(args, f.name) for f in _WORKLOAD_FIELDS}
    names = [n.strip() for n in args.workload.split(",") if n.strip()]
    for name in names:
        if name not in WORKLOADS:
            raise ValueError(f"workload must be one of {sorted(WORKLOADS)}, got {name!r}")
    try:
        server_args = shlex.split(args.server_args)
    except ValueError as exc:
        raise ValueError(f"server_args is not a valid shell-quoted string: {exc}") from None
    return ComparisonOptions(
        model_dir=args.model_dir,
        workloads=[WorkloadConfig(name=n, seed=args.seed, **knobs) for n in names],
        out_dir=args.out_dir,
        strategies=[s.strip() for s in args.strategies.split(",") if s.strip()],
        baseline=args.baseline,
        repeats=args.repeats,
        warmup=args.warmup,
        server_args=server_args,
        seed=args.seed,
        kv_tokens=args.kv_tokens,
        prompt_format=args.prompt_format,
        shared_prefix_len=args.shared_prefix_len,
        max_concurrency=args.max_concurrency,
        request_timeout_s=args.request_timeout,
        confidence=args.confidence,
        settle_s=args.settle,
        parallel_start=not args.sequential_start,
        show_progress=args.progress,
        command=shlex.join([sys.executable, "-m", "lightllm.benchmark.compare_strategies", *argv]),
    )


# ComparisonOptions (and PD topology) fields whose flag is not their dashed name; a PD topology
# calls the spec's flags (--server-args) extra_args.
_FIELD_FLAGS = {"workloads": "--workload", "settle_s": "--settle", "request_timeout_s": "--request-timeout",
                "start_timeout_s": "--start-timeout", "extra_args": "--server-args"}
_PD_ONLY_FLAGS = {"master_args": "--master-args", "prefill_args": "--prefill-args", "decode_args": "--decode-args",
                  "prefill_devices": "--prefill-devices", "decode_devices": "--decode-devices"}
# The PD options holding server flags (an empty one is the default, not a choice).
_PD_FLAG_STRINGS = ("master_args", "prefill_args", "decode_args")


def topology_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Constructor arguments of ``args.topology``; the PD flags are refused for the normal topology."""
    kwargs: dict[str, Any] = {"host": args.host, "start_timeout_s": args.start_timeout}
    if args.ports is not None:
        kwargs["ports"] = args.ports
    # An empty device list is a choice (hide every GPU); an empty flag string is the default.
    given = [flag for name, flag in _PD_ONLY_FLAGS.items()
             if getattr(args, name) is not None and (name not in _PD_FLAG_STRINGS or getattr(args, name))]
    if args.topology == "normal":
        if given:
            raise ValueError(f"{', '.join(given)} only apply with a PD topology (1p1d, 2p1d, 1p2d, 2p2d), "
                             f"got --topology {args.topology}")
        return kwargs
    flags: dict[str, list[str]] = {}
    for name in _PD_FLAG_STRINGS:
        try:
            flags[name] = shlex.split(getattr(args, name))
        except ValueError as exc:
            raise ValueError(f"{name} is not a valid shell-quoted string: {exc}") from None
    for name in ("prefill_args", "decode_args"):
        # The runner gives every node --kv-tokens unless --server-args sets the capacity; a role's
        # own value would be a second value of the same flag on that node.
        if any(arg.split("=", 1)[0] == "--max_total_token_num" for arg in flags[name]):
            raise ValueError(f"{name} must not set --max_total_token_num: give it in server_args, which reach "
                             "every node (without it the runner gives every node kv_tokens)")
    return {**kwargs, **flags, "prefill_devices": args.prefill_devices, "decode_devices": args.decode_devices}


def check_kv_tokens_hold_a_request(options: ComparisonOptions, processes: dict[str, dict[str, tuple[str, ...]]]) -> None:
    """Refuse a ``--kv-tokens`` the servers would refuse at start (fewer than one request's context),
    when the runner gives it (``--server-args`` without ``--max_total_token_num``)."""
    if len(options.effective_server_args()) == len(options.server_args):
        return  # --server-args sets the capacity; the servers check it against their context
    limit = servers_context(options.model_dir, processes)
    if limit is not None and options.kv_tokens < limit.tokens:
        raise ValueError(f"--kv-tokens {options.kv_tokens} is fewer than {limit.name} of {limit.tokens} "
                         f"({limit.source}): the servers refuse a KV cache that cannot hold one request")


def check_workload_flags_apply(workloads: Sequence[str], given: dict[str, str]) -> None:
    """Refuse a typed workload flag that none of ``workloads`` reads (every run would ignore it).

    ``given`` maps the typed flags' fields to the flags (:func:`~lightllm.benchmark.cli_args.given_flags`);
    a flag some of the listed workloads read is fine (the flags apply to all of them).
    """
    for field, flag in given.items():
        if field in PROMPT_FLAG_WORKLOADS:
            users = PROMPT_FLAG_WORKLOADS[field]
        elif field in FIELD_HELP:
            users = workloads_using(field)
        else:
            continue
        if not set(workloads) & set(users):
            raise ValueError(f"{flag} does not apply to --workload {','.join(workloads)} (it applies to "
                             f"{', '.join(users)})")


# How a PD process words a refusal of a flag that belongs to another role (args_check; the
# master's pd_master.check_master_flags says the flag does "nothing on --run_mode pd_master").
_ROLE_REFUSALS = ("node never prefills", "node never decodes", "nodes only", "master only",
                  "configures the public API", "configure the public API", "nothing on --run_mode pd_master")


def _pd_refusal_hint(topology: str, exc: Exception) -> str:
    """Where flags go on a PD topology, after a process refused a flag of another role (the node
    names what it refused, not this tool's options); nothing after any other refusal."""
    if topology == "normal" or not isinstance(exc, ServerRefusedError):
        return ""
    if not any(wording in str(exc) for wording in _ROLE_REFUSALS):
        return ""
    return (f" (--topology {topology}: --server-args reach every prefill and decode node; give a flag only one role "
            "takes in --prefill-args or --decode-args, and the master's in --master-args)")


def _prompt_builder(model_dir: str) -> PromptBuilder | None:
    """The run's prompt builder, loaded before any server starts so that a prompt it cannot build
    is refused first; None when the checkpoint's tokenizer does not load (the run then fails
    loading it as before, before any server starts)."""
    try:
        return PromptBuilder(load_tokenizer(model_dir))
    except (ValueError, OSError):
        return None


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns 1 if any measured request failed or a server failed, else 0."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        options = options_from_args(args, argv)
        check_workload_flags_apply([cfg.name for cfg in options.workloads], given_flags(parser, argv))
        options.validate()
        topology = make_topology(args.topology, **topology_kwargs(args))
        specs = options.server_specs()
        for spec in specs:
            topology.check_spec(spec)
        check_workloads_fit(options.model_dir, options.workloads, range(options.seed, options.seed + options.repeats),
                            topology.process_flags(specs[0]))
        check_kv_tokens_hold_a_request(options, topology.process_flags(specs[0]))
        if args.ports is not None:
            strategies = f"{len(specs)} strateg{'y' if len(specs) == 1 else 'ies'}"
            args.ports.check_room(sum(topology.ports_needed(spec) for spec in specs),
                                  f"--topology {args.topology} with {strategies}")
        builder = _prompt_builder(options.model_dir)
        if builder is not None:
            for cfg in options.workloads:
                check_prompt_room(cfg, range(options.seed, options.seed + options.repeats),
                                  builder.num_special_tokens, options.shared_prefix_of(cfg))
        check_out_dir(options.out_dir)  # last: it creates the directory
    except ValueError as exc:
        # The options name their fields (model_dir, settle_s); the user typed flags.
        parser.error(with_flag_names(parser, str(exc), _FIELD_FLAGS))
    if args.ports is not None and args.ports.ephemeral_overlap_warning():
        print(args.ports.ephemeral_overlap_warning(), file=sys.stderr)
    no_plots = plots_unavailable()
    if no_plots:
        # Said before the servers start, so whoever needs the PNGs can stop now, not after the run.
        print(f"note: the PNG plots will not be written: {no_plots}; report.json and report.md will be",
              file=sys.stderr)
    try:
        report = run_comparison(options, topology, builder)
    except (ServerStartError, ServerLostError) as exc:
        # Every server is stopped by now; a ServerLostError's message says whether a report of
        # the completed repeats was written.
        print(f"error: {exc}{_pd_refusal_hint(args.topology, exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Ctrl-C is a request, not a fault: one line (every server is stopped by now), the
        # conventional 128 + SIGINT exit code, and no traceback.
        print("error: interrupted; every server it started was stopped", file=sys.stderr)
        return 128 + signal.SIGINT
    print(render_markdown(report))
    print(f"report written to {Path(options.out_dir).resolve()}")
    failed = sum(n for section in report["workloads"].values() for n in section["failed"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    stop_servers_on_sigterm()
    sys.exit(main())
