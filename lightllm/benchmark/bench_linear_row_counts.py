"""What a new row count costs oneDNN's projections, and what padding rows to a few sizes costs instead.

    python -m lightllm.benchmark.bench_linear_row_counts --model_dir DIR [--rows 1001-1016] [--threads 2]

oneDNN compiles kernels for every distinct row count it sees (and keeps them, least recently used
out, in a cache of 1024 primitives). For each projection shape of the checkpoint (q/k/v, o,
gate/up, down; weights random, shapes from config.json) and each row count in ``--rows``, in this
order: the first product at that exact row count (a compile), the same product again (cached),
and the product at the padded row count the server runs (``padded_row_count``, after one untimed
run so its compile is not counted); the last two are the best of three runs, alternating. Also
the resident memory each new exact row count leaves behind (measured after returning free heap
pages to the kernel).
Timings are for reading, never for deciding a test.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from lightllm.benchmark.cli_args import OneLineErrorParser
from lightllm.benchmark.simulator.cell_cli import int_range
from lightllm.common.basemodel.linear_kernels import OneDnnLinear, onednn_problem, padded_row_count
from lightllm.common.basemodel.model_config import ModelConfig
from lightllm.server.model_rank.execution.forward_cost import ForwardShape
from lightllm.utils.malloc_tuning import malloc_trim

# A row count never measured: the first product of a shape pays one-off set-up beyond the compile.
EXACT_WARMUP_ROWS = 7
REPEATS = 3


def projection_shapes(config: ModelConfig) -> List[Tuple[str, int, int]]:
    """(name, out_features, in_features) of one layer's projections, as the model packs them."""
    shape = ForwardShape.from_config(config, tp=1, dtype=torch.float32)
    return [
        ("qkv", shape.q_dim + 2 * shape.kv_dim, shape.hidden),
        ("o", shape.hidden, shape.q_dim),
        ("gate_up", 2 * shape.intermediate, shape.hidden),
        ("down", shape.hidden, shape.intermediate),
    ]


def resident_mib() -> float:
    """This process's resident set (Linux ``/proc/self/statm``) once free heap pages are returned,
    so that what is counted is what oneDNN keeps, not the allocator's slack."""
    malloc_trim()
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


def timed_ms(run: Callable[[], object]) -> float:
    """Wall time of one call of ``run`` (no warm-up: the first call is what is measured)."""
    started = time.perf_counter()
    run()
    return (time.perf_counter() - started) * 1e3


def measure(config: ModelConfig, rows: Sequence[int]) -> List[Dict]:
    """One result per projection shape, averaged over ``rows``; prints them as it goes."""
    results = []
    generator = torch.Generator().manual_seed(0)
    for name, out_features, in_features in projection_shapes(config):
        linear = OneDnnLinear(torch.randn(out_features, in_features, generator=generator), None)
        inputs = {count: torch.randn(count, in_features, generator=generator) for count in rows}
        linear.unpadded(torch.randn(EXACT_WARMUP_ROWS, in_features))  # the shape's first call pays one-off set-up
        new_ms, cached_ms, padded_ms = [], [], []
        resident_before = resident_mib()
        for count in rows:
            new_ms.append(timed_ms(lambda: linear.unpadded(inputs[count])))
        resident_added = (resident_mib() - resident_before) / len(rows)
        for count in rows:
            linear(inputs[count])  # compile the padded sizes outside the timing
        for count in rows:  # best of REPEATS, the two alternating
            cached_ms.append(float("inf"))
            padded_ms.append(float("inf"))
            for _ in range(REPEATS):
                cached_ms[-1] = min(cached_ms[-1], timed_ms(lambda: linear.unpadded(inputs[count])))
                padded_ms[-1] = min(padded_ms[-1], timed_ms(lambda: linear(inputs[count])))
        result = {
            "projection": name, "weight": f"{out_features} x {in_features}",
            "new_ms": sum(new_ms) / len(rows), "cached_ms": sum(cached_ms) / len(rows),
            "padded_ms": sum(padded_ms) / len(rows), "resident_mib_per_new_count": resident_added,
            "padded_sizes": sorted({padded_row_count(count) for count in rows}),
        }
        results.append(result)
        print(f"{name:8s} {result['weight']:>12s}: new row count {result['new_ms']:.2f} ms, cached "
              f"{result['cached_ms']:.2f} ms, padded to {len(result['padded_sizes'])} size(s) "
              f"{result['padded_ms']:.2f} ms; +{resident_added:.2f} MiB resident kept per new row count", flush=True)
    return results


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Command line."""
    parser = OneLineErrorParser(prog="python -m lightllm.benchmark.bench_linear_row_counts",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_dir", required=True, help="checkpoint whose config.json gives the shapes")
    parser.add_argument("--rows", default="1001-1016", help="row counts: LOW-HIGH[/STEP] ranges or a comma list")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    try:
        rows = int_range(args.rows)
    except ValueError as exc:
        parser.error(f"--rows: {exc}")
    if not rows or min(rows) < 1 or len(set(rows)) != len(rows) or args.threads < 1:
        parser.error("--rows must name distinct row counts >= 1 and --threads must be >= 1")
    if EXACT_WARMUP_ROWS in rows:
        parser.error(f"--rows must not include {EXACT_WARMUP_ROWS} (the warm-up row count)")
    problem = onednn_problem("cpu", torch.float32)
    if problem is not None:
        parser.error(f"oneDNN cannot run here: {problem}")
    torch.set_num_threads(args.threads)
    measure(ModelConfig.from_dir(args.model_dir), rows)


if __name__ == "__main__":
    main()
