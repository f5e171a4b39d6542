"""The flags of ``bench_prefix_affinity`` and every check made on them before a cluster starts.

Each flag is checked where it is parsed (one ``error:`` line naming it, exit 2), and what needs
several flags or the checkpoint right after: a workload the generator refuses or a prompt the
prompt builder cannot make, a request longer than the nodes' context (it ran into a 90 s timeout),
a ``--kv-tokens`` the nodes refuse, a ``--ports`` range too small.  Before these checks a bad value
was a traceback naming a field, or a refusal of the first node, after a cluster had started.
"""

from __future__ import annotations

import argparse
from typing import List, Tuple

from lightllm.benchmark.cli_args import (
    OneLineErrorParser,
    argument_type,
    checkpoint_dir,
    comma_items,
    listen_host,
    output_dir,
    output_file,
    positive_float,
    with_flag_names,
)
from lightllm.benchmark.count_flags import positive_int
from lightllm.benchmark.deployment import ServerSpec
from lightllm.benchmark.port_range import PortRange
from lightllm.benchmark.server_launcher import Topology
from lightllm.benchmark.special_tokens import tokenizer_special_tokens
from lightllm.benchmark.topologies import TOPOLOGIES, make_topology
from lightllm.benchmark.workload_context import check_workloads_fit, servers_context
from lightllm.benchmark.workloads import WorkloadConfig, build_workload

WARMUP_SEED = 1
MEASURED_SEED = 0


def affinity_values(text: str) -> List[int]:
    """``"256,0"`` -> ``[256, 0]``: distinct integers >= 0 (``ValueError``, one line, otherwise)."""
    values = []
    for item in comma_items(text):
        if not item.isdigit():
            raise ValueError(f"must be a comma list of integers >= 0 (0: no affinity), got {item!r} in {text!r}")
        if int(item) in values:
            raise ValueError(f"lists {int(item)} twice in {text!r}: each setting is measured once")
        values.append(int(item))
    return values


def build_parser() -> argparse.ArgumentParser:
    """The command-line flags, each checked as it is parsed."""
    p = OneLineErrorParser(prog="python -m lightllm.benchmark.bench_prefix_affinity",
                           description="Prefix affinity on vs off on a PD cluster: the prefill nodes' prefix-cache "
                           "hit rate and TTFT.")
    p.add_argument("--model_dir", required=True, type=checkpoint_dir,
                   help="local checkpoint directory every node serves")
    p.add_argument("--topology", default="2p1d", choices=sorted(name for name in TOPOLOGIES if name != "normal"),
                   help="PD cluster shape (default 2p1d)")
    p.add_argument("--affinity", type=argument_type(affinity_values), default=[256, 0],
                   help="comma-separated distinct --pd_prefix_affinity_tokens values to compare, each >= 0 "
                   "(0: no affinity; default 256,0)")
    p.add_argument("--kv-tokens", type=positive_int, default=16384,
                   help="--max_total_token_num of every node, at least the nodes' context (default 16384)")
    p.add_argument("--request-rate", type=positive_float, default=3.0, help="requests per second (default 3)")
    p.add_argument("--duration", type=positive_float, default=30.0, help="seconds of measured arrivals (default 30)")
    p.add_argument("--warmup-duration", type=positive_float, default=5.0,
                   help="seconds of unmeasured arrivals first, in another prompt namespace (default 5)")
    p.add_argument("--prefix-groups", type=positive_int, default=4, help="few-shot templates (default 4)")
    p.add_argument("--prefix-tokens", type=positive_int, default=600,
                   help="tokens of a template or of a chat's first turn (default 600)")
    p.add_argument("--short-len", type=positive_int, default=60,
                   help="tokens after a template, and added by each chat turn (default 60)")
    p.add_argument("--output-len", type=positive_int, default=16, help="output tokens of every request (default 16)")
    p.add_argument("--chat-turns", type=positive_int, default=4, help="turns before a chat closes (default 4)")
    p.add_argument("--host", type=listen_host, default="127.0.0.1",
                   help="address every process of the cluster listens on (default 127.0.0.1)")
    p.add_argument("--ports", type=argument_type(PortRange.parse), default=None, metavar="FIRST-LAST",
                   help="take every port the clusters get from this range, each checked free first: each master's "
                   "and node's HTTP port, each prefill node's --pd_transfer_port block and, with --tp above 1, each "
                   "node's --nccl_port; every setting's cluster has ports of its own (default: any free port)")
    p.add_argument("--log-dir", type=output_dir, default="bench_results/prefix_affinity",
                   help="directory of the clusters' logs (created if missing)")
    p.add_argument("--out", type=output_file, default=None, help="JSON file of the results")
    return p


def workload_configs(args: argparse.Namespace) -> Tuple[WorkloadConfig, WorkloadConfig]:
    """The warm-up's and the measured run's shared-prefix workloads."""
    workload = dict(name="shared_prefix", request_rate=args.request_rate, long_fraction=0.0,
                    long_len=args.prefix_tokens, short_len=args.short_len, output_len=args.output_len,
                    prefix_groups=args.prefix_groups, prefix_tokens=args.prefix_tokens, chat_turns=args.chat_turns)
    return (WorkloadConfig(**workload, seed=WARMUP_SEED, duration_s=args.warmup_duration),
            WorkloadConfig(**workload, seed=MEASURED_SEED, duration_s=args.duration))


def cluster_topology(args: argparse.Namespace, affinity: int) -> Topology:
    """The cluster of one ``--affinity`` setting."""
    return make_topology(args.topology, master_args=["--pd_prefix_affinity_tokens", str(affinity)], host=args.host,
                         ports=args.ports)


def node_spec(args: argparse.Namespace) -> ServerSpec:
    """What every node serves."""
    return ServerSpec(model_dir=args.model_dir, strategy="default",
                      extra_args=("--max_total_token_num", str(args.kv_tokens)))


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse (``ValueError`` naming the flags, one line) what a run would fail on after a cluster started."""
    warm, measured = workload_configs(args)
    for cfg, duration_flag in ((warm, "--warmup-duration"), (measured, "--duration")):
        try:
            build_workload(cfg)
        except ValueError as exc:
            raise ValueError(with_flag_names(parser, str(exc), {"duration_s": duration_flag})) from None
    special = tokenizer_special_tokens(args.model_dir)
    if args.prefix_tokens <= special:
        # A chat's first turn is --prefix-tokens long, special tokens included.
        raise ValueError(f"--prefix-tokens must exceed the {special} special token(s) the tokenizer adds, "
                         f"got {args.prefix_tokens}")
    spec = node_spec(args)
    topology = cluster_topology(args, args.affinity[0])
    flags = topology.process_flags(spec)
    try:
        check_workloads_fit(args.model_dir, [measured], [MEASURED_SEED], flags)
        check_workloads_fit(args.model_dir, [warm], [WARMUP_SEED], flags)
    except ValueError as exc:
        raise ValueError(with_flag_names(parser, str(exc))) from None
    limit = servers_context(args.model_dir, flags)
    if limit is not None and args.kv_tokens < limit.tokens:
        raise ValueError(f"--kv-tokens {args.kv_tokens} is fewer than {limit.name} of {limit.tokens} "
                         f"({limit.source}): the nodes refuse a KV cache that cannot hold one request")
    if args.ports is not None:
        settings = f"{len(args.affinity)} --affinity setting{'s' if len(args.affinity) > 1 else ''}"
        args.ports.check_room(len(args.affinity) * topology.ports_needed(spec), f"--topology {args.topology} with "
                              f"{settings}")
