"""Forward time of a checkpoint with each projection kernel (``--linear_backend``), in one process.

    python -m lightllm.benchmark.bench_linear_backends --model_dir DIR [--threads 1 2] [--rows 64] [--context 160]

For each backend that runs here and each thread count: one decode step of ``rows`` requests
whose contexts hold ``context`` positions, and one prefill of ``prefill`` tokens (best of a few
runs each), plus whether greedy continuations of a few prompts are token for token the same with
every backend. Timings are for reading, never for deciding a test.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from lightllm.benchmark.cli_args import OneLineErrorParser, checkpoint_dir
from lightllm.benchmark.count_flags import positive_int
from lightllm.benchmark.kernel_bench_context import context_refusal
from lightllm.common.basemodel.attention.selection import build_attention_backend, resolve_attention_backend
from lightllm.common.basemodel.batch_generator import BatchGenerator
from lightllm.common.basemodel.linear_kernels import onednn_problem
from lightllm.models.registry import load_model
from lightllm.server.model_rank.execution.forward_cost import best_seconds


def decode_seconds(generator: BatchGenerator, rows: int, context: int, repeats: int) -> float:
    """Best time of one decode step of ``rows`` requests over ``context`` cached positions each."""
    seqs = [generator.start([5] * (context + 1)) for _ in range(rows)]
    for seq in seqs:
        slots = generator.kv_cache.alloc(context)
        generator.req_manager.set_slots(seq.row, 0, slots)
        seq.slots.append(slots)
        seq.cached_len = context

    def step() -> None:
        generator.forward(seqs, [1] * rows)
        for seq in seqs:  # step back, so every step sees the same context
            seq.cached_len -= 1
            generator.kv_cache.free(seq.slots.pop())

    try:
        return best_seconds(step, repeats)
    finally:
        for seq in seqs:
            generator.release(seq)


def prefill_seconds(generator: BatchGenerator, tokens: int, repeats: int) -> float:
    """Best time of one prefill forward of a ``tokens``-token prompt."""

    def once() -> None:
        seq = generator.start([5 + i % 1000 for i in range(tokens)])
        try:
            generator.forward([seq], [tokens])
        finally:
            generator.release(seq)

    return best_seconds(once, repeats)


def run(model_dir: str, threads: Sequence[int], rows: int, context: int, prefill: int, repeats: int) -> List[Dict]:
    """One row per backend and thread count; prints them as it goes."""
    backends = ["torch"] + (["onednn"] if onednn_problem("cpu", torch.float32) is None else [])
    attention = resolve_attention_backend("auto", "cpu")
    prompts = [[5 + (7 * i + j) % 900 for j in range(n)] for i, n in enumerate((9, 70, 130, 33))]
    outputs: Dict[str, List[List[int]]] = {}
    rows_out: List[Dict] = []
    for backend in backends:
        model = load_model(model_dir, dtype=torch.float32, attention=build_attention_backend(attention),
                           linear_backend=backend)
        outputs[backend] = BatchGenerator(model, 4096).greedy_generate(prompts, 16)
        for count in threads:
            torch.set_num_threads(count)
            generator = BatchGenerator(model, rows * (context + 2) + prefill + 16, max_request_num=rows,
                                       max_sequence_length=max(context + 1, prefill))
            row = {
                "backend": backend, "threads": count,
                "decode_ms": decode_seconds(generator, rows, context, repeats) * 1e3,
                "prefill_ms": prefill_seconds(generator, prefill, repeats) * 1e3,
            }
            rows_out.append(row)
            print(f"{backend:7s} threads={count} decode {rows} x {context}: {row['decode_ms']:.1f} ms  "
                  f"prefill {prefill}: {row['prefill_ms']:.0f} ms", flush=True)
    same = all(outputs[b] == outputs["torch"] for b in backends)
    print(f"greedy continuations identical across {', '.join(backends)}: {same}")
    return rows_out


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Command line."""
    parser = OneLineErrorParser(prog="python -m lightllm.benchmark.bench_linear_backends",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_dir", required=True, type=checkpoint_dir, help="local checkpoint directory")
    parser.add_argument("--threads", type=positive_int, nargs="+", default=[1, 2], help="torch thread counts to time")
    parser.add_argument("--rows", type=positive_int, default=64, help="decode requests per step")
    parser.add_argument("--context", type=positive_int, default=160,
                        help="cached positions per decode request; plus the decoded token within the model's context")
    parser.add_argument("--prefill", type=positive_int, default=1024,
                        help="prompt tokens of the prefill forward; within the model's context")
    parser.add_argument("--repeats", type=positive_int, default=5, help="runs per timing; the best is reported")
    args = parser.parse_args(argv)
    too_long = (context_refusal(args.model_dir, "--context", args.context, 1, "the decode step appends")
                or context_refusal(args.model_dir, "--prefill", args.prefill))
    if too_long:
        parser.error(too_long)
    run(args.model_dir, args.threads, args.rows, args.context, args.prefill, args.repeats)


if __name__ == "__main__":
    main()
