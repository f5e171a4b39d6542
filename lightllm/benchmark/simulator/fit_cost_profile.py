"""Fit a step-cost profile to forwards timed on this machine with the ``small`` demo model.

Usage::

    python -m lightllm.benchmark.simulator.fit_cost_profile \\
        [--out lightllm/benchmark/simulator/profiles/cpu_demo_small.json] [--model-dir DIR] \\
        [--threads 1] [--clock thread_cpu] [--repeats 3] [--passes 2]

It generates (or loads) the demo checkpoint, runs real prefill forwards of several chunk sizes
at several context positions up to 2K and real decode forwards of several batch sizes and
context lengths through ``BatchGenerator`` (each point repeated, the fastest run kept), then
fits the :mod:`cost_model` coefficients by least squares on relative error with non-negative
coefficients.  The JSON records the samples, the fit residuals and the command used.  On a
2-core CPU it takes about two minutes.

By default it times the CPU time of single-threaded forwards: on a machine shared with other
jobs, wall-clock times of multi-threaded forwards swing by several times from run to run
(a thread descheduled at a barrier stalls the others), while the CPU time of one thread stays
put.  ``--clock wall --threads N`` measures elapsed time instead, for a quiet machine.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from lightllm.utils.interrupts import interruptible
from lightllm.benchmark.cli_args import OneLineErrorParser, checkpoint_dir, output_file
from lightllm.benchmark.output_writing import print_report, strict_json, write_outputs_or_exit
from lightllm.benchmark.simulator.cost_model import PROFILE_DIR, CostProfile
from lightllm.common.basemodel.batch_generator import BatchGenerator, CachedSequence
from lightllm.common.basemodel.model_config import ModelConfig, ModelConfigError
from lightllm.models.registry import load_model
from lightllm.utils.demo_model import generate_demo_model

PROFILE_NAME = "cpu_demo_small"
# (chunk tokens, context positions at which a chunk ends); one prompt per chunk size.
PREFILL_POINTS = ((64, (64, 1024, 2048)), (256, (256, 1024, 2048)), (512, (512, 1536)), (1024, (1024, 2048)))
BATCHED_PREFILL = (4, 256, (256, 1024))  # sequences side by side, chunk, chunk ends
DECODE_POINTS = ((128, (1, 4, 8, 16)), (1024, (1, 4, 8, 16)), (2048, (1, 4, 8)))  # (context, batch sizes)
PROMPT_LEN = 2048
# The longest sequence the points build (the 2048-token prompt plus decode steps), with room to spare.
MEASURED_LENGTH = PROMPT_LEN + 64
BUILD_CHUNK = 1024  # untimed forwards that bring sequences to a context use this size

# One sample: kind, feature tuple, seconds.  Prefill features: (token_sum, sum(t * end));
# decode features: (batch_size, kv_token_sum).
Sample = Tuple[str, Tuple[int, int], float]


CLOCKS: Dict[str, Callable[[], float]] = {"thread_cpu": time.thread_time, "wall": time.perf_counter}


class ForwardTimer:
    """Times forwards of ``BatchGenerator``, repeating each one on the same positions.

    Other processes sharing the CPU only ever add time, so every point is run ``repeats``
    times back to back and the fastest run is kept.  Between runs the point's KV slots are
    handed back and the sequences rewound, so each run computes exactly the same positions.
    ``clock`` is ``time.thread_time`` (CPU time of a single-threaded forward, which other
    processes cannot inflate by taking the core away) or ``time.perf_counter`` (wall time).
    """

    def __init__(self, gen: BatchGenerator, repeats: int, clock: Callable[[], float]) -> None:
        self.gen = gen
        self.repeats = repeats
        self.clock = clock

    def advance(self, seqs: Sequence[CachedSequence], target: int) -> None:
        """Untimed forwards until every sequence has ``target`` cached tokens."""
        for seq in seqs:
            while seq.cached_len < target:
                self.gen.forward([seq], [min(BUILD_CHUNK, target - seq.cached_len)])

    def fastest(self, seqs: Sequence[CachedSequence], new_len: int) -> float:
        """Fastest of ``repeats`` runs of one forward of ``new_len`` tokens per sequence (kept once)."""
        best = float("inf")
        for attempt in range(self.repeats):
            started = self.clock()
            self.gen.forward(seqs, [new_len] * len(seqs))
            best = min(best, self.clock() - started)
            if attempt + 1 < self.repeats:
                for seq in seqs:
                    self.gen.kv_cache.free(seq.slots.pop())
                    seq.cached_len -= new_len
        return best


def measure_prefill(timer: ForwardTimer, vocab_size: int) -> List[Sample]:
    """Prefill chunks of several sizes at several context positions, alone and side by side."""
    prompt = [i % vocab_size for i in range(PROMPT_LEN)]
    samples: List[Sample] = []
    for chunk, ends in PREFILL_POINTS:
        seq = timer.gen.start(prompt)
        try:
            for end in ends:
                timer.advance([seq], end - chunk)
                samples.append(("prefill", (chunk, chunk * end), timer.fastest([seq], chunk)))
        finally:
            timer.gen.release(seq)
    count, chunk, ends = BATCHED_PREFILL
    seqs = [timer.gen.start(prompt) for _ in range(count)]
    try:
        for end in ends:
            timer.advance(seqs, end - chunk)
            samples.append(("prefill", (count * chunk, count * chunk * end), timer.fastest(seqs, chunk)))
    finally:
        for seq in seqs:
            timer.gen.release(seq)
    return samples


def measure_decode(timer: ForwardTimer, vocab_size: int) -> List[Sample]:
    """Decode forwards of several batch sizes at several context lengths."""
    largest = max(max(batches) for _, batches in DECODE_POINTS)
    tokens = [i % vocab_size for i in range(PROMPT_LEN + 8)]
    seqs = [timer.gen.start(tokens) for _ in range(largest)]
    samples: List[Sample] = []
    try:
        for context, batches in DECODE_POINTS:
            for batch in batches:
                group = seqs[:batch]
                timer.advance(group, context)
                kv_sum = sum(seq.cached_len + 1 for seq in group)
                samples.append(("decode", (batch, kv_sum), timer.fastest(group, 1)))
    finally:
        for seq in seqs:
            timer.gen.release(seq)
    return samples


def nonnegative_least_squares(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0, by trying every column subset (3 columns: 7 fits)."""
    best: Optional[np.ndarray] = None
    best_sse = float("inf")
    columns = range(x.shape[1])
    for size in range(1, x.shape[1] + 1):
        for subset in itertools.combinations(columns, size):
            coef_sub, *_ = np.linalg.lstsq(x[:, subset], y, rcond=None)
            if np.any(coef_sub < 0):
                continue
            coef = np.zeros(x.shape[1])
            coef[list(subset)] = coef_sub
            sse = float(np.sum((x @ coef - y) ** 2))
            if sse < best_sse:
                best, best_sse = coef, sse
    if best is None:
        raise ValueError("no non-negative fit exists for these samples")
    return best


def _solve(rows: Sequence[Sample]) -> np.ndarray:
    x = np.array([[1.0, float(f[0]), float(f[1])] for _, f, _ in rows])
    y = np.array([seconds for _, _, seconds in rows])
    # Dividing each row by its time turns squared error into squared relative error, so the
    # millisecond decode steps weigh as much as the second-long prefill chunks.
    return nonnegative_least_squares(x / y[:, None], np.ones_like(y))


def _relative_errors(rows: Sequence[Sample], coef: np.ndarray) -> np.ndarray:
    x = np.array([[1.0, float(f[0]), float(f[1])] for _, f, _ in rows])
    y = np.array([seconds for _, _, seconds in rows])
    return (x @ coef - y) / y


def fit_kind(samples: Sequence[Sample], kind: str, outlier_factor: float = 4.0) -> Tuple[np.ndarray, Dict[str, Any]]:
    """Fit ``seconds = c0 + c1 * f1 + c2 * f2`` for one forward kind, minimising relative error.

    A point measured during a burst of load from other processes can be slower than the model
    by a large factor.  After a first fit, points whose relative error exceeds
    ``outlier_factor`` times the median absolute relative error (and 50%) are set aside, once,
    and the fit is redone; the set-aside points are reported.
    """
    rows = [s for s in samples if s[0] == kind]
    if len(rows) < 3:
        raise ValueError(f"need at least 3 {kind} samples to fit 3 coefficients, got {len(rows)}")
    coef = _solve(rows)
    errors = np.abs(_relative_errors(rows, coef))
    limit = max(0.5, outlier_factor * float(np.median(errors)))
    kept = [row for row, err in zip(rows, errors) if err <= limit]
    outliers = [row for row, err in zip(rows, errors) if err > limit]
    if outliers and len(kept) >= 3:
        coef = _solve(kept)
    else:
        kept, outliers = rows, []
    relative = _relative_errors(kept, coef)
    y = np.array([seconds for _, _, seconds in kept])
    predicted = y * (1.0 + relative)
    residual_ss = float(np.sum((predicted - y) ** 2))
    total_ss = float(np.sum((y - y.mean()) ** 2))
    stats: Dict[str, Any] = {
        "samples": len(kept),
        "rms_error_s": float(np.sqrt(np.mean((predicted - y) ** 2))),
        "mean_abs_relative_error": float(np.mean(np.abs(relative))),
        "max_abs_relative_error": float(np.max(np.abs(relative))),
        "r_squared": 1.0 - residual_ss / total_ss if total_ss > 0 else 1.0,
        "outliers_set_aside": [[list(f), round(sec, 6)] for _, f, sec in outliers],
    }
    return coef, stats


def fit_profile(samples: Sequence[Sample], max_total_token_num: int, provenance: Dict[str, Any]) -> CostProfile:
    """Turn timed samples into a :class:`CostProfile`; residuals go into ``provenance['fit']``."""
    prefill, prefill_stats = fit_kind(samples, "prefill")
    decode, decode_stats = fit_kind(samples, "decode")
    fit = dict(provenance.get("fit", {}))
    fit["residuals"] = {"prefill": prefill_stats, "decode": decode_stats}
    return CostProfile(
        name=PROFILE_NAME,
        description="FITTED step costs of the small demo Llama (fp32, torch CPU) on the machine that ran the fit",
        prefill_fixed_s=float(prefill[0]),
        prefill_per_token_s=float(prefill[1]),
        prefill_attention_s=float(prefill[2]),
        decode_fixed_s=float(decode[0]),
        decode_per_req_s=float(decode[1]),
        decode_per_kv_token_s=float(decode[2]),
        max_total_token_num=max_total_token_num,
        provenance={**provenance, "fit": fit},
    )


def measure(model_dir: Path, repeats: int, passes: int, clock: Callable[[], float]) -> List[Sample]:
    """Load the model, warm it up and time every point; keep each point's fastest pass.

    A burst of load from other processes can outlast one point's back-to-back repeats; whole
    passes some time apart rarely hit the same point twice.
    """
    model = load_model(str(model_dir))
    vocab = model.config.vocab_size
    gen = BatchGenerator(model, kv_cache_size=40_000, max_request_num=24, max_sequence_length=MEASURED_LENGTH)
    warm = gen.start(list(range(256)))
    gen.forward([warm], [256])
    gen.release(warm)
    timer = ForwardTimer(gen, repeats, clock)
    runs = [measure_prefill(timer, vocab) + measure_decode(timer, vocab) for _ in range(passes)]
    return [(column[0][0], column[0][1], min(sample[2] for sample in column)) for column in zip(*runs)]


def build_parser() -> argparse.ArgumentParser:
    """The command line's argument parser."""
    parser = OneLineErrorParser(
        prog="python -m lightllm.benchmark.simulator.fit_cost_profile", description=__doc__.split("\n\n")[0]
    )
    # Both checked while parsing: the measurement takes minutes to lose at the end.
    parser.add_argument(
        "--out",
        type=output_file,
        # Not the bundled file: a rerun on another machine must not silently replace the committed profile.
        default=f"{PROFILE_NAME}.json",
        help=f"profile JSON to write (default: {PROFILE_NAME}.json in the current directory; give "
             f"{PROFILE_DIR.relative_to(PROFILE_DIR.parents[3])}/{PROFILE_NAME}.json to replace the bundled one)",
    )
    parser.add_argument(
        "--model-dir",
        type=checkpoint_dir,
        default=None,
        help="small demo checkpoint (a directory with config.json); generated into a temp dir if absent",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (thread_cpu needs 1)")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="thread_cpu",
        help="thread_cpu: CPU time of a single-threaded forward (robust on a shared machine); wall: elapsed time",
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of each point; the fastest is fitted")
    parser.add_argument("--passes", type=int, default=2, help="whole measurement passes; the fastest is fitted")
    parser.add_argument("--max-total-token-num", type=int, default=65536, help="KV capacity recorded in the profile")
    return parser


@interruptible("nothing was written")
def main(argv: Optional[List[str]] = None) -> int:
    """CLI entry point; a bad flag, or one given twice, exits with status 2 and a one-line error."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.threads < 1 or args.repeats < 1 or args.passes < 1:
        parser.error("--threads, --repeats and --passes must be >= 1")
    if args.max_total_token_num < 1:
        parser.error(f"--max-total-token-num must be >= 1, got {args.max_total_token_num}")
    if args.clock == "thread_cpu" and args.threads != 1:
        parser.error("--clock thread_cpu measures one thread; use --threads 1 or --clock wall")
    if args.model_dir:
        try:
            window = ModelConfig.from_dir(args.model_dir).sliding_window
        except ModelConfigError as exc:
            parser.error(f"--model-dir {args.model_dir}: {exc}")
        if window is not None and window < MEASURED_LENGTH:
            # The library computes a windowed model exactly only within its window.
            parser.error(f"--model-dir {args.model_dir} has a sliding window of {window} tokens; the measured "
                         f"sequences reach {MEASURED_LENGTH}: give a checkpoint without one or with a longer one")
    torch.set_num_threads(args.threads)
    # The effective settings, not just what was typed, so the fit can be repeated exactly.
    command = (
        f"python -m lightllm.benchmark.simulator.fit_cost_profile --threads {args.threads} --clock {args.clock} "
        f"--repeats {args.repeats} --passes {args.passes} --max-total-token-num {args.max_total_token_num}"
    )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if args.model_dir:
            model_dir = Path(args.model_dir)
        else:
            model_dir = generate_demo_model(tmp, arch="llama", size="small", seed=0)
        samples = measure(model_dir, args.repeats, args.passes, CLOCKS[args.clock])
    provenance = {
        "fit": {
            "command": command,
            "model": "demo llama, size=small, seed=0 (lightllm.utils.demo_model), fp32",
            "torch_threads": args.threads,
            "clock": args.clock,
            "torch_version": torch.__version__,
            "machine": f"{platform.machine()} {platform.processor() or platform.platform()}",
            "repeats": args.repeats,
            "passes": args.passes,
            "method": (
                "fastest of --repeats back-to-back runs per point and of --passes passes, then "
                "non-negative least squares on relative error, per forward kind"
            ),
            "load_average_1m_at_end": round(os.getloadavg()[0], 2),
            "max_total_token_num_note": "chosen, not measured",
            "measure_seconds": round(time.perf_counter() - started, 1),
            "samples": [[kind, list(features), round(seconds, 6)] for kind, features, seconds in samples],
        }
    }
    profile = fit_profile(samples, args.max_total_token_num, provenance)
    # Written before anything is printed, and a failure is one line naming --out (output_writing).
    write_outputs_or_exit(parser, [("--out", args.out, strict_json(profile.to_dict()))])
    print_report("\n".join([
        f"wrote {args.out}",
        f"coefficients: { {k: f'{v:.3e}' for k, v in profile.coefficients().items()} }",
        f"residuals: {profile.provenance['fit']['residuals']}",
    ]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
