"""The one argument parser of the server: flags, defaults and help text live only here.

Docs (docs/*/server_args.md) are generated from this parser by ``python -m
lightllm.server.api_cli --markdown``; the start-up code validates combinations with
:func:`validate_args` so impossible settings end in a one-line error.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def _strategy_names() -> List[str]:
    # Imported lazily so `--help` works even while optional parts fail to import.
    from lightllm.server.router.model_infer.mode_backend.prefill_queue_strategy import available_strategy_names

    return available_strategy_names()


def make_argument_parser() -> argparse.ArgumentParser:
    """Build the server's argument parser."""
    parser = argparse.ArgumentParser(
        prog="python -m lightllm.server.api_server",
        description="Serve a local Hugging Face checkpoint over an OpenAI-compatible and a native HTTP API.",
    )
    group = parser.add_argument_group("deployment")
    group.add_argument(
        "--run_mode",
        type=str,
        choices=["normal"],
        default="normal",
        help="normal: one server runs prefill and decode (the PD-disaggregated roles are not in this build yet).",
    )
    group.add_argument("--host", type=str, default="127.0.0.1", help="HTTP listen address.")
    group.add_argument("--port", type=int, default=8000, help="HTTP listen port.")
    group.add_argument("--model_dir", type=str, default=None, help="Local Hugging Face checkpoint directory.")
    group.add_argument("--model_name", type=str, default=None, help="Model id the API reports; default: the directory name.")
    group.add_argument(
        "--tokenizer_mode",
        type=str,
        choices=["fast", "slow", "auto"],
        default="fast",
        help="Tokenizer implementation: fast (Rust tokenizers), slow (Python) or auto.",
    )
    group.add_argument("--tp", type=int, default=1, help="Tensor-parallel size (model processes).")
    group.add_argument("--nccl_host", type=str, default="127.0.0.1", help="Rendezvous address of torch.distributed.")
    group.add_argument("--nccl_port", type=int, default=None, help="Rendezvous port of torch.distributed; default: a free port.")
    group.add_argument(
        "--data_type",
        type=str,
        choices=["auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"],
        default="auto",
        help="Weight and KV dtype; auto takes the checkpoint's dtype (float32 on CPU for float16 checkpoints).",
    )
    group.add_argument("--device", type=str, choices=["auto", "cpu", "cuda"], default="auto", help="Where the model runs.")

    group = parser.add_argument_group("memory and batching")
    group.add_argument(
        "--max_total_token_num",
        type=int,
        default=None,
        help="KV-cache capacity in tokens; default: free memory times --mem_fraction (on CPU split across ranks and capped at 262144).",
    )
    group.add_argument("--mem_fraction", type=float, default=0.9, help="Share of free memory the KV cache may take when sizing it.")
    group.add_argument("--running_max_req_size", type=int, default=256, help="Most requests in the running batch at once.")
    group.add_argument("--max_req_total_len", type=int, default=None, help="Most prompt + generated tokens per request; default: the model's context length.")
    group.add_argument("--batch_max_tokens", type=int, default=None, help="Most prefill tokens in one forward; default: max(--chunked_prefill_size, 2048).")
    group.add_argument("--chunked_prefill_size", type=int, default=1024, help="Most prefill tokens one request computes per step.")
    group.add_argument("--disable_chunked_prefill", action="store_true", help="Prefill every prompt in one piece.")
    group.add_argument(
        "--router_token_ratio",
        type=float,
        default=1.0,
        help="Admission admits requests while projected KV use (held + expected tokens) stays under this share of capacity.",
    )
    group.add_argument(
        "--router_max_wait_tokens",
        type=int,
        default=1,
        help="Decode steps the router lets pass between two admission rounds while requests run.",
    )
    group.add_argument("--disable_dynamic_prompt_cache", action="store_true", help="Turn off the radix prefix cache.")
    group.add_argument("--schedule_time_interval", type=float, default=0.03, help="Seconds between router admission rounds.")
    group.add_argument("--graph_max_batch_size", type=int, default=256, help="Largest decode batch captured in CUDA graphs (CUDA only).")
    group.add_argument(
        "--prefill_queue_strategy",
        type=str,
        choices=_strategy_names(),
        default="default",
        help="Order of the prefill queue each step: default (FCFS by inference priority), promote_shortest, hrrn.",
    )

    group = parser.add_argument_group("generation")
    group.add_argument("--eos_id", type=int, nargs="+", default=None, help="End-of-sequence token id(s); default: from the checkpoint.")
    group.add_argument("--max_new_tokens_default", type=int, default=None, help="max_new_tokens when a request gives none; default: the remaining context.")

    group = parser.add_argument_group("logging")
    group.add_argument("--log_level", type=str, choices=["debug", "info", "warning", "error"], default="info", help="Log verbosity.")
    return parser


class ArgumentError(ValueError):
    """An impossible combination of flags."""


def validate_args(args: argparse.Namespace, cuda_device_count: Optional[int] = None) -> None:
    """Raise :class:`ArgumentError` (one line) for settings that cannot work together."""
    if args.run_mode != "pd_master" and not args.model_dir:
        raise ArgumentError("--model_dir is required")
    for name in ("tp", "running_max_req_size", "chunked_prefill_size"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise ArgumentError(f"--{name} must be positive, got {getattr(args, name)}")
    for name in ("max_total_token_num", "max_req_total_len", "batch_max_tokens"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ArgumentError(f"--{name} must be positive, got {value}")
    if not 0 < args.mem_fraction <= 1:
        raise ArgumentError(f"--mem_fraction must be in (0, 1], got {args.mem_fraction}")
    if args.router_token_ratio <= 0:
        raise ArgumentError(f"--router_token_ratio must be positive, got {args.router_token_ratio}")
    if args.router_max_wait_tokens < 0:
        raise ArgumentError(f"--router_max_wait_tokens must be >= 0, got {args.router_max_wait_tokens}")
    if args.schedule_time_interval < 0:
        raise ArgumentError(f"--schedule_time_interval must be >= 0, got {args.schedule_time_interval}")
    if args.batch_max_tokens is not None and not args.disable_chunked_prefill and args.chunked_prefill_size > args.batch_max_tokens:
        raise ArgumentError(
            f"--chunked_prefill_size ({args.chunked_prefill_size}) cannot exceed --batch_max_tokens ({args.batch_max_tokens})"
        )
    if not 0 < args.port < 65536:
        raise ArgumentError(f"--port must be in 1..65535, got {args.port}")
    if cuda_device_count is not None and args.device in ("auto", "cuda") and cuda_device_count > 0 and args.tp > cuda_device_count:
        raise ArgumentError(f"--tp {args.tp} needs {args.tp} GPUs but only {cuda_device_count} are visible")
    if args.device == "cuda" and cuda_device_count == 0:
        raise ArgumentError("--device cuda was given but no CUDA device is visible")


def arguments_markdown(parser: Optional[argparse.ArgumentParser] = None) -> str:
    """The argument reference as a Markdown table, one section per argument group."""
    parser = parser or make_argument_parser()
    lines: List[str] = []
    for group in parser._action_groups:  # argparse exposes groups only through this attribute
        actions = [a for a in group._group_actions if a.dest != "help"]
        if not actions:
            continue
        lines += [f"### {group.title}", "", "| flag | default | choices | meaning |", "| --- | --- | --- | --- |"]
        for action in actions:
            flag = ", ".join(action.option_strings)
            default = "off" if isinstance(action, argparse._StoreTrueAction) else repr(action.default)
            choices = " / ".join(str(c) for c in action.choices) if action.choices else ""
            lines.append(f"| `{flag}` | `{default}` | {choices} | {action.help or ''} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m lightllm.server.api_cli --markdown`` prints the argument reference."""
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--markdown"]:
        print(arguments_markdown())
        return 0
    print("usage: python -m lightllm.server.api_cli --markdown", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
