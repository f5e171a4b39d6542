"""Decode throughput of the torch and Triton attention backends on one model, side by side.

``python -m lightllm.benchmark.bench_attention_backends --model_dir DIR --device cuda
[--dtype bfloat16 --batch 32 --context 1024 --decode-steps 64 --repeats 3]`` prefills ``batch``
random prompts of ``context`` tokens, then times ``decode-steps`` batched decode steps with each
backend, and prints decode tokens/s, milliseconds per step and the largest logit difference of
the Triton backend from the torch reference (Markdown; JSON too with ``--json``).

It is the first thing to run on a GPU: the Triton kernels are verified on CPU only through
Triton's interpreter, which proves them right but says nothing about their speed.  ``--device cpu``
therefore runs only under ``TRITON_INTERPRET=1`` (a check that the two backends agree, not a
timing) and is refused otherwise; the CPU backends are timed by ``bench_decode_attention``.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from typing import Dict, List, Optional

import torch

from lightllm.benchmark.cli_args import (OneLineErrorParser, argument_type, checkpoint_dir, non_negative_int,
                                         output_file, sequence_too_long)
from lightllm.common.basemodel.attention.selection import (
    AttentionBackendError,
    build_attention_backend,
    resolve_attention_backend,
    triton_import_error,
)
from lightllm.common.basemodel.batch_generator import BatchGenerator
from lightllm.common.basemodel.serving_dtype import dtype_name, parse_dtype
from lightllm.models.registry import load_model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_backend(
    model_dir: str, backend: str, device: torch.device, dtype: torch.dtype, prompts: List[List[int]], steps: int, repeats: int
) -> Dict[str, object]:
    """Median decode timing of ``backend`` plus the logits of its first decode step (for the diff)."""
    model = load_model(model_dir, dtype=dtype, device=device, attention=build_attention_backend(backend))
    context = len(prompts[0])
    runner = BatchGenerator(model, kv_cache_size=len(prompts) * (context + steps), max_request_num=len(prompts),
                            max_sequence_length=context + steps)
    step_seconds: List[float] = []
    first_logits: Optional[torch.Tensor] = None
    for _ in range(repeats):
        seqs = [runner.start(p) for p in prompts]
        runner.forward(seqs, [len(p) for p in prompts])
        for step in range(steps):
            for i, seq in enumerate(seqs):
                seq.token_ids.append(3 + (7 * i + step) % 97)  # fixed tokens: both backends decode the same input
            _sync(device)
            started = time.perf_counter()
            logits = runner.forward(seqs, [1] * len(seqs))
            _sync(device)
            step_seconds.append(time.perf_counter() - started)
            if first_logits is None:
                first_logits = logits.float().cpu()
        for seq in seqs:
            runner.release(seq)
    del runner, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    median = statistics.median(step_seconds)
    return {"backend": backend, "ms_per_step": median * 1e3, "decode_tokens_per_s": len(prompts) / median, "logits": first_logits}


def _triton_refusal(device: str, exc: AttentionBackendError) -> str:
    """Why the comparison cannot run, in this tool's terms (the selection names the server's flag)."""
    if device == "cpu" and triton_import_error() is None:
        # Comparing the CPU backends (torch, torch_compiled, cpp) is bench_decode_attention's job.
        return ("--device cpu compares torch with Triton, whose kernels run on CPU only in Triton's interpreter: "
                "set TRITON_INTERPRET=1 to check that the two agree (no timing), or time the CPU backends with "
                "python -m lightllm.benchmark.bench_decode_attention")
    return f"cannot run the Triton backend: {str(exc).replace('--attention_backend triton', 'it')}"


def main(argv: Optional[List[str]] = None) -> int:
    """Run both backends and print the comparison."""
    parser = OneLineErrorParser(
        prog="python -m lightllm.benchmark.bench_attention_backends", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model_dir", required=True, type=checkpoint_dir, help="local checkpoint directory")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cuda; cpu only under TRITON_INTERPRET=1 (agreement, not speed)")
    parser.add_argument("--dtype", type=argument_type(dtype_name), default="bfloat16", help="float32, bfloat16 or float16")
    parser.add_argument("--batch", type=int, default=32, help="requests decoded together")
    parser.add_argument("--context", type=int, default=1024,
                        help="prompt tokens per request before decoding; with --decode-steps within the model's context")
    parser.add_argument("--decode-steps", type=int, default=64, help="timed decode steps per repeat")
    parser.add_argument("--repeats", type=int, default=3, help="prefill-and-decode runs per backend")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the prompts' token ids, >= 0")
    parser.add_argument("--json", type=output_file, default=None, help="also write the results here (JSON)")
    args = parser.parse_args(argv)
    for name in ("batch", "context", "decode_steps", "repeats"):
        if getattr(args, name) <= 0:
            print(f"error: --{name.replace('_', '-')} must be positive", file=sys.stderr)
            return 2
    too_long = sequence_too_long(args.model_dir, {"--context": args.context, "--decode-steps": args.decode_steps})
    if too_long:
        print(f"error: {too_long}", file=sys.stderr)
        return 2
    try:
        resolve_attention_backend("triton", args.device)
    except AttentionBackendError as exc:
        print(f"error: {_triton_refusal(args.device, exc)}", file=sys.stderr)
        return 2
    dtype = parse_dtype(args.dtype)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda was given but no CUDA device is visible", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(5, 100, (args.context,), generator=gen).tolist() for _ in range(args.batch)]
    results = [
        measure_backend(args.model_dir, name, device, dtype, prompts, args.decode_steps, args.repeats)
        for name in ("torch", "triton")
    ]
    diff = (results[1]["logits"] - results[0]["logits"]).abs().max().item()
    print(f"decode, batch {args.batch}, context {args.context}, {args.dtype}, {args.device}\n")
    print("| backend | ms per step | decode tokens/s |\n| --- | --- | --- |")
    for r in results:
        print(f"| {r['backend']} | {r['ms_per_step']:.2f} | {r['decode_tokens_per_s']:.0f} |")
    print(f"\nlargest logit difference triton vs torch (first decode step): {diff:.3g}")
    if args.json:
        rows = [{k: v for k, v in r.items() if k != "logits"} for r in results]
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "results": rows, "max_logit_diff": diff}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
