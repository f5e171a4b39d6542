"""What a PD prefill or decode node adds to the normal server start.

A node is a normal process tree (HTTP + router + detokenizer + ranks, with the run mode's
backend) plus:

* a KV transfer port resolved once before any process starts (``--pd_transfer_port``, or a free
  block of ``--tp`` ports; TP rank r uses port + r), stored back on ``args`` so the rank configs
  and the registration agree; a prefill node binds the whole block then and holds it for its
  lifetime (:mod:`lightllm.server.pd.node.transfer_ports`);
* its :class:`~lightllm.server.pd.protocol.node_info.NodeInfo`;
* a :class:`~lightllm.server.pd.node.service.PdNodeService` composed around the HTTP process's
  request manager: it owns the node's PD state (transfer epoch, PD request streams) and receives
  rank 0's PD messages through the manager's inbox-handler hook;
* the control endpoints (:func:`~lightllm.server.pd.node.api.pd_node_router`, calling the
  service) and the refusal of public generation, mounted through
  ``create_app(..., extra_routers=...)``;
* a :class:`~lightllm.server.pd.node.registration_client.PdNodeClient` on the server's
  event loop, started once uvicorn listens (the master calls the node back right after it
  registers).  A master that refuses the node stops it with exit code 1 and a one-line error;
  a master that stops answering fails the node's open PD streams (their requests are aborted and
  their KV freed) while the client keeps trying to register again.  Every registration and
  heartbeat carries the node's load and state (:func:`node_report`).
* draining: the first SIGTERM/SIGINT sets the node's state to ``"draining"`` and sends a
  heartbeat at once, so the master places nothing new here; new PD requests are answered busy
  while the held ones finish within ``--graceful_shutdown_seconds``, then the node exits as any
  server does (:mod:`lightllm.server.launch.supervisor`).  Continuation segments of generations
  already streaming are still taken (the master sends them here only when no serving node of
  the role is left), and the drain also waits until the master's heartbeat answer says none may
  still come (``continuations_pending`` 0), within the same period.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
import sys
from pathlib import Path
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

from fastapi import APIRouter, FastAPI

from lightllm.common.basemodel.model_config import ModelConfig
from lightllm.common.basemodel.checkpoint_fingerprint import checkpoint_fingerprint
from lightllm.server.request_defaults import resolve_eos_token_ids
from lightllm.server.argument_error import ArgumentError
from lightllm.server.launch.args_check import advertised_http_address
from lightllm.server.launch.exit_codes import EXIT_FAILED
from lightllm.server.launch.flag_bounds import PORT_RANGE
from lightllm.utils.host_names import bare_host, url_host
from lightllm.server.pd.protocol.host_port import format_host_port
from lightllm.server.pd.protocol.membership import LOAD_KEY, STATE_KEY
from lightllm.server.pd.protocol.node_info import NodeInfo
from lightllm.server.pd.node.registration_client import PdNodeClient
from lightllm.server.pd.node.api import pd_node_router, public_api_refusal_router
from lightllm.server.pd.node.open_streams import PdStreams
from lightllm.server.pd.node.service import PdNodeService
from lightllm.server.pd.node.transfer_ports import TransferPortBlock
from lightllm.server.launch.plan import pd_rank_settings
from lightllm.server.launch.sizing import ServerSizing
from lightllm.server.run_mode import RunMode
from lightllm.utils.wildcard_hosts import bind_host, is_wildcard

log = logging.getLogger(__name__)

_SERVING_POLL_SECONDS = 0.05


def advertised_host(args: argparse.Namespace) -> str:
    """The host the master and the peer node reach this node at (bare: an IPv6 address without brackets).

    ``--host`` unless it is a wildcard; then the local address of the route to the master, in
    the master's address family: an IPv6 master (``::1``, or a name resolving only to IPv6) is
    reached from an IPv6 address, which an IPv4 probe socket cannot even try.  ``0.0.0.0`` (and
    the empty host, whose transfer ports bind ``0.0.0.0``) listens on IPv4 only, so only an IPv4
    route is asked for there; ``::`` listens on both (a dual-stack socket), so either family is.
    The caller writes the address in the contract's form (:func:`format_host_port` brackets IPv6).
    """
    if not is_wildcard(args.host):
        return args.host
    master = bare_host(args.pd_master_ip)
    ipv4_only = ":" not in bind_host(args.host)
    family = socket.AF_INET if ipv4_only else socket.AF_UNSPEC
    try:
        # A host name may resolve to either family: the first answer is the one a client of the
        # master would use (getaddrinfo's order), so the route probed is the one it would take.
        found, _, _, _, address = socket.getaddrinfo(master, args.pd_master_port, family, socket.SOCK_DGRAM)[0]
        with socket.socket(found, socket.SOCK_DGRAM) as probe:
            # A UDP "connect" sends nothing; it only picks the interface that routes to the master.
            probe.connect(address)
            return probe.getsockname()[0]
    except OSError as exc:  # socket.gaierror included: a name that does not resolve (in this family)
        where = "every IPv4 interface" if ipv4_only else "every interface"
        other = " (or --host ::, which listens on IPv6 too)" if ipv4_only else ""
        raise ArgumentError(
            f"--host {args.host!r} listens on {where} and no route to --pd_master_ip {args.pd_master_ip!r} "
            f"tells which address to advertise ({exc}); pass --host with this node's address{other}"
        ) from None


def prepare_pd_node(
    args: argparse.Namespace, model_config: ModelConfig, sizing: ServerSizing
) -> Tuple[NodeInfo, Optional[TransferPortBlock]]:
    """Resolve a prefill node's KV transfer port (stored on ``args``) and build this node's registration.

    Called before any process starts, so the rank configs read the same port.  A prefill node
    gets its bound port block too (the caller holds it until the node exits) and advertises it;
    a decode node hosts no transfer group (its ranks join the prefill node's), so it advertises
    no transfer address.  Raises ``ArgumentError`` / ``NodeInfoError`` (one line) for settings
    that cannot work.
    """
    host = advertised_host(args)
    # Written before the PD ports are bound: a host the master could not read back fails here.
    http_address = advertised_http_address(args, host)
    ports: Optional[TransferPortBlock] = None
    transfer_address = ""
    if args.run_mode == RunMode.PREFILL:
        if args.pd_transfer_port is not None:
            if args.pd_transfer_port + args.tp - 1 > PORT_RANGE[1]:
                raise ArgumentError(f"--pd_transfer_port {args.pd_transfer_port} leaves no room for {args.tp} TP "
                                    "ranks (rank r uses port + r)")
            block = range(args.pd_transfer_port, args.pd_transfer_port + args.tp)
            if args.port in block:
                raise ArgumentError(f"--pd_transfer_port {args.pd_transfer_port} overlaps the HTTP --port {args.port}")
            if args.tp > 1 and args.nccl_port in block:
                raise ArgumentError(f"--pd_transfer_port {args.pd_transfer_port} overlaps --nccl_port {args.nccl_port} "
                                    f"(the TP rendezvous; rank r's KV transfer uses port + r, {block.start}.."
                                    f"{block.stop - 1})")
        rendezvous = args.nccl_port if args.tp > 1 else None
        ports = TransferPortBlock.reserve(args.host, args.tp, args.pd_transfer_port, avoid=(args.port, rendezvous))
        args.pd_transfer_port = ports.base
        transfer_address = format_host_port(host, ports.base)
    role = args.run_mode
    # The first served name, as the HTTP side reports it (build_process_configs uses the same rule).
    model_name = args.model_name[0] if args.model_name else Path(args.model_dir.rstrip("/")).name
    return NodeInfo(
        # The bare host: NODE_ID_PATTERN has no brackets ("decode-fd00::1:8100").
        node_id=args.pd_node_id or f"{role}-{bare_host(host)}:{args.port}",
        role=role,
        model_name=model_name,
        dtype=sizing.dtype_name,
        num_layers=model_config.num_hidden_layers,
        num_kv_heads=model_config.num_key_value_heads,
        head_dim=model_config.head_dim,
        tp_size=args.tp,
        http_address=http_address,
        kv_transfer_address=transfer_address,
        checkpoint_fingerprint=checkpoint_fingerprint(args.model_dir),
        eos_token_ids=resolve_eos_token_ids(args, model_config),
        max_req_total_len=sizing.max_req_total_len,
        logprobs_mode=args.logprobs_mode,
        request_slots=sizing.slot_num,
        top_logprob_slots=sizing.top_slot_num,
    ), ports


def node_report(service: PdNodeService, stats: Any) -> Dict[str, Any]:
    """A node's ``"load"`` and ``"state"`` as its heartbeats carry them.

    KV numbers come from rank 0's shared counters (``stats``, a
    :class:`~lightllm.server.core.objs.shm_stats.ShmStats`; None: zeros): free KV is what a new
    request could be given, free slots plus prefix-cache slots it can evict
    (``kv_allocatable_tokens``) less what a decode node promised its reservations
    (``kv_promised_tokens``); the capacity is ``kv_total_tokens``.  The request numbers and the
    state come from the PD service, which sees every request the node takes (a PD node serves
    no other).
    """
    free_kv = stats.get("kv_allocatable_tokens") - stats.get("kv_promised_tokens") if stats is not None else 0
    capacity = stats.get("kv_total_tokens") if stats is not None else 0
    return {
        LOAD_KEY: {
            "queued_prefill_tokens": service.queued_prefill_tokens,
            "running_requests": service.running_requests,
            # Written at different moments by different writers: keep the pair consistent.
            "free_kv_tokens": max(0, min(free_kv, capacity)),
            "kv_capacity_tokens": max(0, capacity),
        },
        STATE_KEY: service.state,
    }


class PdNodeRuntime:
    """A running node's PD parts: its service, routes, master client and their reactions.

    Args:
        args: the parsed flags (``--pd_master_ip``, ``--pd_master_port``, ``--pd_heartbeat_interval``,
            and the transfer timeouts that bound a transfer setup).
        info: this node's registration (:func:`prepare_pd_node`).
        manager: the node's ``HttpServerManager`` (the service's
            :class:`~lightllm.server.pd.node.host_contract.PdNodeHost`).
        rank0_address: model rank 0's inbox, where the service sends transfer setups.
        cluster_key: the cluster's key (``AuthPolicy.cluster_key``), sent to the master.
    """

    def __init__(self, args: argparse.Namespace, info: NodeInfo, manager: Any, rank0_address: str,
                 cluster_key: Optional[str] = None) -> None:
        self.info = info
        self.cluster_key = cluster_key
        self.manager = manager
        # A setup waits for rank 0 as long as a rank may take to open its transfer group.
        self.service = PdNodeService(manager, info.role, pd_rank_settings(args).connect_timeout_s, rank0_address)
        if args.log_level != "debug":
            # httpx logs every request at INFO: one line per heartbeat would drown the node's log.
            logging.getLogger("httpx").setLevel(logging.WARNING)
        self.master_url = f"http://{url_host(bare_host(args.pd_master_ip))}:{args.pd_master_port}"
        self.heartbeat_interval_s = args.pd_heartbeat_interval
        self.streams = PdStreams()
        self.refusal: Optional[str] = None
        self.client: Optional[PdNodeClient] = None
        self._server: Any = None
        self._supervisor: Any = None
        self._starter: Optional[asyncio.Task] = None

    def routers(self) -> List[APIRouter]:
        """The routers to pass to ``create_app`` (before the public API)."""
        master = f"{self.master_url.removeprefix('http://')}"
        return [pd_node_router(self.service, self.info.role, self.streams),
                public_api_refusal_router(self.info.role, master)]

    def attach(self, app: FastAPI, server: Any, supervisor: Any) -> None:
        """Run the service and the master client inside ``app``'s lifespan (the client once
        ``server``, uvicorn, listens); ``supervisor``'s first stop signal starts the drain."""
        self._server = server
        self._supervisor = supervisor
        if supervisor is not None:
            supervisor.add_stop_listener(self.start_draining)
            supervisor.add_drain_hold(self.continuations_may_come)
        inner = app.router.lifespan_context

        @contextlib.asynccontextmanager
        async def lifespan(app_: FastAPI) -> AsyncIterator[Any]:
            async with inner(app_) as state:
                self.service.start()
                self._starter = asyncio.get_running_loop().create_task(self._start_client(), name="pd-node-start")
                try:
                    yield state
                finally:
                    await self._stop_client()
                    self.service.stop()

        app.router.lifespan_context = lifespan

    async def _start_client(self) -> None:
        while not getattr(self._server, "started", True):
            await asyncio.sleep(_SERVING_POLL_SECONDS)
        self.client = PdNodeClient(
            self.master_url,
            self.info,
            heartbeat_interval_s=self.heartbeat_interval_s,
            on_master_lost=self.master_lost,
            on_master_back=self.master_back,
            on_refused=self.refused,
            on_master_forgot=self.master_forgot,
            cluster_key=self.cluster_key,
            report=self.report,
        )
        log.info("%s: registering with the PD master at %s", self.info.describe(), self.master_url)
        self.client.start()

    async def _stop_client(self) -> None:
        if self._starter is not None:
            self._starter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._starter
        if self.client is not None:
            # The lifespan ends only when the server stops: the node leaves the cluster for good.
            await self.client.stop(leave=True)

    # --- what the node tells the master --------------------------------------------------------
    def report(self) -> Dict[str, Any]:
        """The ``"load"`` and ``"state"`` fields of the next registration or heartbeat."""
        return node_report(self.service, getattr(self.manager, "stats", None))

    def start_draining(self) -> None:
        """The node is stopping: refuse new PD requests and tell the master now (on the event loop)."""
        self.service.start_draining()
        log.info("%s: draining; telling the PD master", self.info.describe())
        if self.client is not None:
            self.client.beat_now()

    def continuations_may_come(self) -> bool:
        """The drain hold: the master may still send this draining node a continuation segment."""
        return self.service.draining and self.client is not None and self.client.continuations_may_come()

    # --- the master client's callbacks (on the event loop) ---------------------------------------
    def master_lost(self, reason: str) -> None:
        """Fail every open PD stream: the master that would read it is gone."""
        failed = self.streams.fail_all(f"PD request ended: {reason}")
        log.error("%s: PD master lost; ended %d open PD request(s)", self.info.describe(), failed)

    async def master_forgot(self, message: str) -> None:
        """The master no longer knows this node (it dropped it, or restarted): end what that membership held.

        The master failed this node's requests and tore its pairs down on their peers when it
        dropped it (a node that hung longer than the heartbeat bound and then resumed finds out
        here).  Their streams end now, and every transfer pair is torn down, so reservations
        and KV held for requests the master already failed are freed at once instead of at
        their leases, before the node registers again and gets new pairs.
        """
        failed = self.streams.fail_all(f"PD request ended: the PD master no longer knows this node ({message})")
        epochs = await self.service.teardown_all()
        log.warning("%s: the PD master no longer knows this node; ended %d open PD request(s) and tore down "
                    "%d transfer pair(s) (epochs %s) before registering again", self.info.describe(), failed,
                    len(epochs), epochs)

    def master_back(self) -> None:
        """The master answers again (the client registers again if it forgot the node)."""
        log.info("%s: PD master %s answers again", self.info.describe(), self.master_url)

    def refused(self, message: str) -> None:
        """The master refused the node: stop serving and exit non-zero with a one-line error."""
        self.refusal = message
        self.streams.fail_all(f"the PD master refused this node: {message}")
        print(f"error: the PD master at {self.master_url} refused {self.info.describe()}: {message}",
              file=sys.stderr, flush=True)
        if self._supervisor is not None:
            # A node the master refused exits as any other failed start does.
            self._supervisor.exit_code = EXIT_FAILED
        if self._server is not None:
            self._server.should_exit = True
