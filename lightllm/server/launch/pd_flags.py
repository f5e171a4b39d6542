"""The flags of a prefill/decode-disaggregated cluster: its master and its nodes.

A part of the one argument parser (:mod:`lightllm.server.launch.arg_parser`), kept apart
because only the PD roles read them (the argument checks refuse each one given to a role that
would not use it).
"""

from __future__ import annotations

import argparse

from lightllm.server.launch.flag_bounds import PD_HEARTBEAT_INTERVAL_RANGE, as_written
from lightllm.server.launch.seconds_flags import MAX_WAIT_SECONDS, SECONDS_LIMIT_HELP
from lightllm.server.launch.flag_roles import (
    DECODE_NODES,
    PD_CLUSTER,
    PD_MASTER_ONLY,
    PD_NODES,
    PREFILL_NODES,
    WIRE_PAGE_SIZE,
    add_flag,
)
from lightllm.server.model_rank.rank_config import DEFAULT_RESERVE_LEASE_S
from lightllm.server.pd.transfer_defaults import DEFAULT_PD_KV_PAGE_SIZE, DEFAULT_PD_TRANSFER_TIMEOUT_S
from lightllm.utils.one_line_errors import finite_float


def add_pd_flags(parser: argparse.ArgumentParser) -> None:
    """Add the "PD disaggregation" group to ``parser``."""
    group = parser.add_argument_group("PD disaggregation")
    add_flag(group, "--pd_master_ip", roles=PD_NODES, type=str, default="127.0.0.1", help="Prefill/decode nodes: address of the PD master to register with: an IPv4 or IPv6 address (bracketed or not; a link-local one with its zone naming the interface of this node to dial it through, and then a routable --host, since a wildcard --host would advertise this node's link-local address, which no peer can dial) or a host name.")
    add_flag(group, "--pd_master_port", roles=PD_NODES, type=int, default=1212, help="Prefill/decode nodes: HTTP port of the PD master (the master's own --port).")
    add_flag(group, "--pd_node_id", roles=PD_NODES, type=str, default=None, help="Prefill/decode nodes: this node's unique name in the cluster; default: ROLE-HOST:PORT.")
    add_flag(
        group, "--pd_transfer_port", roles=PREFILL_NODES,
        type=int,
        default=None,
        help="Prefill nodes: TCP port where TP rank r's KV transfer group meets (port + r); default: a free block. "
        "The node binds the whole block at start and holds it until it exits. Decode nodes learn it from the master.",
    )
    add_flag(
        group, "--pd_cluster_key", roles=PD_CLUSTER,
        type=str,
        default=None,
        help="PD master and nodes: the cluster's shared secret. The cluster's own endpoints (every path under /pd/) "
        "then need 'Authorization: Bearer KEY'; nodes send it to the master and the master to the nodes, and "
        "client API keys do not open them. Required on a PD master or node that has --api_key. Default: "
        "LIGHTLLM_PD_CLUSTER_KEY, else those endpoints are open (keep the cluster on a private network).",
    )
    add_flag(group, "--pd_kv_page_size", roles=WIRE_PAGE_SIZE, type=int, default=DEFAULT_PD_KV_PAGE_SIZE, help="Prefill nodes: tokens of KV per page on the prefill -> decode wire; each transfer's header carries it, and a decode node follows the header (the flag is refused there).")
    add_flag(group, "--pd_heartbeat_interval", roles=PD_CLUSTER, type=finite_float, default=2.0, help="PD master: seconds between node heartbeats (sent to nodes at registration), "
             f"{as_written(PD_HEARTBEAT_INTERVAL_RANGE[0])} to {as_written(PD_HEARTBEAT_INTERVAL_RANGE[1])}. Prefill/decode nodes: the pace of their registration retries until the master answers (then they beat at the master's interval).")
    add_flag(group, "--pd_max_missed_heartbeats", roles=PD_MASTER_ONLY, type=int, default=3, help="PD master: a node silent for this many heartbeat intervals is dropped and its requests fail (time the master itself did not run is not counted); nodes count a master that does not answer for two intervals more as lost. Times --pd_heartbeat_interval at most " + f"{as_written(MAX_WAIT_SECONDS)} seconds.")
    add_flag(
        group, "--pd_prefix_affinity_tokens", roles=PD_MASTER_ONLY,
        type=int,
        default=256,
        help="PD master: prompts that agree on this many leading tokens go to the same prefill node (rendezvous "
        "hashing), so its prefix cache keeps paying off, while that node's queue is at most 2048 tokens longer than "
        "the least loaded one's; shorter prompts are only balanced by load. 0: no affinity, load only.",
    )
    add_flag(group, "--pd_reserve_lease_seconds", roles=DECODE_NODES, type=finite_float, default=None, help="Decode nodes: upper bound on the lease of a KV reservation (a reservation whose prompt KV has not started arriving within its lease is freed and its request fails with pd_transfer_failed). Default: no bound; each reservation's lease is the master's (its --pd_prefill_timeout_seconds plus --pd_transfer_timeout_seconds), "
             f"or {as_written(DEFAULT_RESERVE_LEASE_S)} s for a reservation that carries none (formerly the default for every reservation). " + SECONDS_LIMIT_HELP)
    add_flag(group, "--pd_transfer_timeout_seconds", roles=PD_CLUSTER, type=finite_float, default=DEFAULT_PD_TRANSFER_TIMEOUT_S, help="Prefill/decode nodes: bound on every wait of a KV transfer on its peer; a transfer past it fails and the transfer process is replaced. PD master: bound on each node's answer to a transfer setup, and with --pd_prefill_timeout_seconds the lease of a KV reservation. " + SECONDS_LIMIT_HELP)
    add_flag(group, "--pd_prefill_timeout_seconds", roles=PD_MASTER_ONLY, type=finite_float, default=600.0, help="PD master: most seconds from dispatch to the prefill node's first token. " + SECONDS_LIMIT_HELP)
    add_flag(group, "--pd_decode_token_timeout_seconds", roles=PD_MASTER_ONLY, type=finite_float, default=120.0, help="PD master: most seconds between two events of the decode node's stream (the reservation, the first and every later token). " + SECONDS_LIMIT_HELP)
    add_flag(
        group, "--pd_max_segment_tokens", roles=DECODE_NODES,
        type=int,
        default=0,
        help="Decode nodes: end a segment after this many generated tokens, so the master continues the request as a new "
        "segment (prompt + tokens so far, prefilled again on the prefill node); 0: no limit.",
    )
