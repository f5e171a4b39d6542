"""Prefix affinity on vs off on a PD cluster: the prefill nodes' prefix-cache hit rate and TTFT.

``python -m lightllm.benchmark.bench_prefix_affinity --model_dir DIR [--topology 2p1d]`` starts
the cluster twice, with the master's ``--pd_prefix_affinity_tokens`` at each value of
``--affinity`` (default ``256,0``), warms it with a few seconds of the same workload in another
prompt namespace, runs a shared-prefix workload (few-shot prompts over a few templates and
multi-turn chats), and reads every prefill node's ``lightllm_prompt_tokens`` and
``lightllm_cached_prompt_tokens`` counters before and after: the hit rate is cached / prompt
tokens over the measured run. Prints one JSON line per setting and writes them to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import httpx

from lightllm.benchmark.cli_args import OneLineErrorParser, output_dir, output_file
from lightllm.benchmark.bench_serving import BenchmarkConfig, run_benchmark
from lightllm.benchmark.deployment import ServerSpec, stop_servers_on_sigterm
from lightllm.benchmark.topologies import TOPOLOGIES, make_topology
from lightllm.benchmark.workloads import WorkloadConfig


def counter_total(metrics_text: str, name: str) -> float:
    """Sum of every series of the Prometheus counter ``name`` (its ``_total`` samples)."""
    pattern = rf"^{re.escape(name)}_total(?:{{[^}}]*}})? (\S+)$"
    return sum(float(match.group(1)) for match in re.finditer(pattern, metrics_text, re.MULTILINE))


def hit_rate(before: Dict[str, Tuple[float, float]], after: Dict[str, Tuple[float, float]]) -> float:
    """Cached / prompt tokens between two readings of (prompt, cached) per node (0 when no prompt)."""
    prompt = sum(after[node][0] - before[node][0] for node in after)
    cached = sum(after[node][1] - before[node][1] for node in after)
    return cached / prompt if prompt else 0.0


def _read(urls: Dict[str, str]) -> Dict[str, Tuple[float, float]]:
    readings = {}
    for node, url in urls.items():
        text = httpx.get(f"{url}/metrics", timeout=10).text
        readings[node] = (counter_total(text, "lightllm_prompt_tokens"), counter_total(text, "lightllm_cached_prompt_tokens"))
    return readings


def build_parser() -> argparse.ArgumentParser:
    """The command-line flags."""
    p = OneLineErrorParser(prog="python -m lightllm.benchmark.bench_prefix_affinity", description=__doc__.split("\n")[0])
    p.add_argument("--model_dir", required=True)
    p.add_argument("--topology", default="2p1d", choices=sorted(name for name in TOPOLOGIES if name != "normal"))
    p.add_argument("--affinity", default="256,0", help="comma-separated --pd_prefix_affinity_tokens values to compare")
    p.add_argument("--kv-tokens", type=int, default=16384)
    p.add_argument("--request-rate", type=float, default=3.0)
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--warmup-duration", type=float, default=5.0)
    p.add_argument("--prefix-groups", type=int, default=4)
    p.add_argument("--prefix-tokens", type=int, default=600)
    p.add_argument("--short-len", type=int, default=60)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--chat-turns", type=int, default=4)
    p.add_argument("--log-dir", type=output_dir, default="bench_results/prefix_affinity",
                   help="directory of the clusters' logs (created if missing)")
    p.add_argument("--out", type=output_file, default=None, help="JSON file of the results")
    return p


def run(args: argparse.Namespace) -> List[dict]:
    """Measure every affinity setting in turn; returns one result per setting."""
    workload = dict(name="shared_prefix", request_rate=args.request_rate, long_fraction=0.0, long_len=args.prefix_tokens,
                    short_len=args.short_len, output_len=args.output_len, prefix_groups=args.prefix_groups,
                    prefix_tokens=args.prefix_tokens, chat_turns=args.chat_turns)
    results = []
    for value in [int(v) for v in args.affinity.split(",")]:
        topology = make_topology(args.topology, master_args=["--pd_prefix_affinity_tokens", str(value)])
        spec = ServerSpec(model_dir=args.model_dir, strategy="default", extra_args=("--max_total_token_num", str(args.kv_tokens)))
        log_dir = Path(args.log_dir) / f"affinity_{value}"
        log_dir.mkdir(parents=True, exist_ok=True)
        cluster = topology.launch(spec, log_dir)
        try:
            common = dict(base_url=cluster.base_url, tokenizer=args.model_dir, show_progress=False)
            warm = WorkloadConfig(**workload, seed=1, duration_s=args.warmup_duration)
            asyncio.run(run_benchmark(BenchmarkConfig(**common, workload=warm, prompt_namespace="warmup")))
            prefills = {name: process.base_url for name, process in cluster.processes.items() if name.startswith("prefill")}
            before = _read(prefills)
            summary = asyncio.run(run_benchmark(BenchmarkConfig(
                **common, workload=WorkloadConfig(**workload, seed=0, duration_s=args.duration))))
            after = _read(prefills)
        finally:
            cluster.stop()
        ttft = summary["overall"]["ttft_ms"]
        result = {"pd_prefix_affinity_tokens": value, "topology": args.topology, "hit_rate": hit_rate(before, after),
                  "per_prefill_node": {node: {"prompt_tokens": after[node][0] - before[node][0],
                                              "cached_tokens": after[node][1] - before[node][1]} for node in after},
                  "ttft_ms_p50": ttft["p50"], "ttft_ms_p95": ttft["p95"], "requests": ttft["count"],
                  "errors": summary["errors"]}
        print(json.dumps(result), flush=True)
        results.append(result)
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point."""
    args = build_parser().parse_args(argv)
    results = run(args)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    stop_servers_on_sigterm()
    sys.exit(main())
