"""Prefix affinity on vs off on a PD cluster: the prefill nodes' prefix-cache hit rate and TTFT.

``python -m lightllm.benchmark.bench_prefix_affinity --model_dir DIR [--topology 2p1d]`` starts
the cluster twice, with the master's ``--pd_prefix_affinity_tokens`` at each value of
``--affinity`` (default ``256,0``), warms it with a few seconds of the same workload in another
prompt namespace, runs a shared-prefix workload (few-shot prompts over a few templates and
multi-turn chats), and reads every prefill node's ``lightllm_prompt_tokens`` and
``lightllm_cached_prompt_tokens`` counters before and after: the hit rate is cached / prompt
tokens over the measured run. Prints one JSON line per setting and writes them to ``--out``.

Every flag is checked before a cluster starts (:mod:`lightllm.benchmark.prefix_affinity_flags`);
``--ports FIRST-LAST`` confines every port of the clusters to that range.  A failure after a start
is one ``error:`` line (exit 1) once every process is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import httpx

from lightllm.benchmark.serving_run import BenchmarkConfig, run_benchmark
from lightllm.benchmark.deployment import stop_servers_on_sigterm
from lightllm.benchmark.prefix_affinity_flags import (
    build_parser,
    check_args,
    cluster_topology,
    node_spec,
    workload_configs,
)
from lightllm.benchmark.server_process import ServerStartError


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


def run(args: argparse.Namespace) -> List[dict]:
    """Measure every affinity setting in turn; returns one result per setting."""
    warm, measured = workload_configs(args)
    spec = node_spec(args)
    results = []
    for value in args.affinity:
        log_dir = Path(args.log_dir) / f"affinity_{value}"
        log_dir.mkdir(parents=True, exist_ok=True)
        cluster = cluster_topology(args, value).launch(spec, log_dir)
        try:
            common = dict(base_url=cluster.base_url, tokenizer=args.model_dir, show_progress=False)
            asyncio.run(run_benchmark(BenchmarkConfig(**common, workload=warm, prompt_namespace="warmup")))
            prefills = {name: process.base_url for name, process in cluster.processes.items()
                        if name.startswith("prefill")}
            before = _read(prefills)
            summary = asyncio.run(run_benchmark(BenchmarkConfig(**common, workload=measured)))
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
    """Command-line entry point: 0 after every setting ran, 1 when a cluster failed, 2 for a refused flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_args(parser, args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.ports is not None and args.ports.ephemeral_overlap_warning():
        print(args.ports.ephemeral_overlap_warning(), file=sys.stderr)
    try:
        results = run(args)
    except (ServerStartError, TimeoutError, httpx.HTTPError) as exc:
        # Every cluster is stopped by now; the first line of a start failure names the node's log.
        print(f"error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted; every server it started was stopped", file=sys.stderr)
        return 128 + signal.SIGINT
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    stop_servers_on_sigterm()
    sys.exit(main())
