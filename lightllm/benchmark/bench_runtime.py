"""Model-runtime throughput against transformers ``generate``, side by side in one run.

``python -m lightllm.benchmark.bench_runtime --model_dir DIR [--batch 8 --prompt-len 128
--new-tokens 64 --threads 2 --repeats 3]`` measures prefill and decode tokens/s of our
runtime (batched ragged prefill, then batched decode on the token-slot KV cache) and of
transformers (one batched forward for prefill, ``generate`` for the whole run) on the same
prompts, fp32, and prints a Markdown table (and JSON with ``--json``).
"""

from __future__ import annotations

import os
import json
import statistics
import sys
import time
from typing import Dict, List, Optional

import torch

from lightllm.benchmark.cli_args import OneLineErrorParser, non_negative_int, output_file, sequence_too_long
from lightllm.common.basemodel.batch_generator import BatchGenerator
from lightllm.common.basemodel.model_config import ModelConfig
from lightllm.models.registry import load_model


def _prompts(vocab: int, batch: int, length: int, seed: int) -> List[List[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (length,), generator=gen).tolist() for _ in range(batch)]


def measure_ours(model_dir: str, prompts: List[List[int]], new_tokens: int) -> Dict[str, float]:
    """Prefill seconds (one batched forward) and decode seconds (the remaining steps)."""
    model = load_model(model_dir, dtype=torch.float32)
    runner = BatchGenerator(model, kv_cache_size=len(prompts) * (len(prompts[0]) + new_tokens + 1), max_request_num=len(prompts))
    seqs = [runner.start(p) for p in prompts]
    started = time.perf_counter()
    logits = runner.forward(seqs, [len(p) for p in prompts])
    prefill = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(new_tokens - 1):
        next_ids = logits.argmax(dim=-1).tolist()
        for seq, tok in zip(seqs, next_ids):
            seq.token_ids.append(tok)
        logits = runner.forward(seqs, [1] * len(seqs))
    decode = time.perf_counter() - started
    for seq in seqs:
        runner.release(seq)
    return {"prefill_s": prefill, "decode_s": decode}


def measure_transformers(model_dir: str, prompts: List[List[int]], new_tokens: int) -> Dict[str, float]:
    """Prefill seconds (one batched forward with cache) and decode seconds (generate minus prefill)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        started = time.perf_counter()
        model(ids, use_cache=True)
        prefill = time.perf_counter() - started
        config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        started = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        total = time.perf_counter() - started
    # The two are timed apart; on a busy machine the difference can come out at or below zero,
    # which is no measurement of decode (None: the report prints n/a instead of a rate).
    decode = total - prefill
    return {"prefill_s": prefill, "decode_s": decode if decode > 0 else None}


def run(model_dir: str, batch: int, prompt_len: int, new_tokens: int, repeats: int, seed: int) -> Dict[str, Dict[str, float]]:
    """Median of ``repeats`` runs for each engine (after one warm-up run each)."""
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    prompts = _prompts(vocab, batch, prompt_len, seed)
    results: Dict[str, Dict[str, float]] = {}
    for name, fn in (("lightllm", measure_ours), ("transformers", measure_transformers)):
        fn(model_dir, prompts, new_tokens)  # warm-up
        runs = [fn(model_dir, prompts, new_tokens) for _ in range(repeats)]
        prefill = statistics.median(r["prefill_s"] for r in runs)
        measured = [r["decode_s"] for r in runs if r["decode_s"] is not None]
        decode = statistics.median(measured) if measured else None
        results[name] = {
            "prefill_s": prefill,
            "decode_s": decode,
            "prefill_tokens_per_s": batch * prompt_len / prefill,
            "decode_tokens_per_s": None if decode is None else batch * (new_tokens - 1) / decode,
        }
    return results


def _number(value: Optional[float], spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def to_markdown(results: Dict[str, Dict[str, float]]) -> str:
    """The side-by-side table."""
    lines = ["| engine | prefill tok/s | decode tok/s | prefill s | decode s |", "| --- | --- | --- | --- | --- |"]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['prefill_tokens_per_s']:.0f} | {_number(r['decode_tokens_per_s'], '.0f')} | "
            f"{r['prefill_s']:.4f} | {_number(r['decode_s'], '.3f')} |"
        )
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    """CLI entry point."""
    parser = OneLineErrorParser(prog="python -m lightllm.benchmark.bench_runtime", description=__doc__.splitlines()[0])
    parser.add_argument("--model_dir", required=True, help="local checkpoint directory both engines load (fp32)")
    parser.add_argument("--batch", type=int, default=8, help="prompts run together in every forward (default 8)")
    parser.add_argument("--prompt-len", type=int, default=128,
                        help="tokens of every prompt (random ids); with --new-tokens within the model's context "
                        "(default 128)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt, greedy (default 64)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs per engine after one warm-up run; the median is reported (default 3)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the prompts' token ids, >= 0 (default 0)")
    parser.add_argument("--json", type=output_file, default=None, help="also write the results here (JSON)")
    args = parser.parse_args(argv)
    if min(args.batch, args.prompt_len, args.new_tokens, args.threads, args.repeats) < 1:
        parser.error("--batch, --prompt-len, --new-tokens, --threads and --repeats must be >= 1")
    if not os.path.isfile(os.path.join(args.model_dir, "config.json")):
        parser.error(f"--model_dir must be a local checkpoint directory with a config.json, got {args.model_dir!r}")
    too_long = sequence_too_long(args.model_dir, {"--prompt-len": args.prompt_len, "--new-tokens": args.new_tokens})
    if too_long:
        parser.error(too_long)
    torch.set_num_threads(args.threads)
    results = run(args.model_dir, args.batch, args.prompt_len, args.new_tokens, args.repeats, args.seed)
    print(to_markdown(results))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "torch": torch.__version__, "results": results}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
