"""Decode step time of two attention backends on one model and one KV cache, interleaved.

``python -m lightllm.benchmark.bench_decode_attention --model_dir DIR [--batches 1,16,64
--contexts 128,1024,2048 --steps 6 --backends torch,torch_compiled,cpp --dtype float32]`` prefills
``batch`` random prompts of ``context`` tokens once per grid cell, then runs decode steps that
alternate between the backends (between steps the model swaps its attention backend and the
layer ops that backend chooses, ``AttentionBackend.layer_kernels()``, so each step is what a
server started with that backend runs; all read the same cache), so a machine shared with other
work slows both sides alike.  Prints the median
milliseconds per step of each backend, their ratio and the largest logit difference between
the backends on the same step input (Markdown; JSON too with ``--json``).

``--phase prefill`` times prefill forwards instead: each step is one forward of ``batch`` fresh
prompts of ``context`` tokens (causal attention over long chunks), alternating between the
backends, and releases its sequences afterwards.

``--clock cpu`` times each step by the CPU time of the calling thread and runs torch on that one
thread: on a machine shared with other work, wall time swings by several times from one step to
the next, while the CPU time a step needs stays put.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import torch

from lightllm.benchmark.cli_args import (OneLineErrorParser, argument_type, checkpoint_dir, comma_items,
                                         non_negative_int, output_file)
from lightllm.benchmark.count_flags import positive_int
from lightllm.benchmark.kernel_bench_context import context_refusal
from lightllm.common.basemodel.attention.selection import ATTENTION_BACKENDS, AttentionBackendError, build_attention_backend
from lightllm.common.basemodel.batch_generator import BatchGenerator
from lightllm.common.basemodel.layer_ops_select import build_layer_ops
from lightllm.common.basemodel.serving_dtype import dtype_name, parse_dtype
from lightllm.common.basemodel.transformer_model import DecoderOnlyTransformer
from lightllm.models.registry import load_model

PREFILL_REQUESTS_PER_FORWARD = 8  # bounds prefill activations at large batch x context


def _int_list(text: str) -> List[int]:
    try:
        values = [int(v) for v in comma_items(text)]
    except ValueError:  # not integers, or an empty item: the refusal below names the flag and the text
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def decode_tokens_added(backends: int, steps: int) -> int:
    """Tokens :func:`measure_cell` appends to every sequence: a warm-up and ``steps`` per backend, and the probe."""
    return backends * (steps + 1) + 1


class _BackendSwitch:
    """Puts one backend's attention and its own layer ops on the model, as loading it with that
    backend does (``cpp`` fuses the layer ops in C++, ``torch`` runs them unfused); a timed step
    that swapped only the attention would run every backend on the first one's layer ops.  Used
    as a context manager, it restores the model's own pair afterwards."""

    def __init__(self, model: DecoderOnlyTransformer, backends: Dict[str, object]) -> None:
        self.model = model
        self.backends = backends
        self.layer_ops = {name: build_layer_ops(backend.layer_kernels(), model.rotary)
                          for name, backend in backends.items()}

    def use(self, name: str) -> None:
        self.model.attention = self.backends[name]
        self.model.layer_ops = self.layer_ops[name]

    def __enter__(self) -> "_BackendSwitch":
        self._saved = (self.model.attention, self.model.layer_ops)
        return self

    def __exit__(self, *exc) -> None:
        self.model.attention, self.model.layer_ops = self._saved


def measure_cell(
    model: DecoderOnlyTransformer, backends: Dict[str, object], batch: int, context: int, steps: int, seed: int, clock: Callable[[], float] = time.perf_counter
) -> Dict[str, float]:
    """Median ms per decode step of each backend (its attention and its layer ops), plus the logit
    difference between them."""
    with _BackendSwitch(model, backends) as switch:
        return _measure_cell(model, switch, batch, context, steps, seed, clock)


def _measure_cell(model: DecoderOnlyTransformer, switch: _BackendSwitch, batch: int, context: int, steps: int,
                  seed: int, clock: Callable[[], float]) -> Dict[str, float]:
    backends = switch.backends
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, model.config.vocab_size, (context,), generator=gen).tolist() for _ in range(batch)]
    names = list(backends)
    total_steps = len(names) * (steps + 1) + 1
    runner = BatchGenerator(model, kv_cache_size=batch * (context + total_steps), max_request_num=batch,
                            max_sequence_length=context + total_steps)
    switch.use(names[0])
    seqs = [runner.start(p) for p in prompts]
    for first in range(0, batch, PREFILL_REQUESTS_PER_FORWARD):
        part = seqs[first : first + PREFILL_REQUESTS_PER_FORWARD]
        runner.forward(part, [context] * len(part))
    timings: Dict[str, List[float]] = {name: [] for name in names}
    diff = 0.0
    for step in range(steps + 1):  # step 0 warms up each backend at this shape
        for name in names:
            for i, seq in enumerate(seqs):
                seq.token_ids.append(3 + (7 * i + step) % 97)
            switch.use(name)
            started = clock()
            runner.forward(seqs, [1] * batch)
            elapsed = clock() - started
            if step:
                timings[name].append(elapsed)
        if step == 0 and len(names) > 1:
            # Same input through every backend: the last token again, at the next position.
            for seq in seqs:
                seq.token_ids.append(seq.token_ids[-1])
            outs = []
            for name in names:
                switch.use(name)
                outs.append(_probe(runner, seqs))
            diff = max((o - outs[0]).abs().max().item() for o in outs[1:])
    for seq in seqs:
        runner.release(seq)
    cell = {f"{name}_ms": statistics.median(t) * 1e3 for name, t in timings.items()}
    cell["max_logit_diff"] = diff
    return cell


def measure_prefill_cell(
    model: DecoderOnlyTransformer, backends: Dict[str, object], batch: int, context: int, steps: int, seed: int, clock: Callable[[], float] = time.perf_counter
) -> Dict[str, float]:
    """Median ms per prefill forward (``batch`` fresh prompts of ``context`` tokens) of each backend
    (its attention and its layer ops)."""
    with _BackendSwitch(model, backends) as switch:
        return _measure_prefill_cell(model, switch, batch, context, steps, seed, clock)


def _measure_prefill_cell(model: DecoderOnlyTransformer, switch: _BackendSwitch, batch: int, context: int,
                          steps: int, seed: int, clock: Callable[[], float]) -> Dict[str, float]:
    backends = switch.backends
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, model.config.vocab_size, (context,), generator=gen).tolist() for _ in range(batch)]
    names = list(backends)
    runner = BatchGenerator(model, kv_cache_size=batch * context + 1, max_request_num=batch, max_sequence_length=context)
    timings: Dict[str, List[float]] = {name: [] for name in names}
    logits_of: Dict[str, torch.Tensor] = {}
    for step in range(steps + 1):  # step 0 warms up each backend at this shape
        for name in names:
            switch.use(name)
            seqs = [runner.start(p) for p in prompts]
            started = clock()
            logits = runner.forward(seqs, [context] * batch)
            elapsed = clock() - started
            if step:
                timings[name].append(elapsed)
            else:
                logits_of[name] = logits.float()
            for seq in seqs:
                runner.release(seq)
    first = logits_of[names[0]]
    cell = {f"{name}_ms": statistics.median(t) * 1e3 for name, t in timings.items()}
    cell["max_logit_diff"] = max(((logits_of[n] - first).abs().max().item() for n in names[1:]), default=0.0)
    return cell


def _probe(runner: BatchGenerator, seqs) -> torch.Tensor:
    """Logits of one decode step that leaves no trace (its slots are freed, lengths restored)."""
    logits = runner.forward(seqs, [1] * len(seqs))
    for seq in seqs:
        seq.cached_len -= 1
        runner.kv_cache.free(seq.slots.pop())
    return logits


def main(argv: Optional[List[str]] = None) -> int:
    """CLI entry point."""
    parser = OneLineErrorParser(prog="python -m lightllm.benchmark.bench_decode_attention",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_dir", required=True, type=checkpoint_dir)
    parser.add_argument("--batches", type=_int_list, default=[1, 16, 64])
    parser.add_argument("--contexts", type=_int_list, default=[128, 1024, 2048],
                        help="cached tokens per request; with the decode steps within the model's context")
    parser.add_argument("--steps", type=positive_int, default=6, help="timed steps per backend per cell")
    parser.add_argument("--phase", choices=["decode", "prefill"], default="decode",
                        help="decode: one-token steps over cached contexts; prefill: forwards of fresh prompts")
    parser.add_argument("--backends", default="torch,torch_compiled", help="comma-separated; the first is the baseline")
    parser.add_argument("--dtype", type=argument_type(dtype_name), default="float32",
                        help="float32, bfloat16 or float16")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads, >= 1 (default: torch's choice)")
    parser.add_argument("--min-fused-context", type=non_negative_int, default=None,
                        help="override torch_compiled's threshold (requests x context) for its kernel; 0: always")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="wall: perf_counter; cpu: the calling thread's CPU time, with torch on one thread")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--json", type=output_file, default=None, help="also write the results here (JSON)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.backends.split(",") if n.strip()]
    unknown = [n for n in names if n not in ATTENTION_BACKENDS or n in ("auto", "triton")]
    if unknown or not names:
        parser.error(f"--backends takes torch, torch_compiled and/or cpp, got {args.backends!r}")
    if len(set(names)) < len(names):
        parser.error(f"--backends names a backend twice: {args.backends!r}")
    added = decode_tokens_added(len(names), args.steps) if args.phase == "decode" else 0
    too_long = context_refusal(args.model_dir, "--contexts", max(args.contexts), added, "the decode steps append")
    if too_long:
        parser.error(too_long)
    if args.clock == "cpu":
        if args.threads not in (None, 1):
            parser.error("--clock cpu measures one thread; leave --threads unset or 1")
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    dtype = parse_dtype(args.dtype)
    # Named on the command line: a model the cpp kernel cannot run is refused, not timed on SDPA
    # under the cpp label.
    backends = {name: build_attention_backend(name, strict=True) for name in names}
    if args.min_fused_context is not None:
        for backend in backends.values():
            if hasattr(backend, "min_fused_context"):
                backend.min_fused_context = args.min_fused_context
                if args.min_fused_context == 0:
                    backend.min_fused_requests = 1
    try:
        model = load_model(args.model_dir, dtype=dtype, attention=backends[names[0]])
        for backend in backends.values():
            backend.warmup(model.local_q_heads, model.local_kv_heads, model.head_dim, model.dtype, model.device)
    except AttentionBackendError as exc:
        parser.error(str(exc))
    rows = []
    header = "| batch | context | " + " | ".join(f"{n} ms/step" for n in names)
    header += " | speed-up |" if len(names) > 1 else " |"
    print(header)
    print("|" + " --- |" * (header.count("|") - 1))
    for batch in args.batches:
        for context in args.contexts:
            measure = measure_cell if args.phase == "decode" else measure_prefill_cell
            cell = measure(model, backends, batch, context, args.steps, args.seed, clock)
            cell.update(batch=batch, context=context)
            rows.append(cell)
            line = f"| {batch} | {context} | " + " | ".join(f"{cell[n + '_ms']:.2f}" for n in names)
            if len(names) > 1:
                cell["speedup"] = cell[names[0] + "_ms"] / cell[names[-1] + "_ms"]
                line += f" | {cell['speedup']:.2f}x |"
            else:
                line += " |"
            print(line, flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "torch": torch.__version__, "results": rows}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
