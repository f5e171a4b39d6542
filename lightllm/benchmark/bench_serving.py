"""Open-loop serving benchmark: send a scheduled workload over HTTP and measure it.

Usage::

    python -m lightllm.benchmark.bench_serving --base-url http://127.0.0.1:8000 \\
        --backend openai-completions --tokenizer /path/to/model --workload long_first

The same workload (schedule, prompt lengths and prompt texts are all seeded) can be
sent to any OpenAI-compatible server, so engines and scheduling policies are compared
on identical input. :func:`~lightllm.benchmark.serving_run.run_benchmark` (in
:mod:`lightllm.benchmark.serving_run`) is the reusable async core.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from typing import Any, Sequence

import httpx

from lightllm.benchmark.backends import BACKENDS
from lightllm.benchmark.cli_args import (OneLineErrorParser, finite_float, given_flags, http_url, non_negative_int,
                                         output_file, positive_float, with_flag_names)
from lightllm.benchmark.count_flags import positive_int
from lightllm.utils.interrupts import report_interrupted
from lightllm.benchmark.metrics import RequestRecord, format_summary, parse_slo, records_jsonl
from lightllm.benchmark.output_writing import print_report, refuse_same_output, write_output, write_outputs_or_exit
from lightllm.benchmark.prompt_room import check_prompt_room
from lightllm.benchmark.prompts import PromptBuilder
from lightllm.benchmark.serving_run import (PROMPT_FORMATS, BenchmarkConfig, check_tokenizer_dir, count_unreported_output,
                                             load_tokenizer, run_benchmark)
from lightllm.benchmark.server_probe import NoModelListed, ServerRefused, UnknownModel, check_reachable, served_context
from lightllm.benchmark.workload_context import check_workloads_within
from lightllm.benchmark.workloads import FIELD_HELP, WORKLOADS, WorkloadConfig, build_workload, workloads_using
from lightllm.utils.http_client_support import API_KEY_HELP, default_api_key

# Flags whose name is not the dashed field name of BenchmarkConfig or WorkloadConfig, for the
# one-line refusals (the configs name their fields).
_FIELD_FLAGS = {"request_timeout_s": "--request-timeout"}
# Prompt flags that only some workloads can use: shared_prefix builds its own shared prefixes.
PROMPT_FLAG_WORKLOADS: dict[str, tuple[str, ...]] = {"shared_prefix_len": ("interleaved", "long_first", "sustained")}


def build_parser() -> argparse.ArgumentParser:
    """Command-line interface of ``python -m lightllm.benchmark.bench_serving``."""
    defaults = WorkloadConfig()
    p = OneLineErrorParser(prog="python -m lightllm.benchmark.bench_serving", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    server = p.add_argument_group("server")
    server.add_argument("--base-url", type=http_url, default=BenchmarkConfig.base_url,
                        help=f"server to measure, checked to answer before the tokenizer loads "
                        f"(default {BenchmarkConfig.base_url})")
    apis = ", ".join(f"{name} ({cls.path})" for name, cls in sorted(BACKENDS.items()))
    server.add_argument("--backend", choices=sorted(BACKENDS), default=BenchmarkConfig.backend,
                        help=f"API the requests use: {apis} (default {BenchmarkConfig.backend})")
    server.add_argument("--model", default=None,
                        help="model name in the requests (default: the first id from GET /v1/models); a name "
                        "the server does not list is refused when it lists several models")
    server.add_argument("--api-key", default=default_api_key(), help=API_KEY_HELP)
    server.add_argument("--tokenizer", required=True, help="local directory of the served model's tokenizer")
    server.add_argument("--no-ignore-eos", action="store_true", help="do not ask the server to ignore EOS")
    server.add_argument("--extra-body", default="{}",
                        help="JSON object merged into every request body (the parameters, for --backend lightllm); "
                        "not the fields the benchmark sets itself (max_tokens, model, ignore_eos, stream, the prompt) "
                        "nor n or best_of (one generation per request is measured)")
    server.add_argument("--request-timeout", type=positive_float, default=BenchmarkConfig.request_timeout_s,
                        help=f"seconds one request may take (default {BenchmarkConfig.request_timeout_s:g})")
    load = p.add_argument_group("workload (a flag the chosen --workload does not use is refused)")
    load.add_argument("--workload", choices=sorted(WORKLOADS), default=defaults.name,
                      help=f"{FIELD_HELP['name']} (default {defaults.name}); a flag below that names workloads "
                      "applies to those only")
    load.add_argument("--seed", type=int, default=defaults.seed,
                      help=f"{FIELD_HELP['seed']} (default {defaults.seed})")
    for field in dataclasses.fields(WorkloadConfig):
        if field.name in ("name", "seed"):
            continue
        flag = "--duration" if field.name == "duration_s" else "--" + field.name.replace("_", "-")
        kind = finite_float if isinstance(field.default, float) else int
        default = "" if field.default is None else f" (default {field.default:g})"
        load.add_argument(flag, dest=field.name, type=kind, default=field.default,
                          help=FIELD_HELP[field.name] + default)
    load.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="text",
                      help="text: prompts are sent as text; ids: as token ids (openai-completions only) (default text)")
    load.add_argument("--shared-prefix-len", type=int, default=0,
                      help="tokens every prompt starts with, the same for every prompt of one pass (each warm-up and repeat has its own; default 0); not with --workload "
                      "shared_prefix, which shares prefixes its own way")
    load.add_argument("--max-concurrency", type=positive_int, default=None,
                      help="most requests in flight at once (default: no limit, every request goes at its time)")
    out = p.add_argument_group("measurement and output")
    out.add_argument("--slo", nargs="+", default=[], metavar="KEY:MS",
                     help="latency limits that enable goodput, e.g. ttft:500 tpot:50 (keys ttft, tpot, e2e, each once)")
    out.add_argument("--warmup-runs", type=non_negative_int, default=0,
                     help="full unmeasured runs with their own prompts first (default 0)")
    # Checked while parsing: a run that cannot write its results loses them at the end.
    out.add_argument("--output-jsonl", type=output_file, default=None,
                     help="write the raw per-request records here (after the summary is printed; on Ctrl-C, those of "
                     "the requests that finished)")
    out.add_argument("--output-json", type=output_file, default=None,
                     help="write the summary here (JSON; not the same file as --output-jsonl)")
    out.add_argument("--no-progress", action="store_true", help="do not show a progress bar of the requests")
    return p


def check_flags_apply(workload: str, given: dict[str, str]) -> None:
    """Refuse a typed workload or prompt flag that ``workload`` does not use (it would be ignored).

    ``given`` maps the typed flags' fields to the flags (:func:`~lightllm.benchmark.cli_args.given_flags`).

    Raises:
        ValueError: naming the first such flag and the workloads that use it.
    """
    for field, flag in given.items():
        # Only the workload knobs (FIELD_HELP's keys) and the prompt flags above depend on the workload.
        users = PROMPT_FLAG_WORKLOADS.get(field) or (workloads_using(field) if field in FIELD_HELP else WORKLOADS)
        if workload not in users:
            raise ValueError(f"{flag} does not apply to --workload {workload} (it applies to {', '.join(users)})")
    # Every workload has both classes, so the per-class lengths together leave no request to --output-len.
    if {"output_len", "long_output_len", "short_output_len"} <= given.keys():
        raise ValueError(f"{given['output_len']} does not apply when {given['long_output_len']} and "
                         f"{given['short_output_len']} are both given (each request has its class's length)")


def config_from_args(args: argparse.Namespace) -> BenchmarkConfig:
    """Translate parsed CLI arguments into a :class:`BenchmarkConfig`."""
    try:
        extra_body = json.loads(args.extra_body)
    except json.JSONDecodeError as exc:
        raise ValueError(f"extra_body must be a JSON object: {exc}") from None
    if not isinstance(extra_body, dict):
        raise ValueError(f"extra_body must be a JSON object, got {args.extra_body!r}")
    workload_fields = {f.name for f in dataclasses.fields(WorkloadConfig)} - {"name"}
    workload = WorkloadConfig(name=args.workload, **{k: getattr(args, k) for k in workload_fields})
    return BenchmarkConfig(
        base_url=args.base_url,
        backend=args.backend,
        model=args.model,
        tokenizer=args.tokenizer,
        workload=workload,
        prompt_format=args.prompt_format,
        shared_prefix_len=args.shared_prefix_len,
        max_concurrency=args.max_concurrency,
        slo=parse_slo(args.slo),
        ignore_eos=not args.no_ignore_eos,
        extra_body=extra_body,
        request_timeout_s=args.request_timeout,
        output_jsonl=args.output_jsonl,
        show_progress=not args.no_progress,
        api_key=args.api_key or None,
    )


async def _run_cli(config: BenchmarkConfig, warmup_runs: int, builder: PromptBuilder,
                   finished: list[RequestRecord]) -> dict[str, Any]:
    for k in range(warmup_runs):
        warmup = dataclasses.replace(config, prompt_namespace=f"warmup-{k}", output_jsonl=None)
        await run_benchmark(warmup, builder)
    return await run_benchmark(config, builder, finished=finished, write_records=False)


@dataclasses.dataclass
class _CliRun:
    """What a Ctrl-C finds of a command-line run: the measured requests that finished so far."""

    output_jsonl: str | None = None
    builder: PromptBuilder | None = None
    measuring: bool = False
    finished: list[RequestRecord] = dataclasses.field(default_factory=list)

    def interrupted(self) -> int:
        """Write the finished records to ``--output-jsonl`` (or say why not) in one
        ``error: interrupted; ...`` line; 130."""
        if not self.measuring:
            return report_interrupted("nothing was measured" + (", --output-jsonl was not written"
                                                                if self.output_jsonl else ""))
        if not self.output_jsonl:
            return report_interrupted(f"{len(self.finished)} measured requests had finished; nothing was written")
        if not self.finished:
            return report_interrupted(f"no measured request had finished; --output-jsonl {self.output_jsonl!r} "
                                      "was not written")
        records = sorted(self.finished, key=lambda record: record.index)
        if self.builder is not None:
            count_unreported_output(records, self.builder)
        try:
            write_output("--output-jsonl", self.output_jsonl, records_jsonl(records))
        except ValueError as exc:
            return report_interrupted(str(exc))
        return report_interrupted(f"the records of the {len(records)} measured requests that finished were written "
                                  f"to --output-jsonl {self.output_jsonl!r}")


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the process exit status (1 if any request failed, 130 on Ctrl-C)."""
    run = _CliRun()
    try:
        return _main(argv, run)
    except KeyboardInterrupt:
        return run.interrupted()


def _main(argv: Sequence[str] | None, run: _CliRun) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_flags_apply(args.workload, given_flags(parser, argv))
        for name in ("output_len", "long_output_len", "short_output_len"):
            value = getattr(args, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        refuse_same_output([("--output-jsonl", args.output_jsonl), ("--output-json", args.output_json)])
        config = config_from_args(args)
        config.validate()
        build_workload(config.workload)  # every workload value checked before anything is sent
        check_tokenizer_dir(config.tokenizer)
    except ValueError as exc:
        parser.error(with_flag_names(parser, str(exc), _FIELD_FLAGS))
    probe_timeout_s = min(config.request_timeout_s, 10.0)
    why = check_reachable(config.base_url, probe_timeout_s, config.api_key)
    if why is not None:
        print(f"error: cannot reach the server at {config.base_url} (--base-url): {why}", file=sys.stderr)
        return 1
    try:
        # A backend that sends no model name (native /generate_stream) is served the first model.
        named = config.model if BACKENDS[config.backend].needs_model else None
        limit = served_context(config.base_url, named, probe_timeout_s, config.api_key)
    except ServerRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except UnknownModel as exc:
        # A flag the server cannot serve, said before the tokenizer loads: a usage error.
        parser.error(with_flag_names(parser, str(exc), _FIELD_FLAGS))
    try:
        if limit is not None:
            check_workloads_within(limit, [config.workload], [config.workload.seed], servers="the server")
    except ValueError as exc:
        parser.error(with_flag_names(parser, str(exc), _FIELD_FLAGS))
    try:
        builder = PromptBuilder(load_tokenizer(config.tokenizer))
    except (ValueError, OSError) as exc:
        parser.error(f"--tokenizer {config.tokenizer!r} holds no tokenizer that loads: {exc}")
    try:
        check_prompt_room(config.workload, [config.workload.seed], builder.num_special_tokens,
                          config.shared_prefix_len)
    except ValueError as exc:
        parser.error(with_flag_names(parser, str(exc), _FIELD_FLAGS))
    run.output_jsonl, run.builder, run.measuring = args.output_jsonl, builder, True
    try:
        summary = asyncio.run(_run_cli(config, args.warmup_runs, builder, run.finished))
    except (ServerRefused, NoModelListed) as exc:  # /v1/models, asked for the default model
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except httpx.HTTPError as exc:
        why = (str(exc).splitlines() or [type(exc).__name__])[0]
        print(f"error: cannot reach the server at {config.base_url}: {why}", file=sys.stderr)
        return 1
    # The summary first: a file that cannot be written (a full disk) must not take the run's
    # result with it; the first such file is then one line naming its flag and path (exit 2).
    print_report(format_summary(summary))
    write_outputs_or_exit(parser, [("--output-jsonl", args.output_jsonl, records_jsonl(sorted(run.finished, key=lambda r: r.index))),
                                   ("--output-json", args.output_json,
                                    json.dumps(summary, indent=2, ensure_ascii=False))])
    return 1 if summary["overall"]["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
