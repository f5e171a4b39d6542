"""``--run_mode pd_master``: start the PD master, one process with no children and no shared memory.

It reads the tokenizer and ``config.json`` of ``--model_dir`` (no weights), keeps the node
registry (``--pd_heartbeat_interval``, ``--pd_max_missed_heartbeats``) with its expiry sweeper,
and serves, on ``--host:--port``, the public API (native and OpenAI) through
:class:`~lightllm.server.pd.master.manager.PdMasterManager` plus the membership endpoints
(``/pd/register``, ``/pd/heartbeat``, ``/pd/deregister``, ``/pd/nodes`` with each node's state, load, in-flight
requests and transfer pairs) and a ``/health`` that is 503 ``pd_not_ready`` until a prefill and a
decode node are alive and serving.  Any number of prefill and decode nodes may register; each
request is placed on a (P, D) pair by load and prefix affinity
(:mod:`lightllm.server.pd.master.node_selector`).  A node is admitted only when it serves the
master's model (its ``model_name`` is one of the master's served names) and agrees with the
other nodes on model, dtype, layers, KV heads, head dim and TP size; a refusal is logged with
every reason.
SIGTERM drains like a normal server (``--graceful_shutdown_seconds``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

from lightllm.common.basemodel.model_config import ModelConfigError
from lightllm.server.launch.arg_parser import flag_names, flags_given, flags_read_by, server_flag_readers
from lightllm.server.launch.checkpoint_checks import check_args_against_checkpoint, generation_default_beyond_context
from lightllm.server.launch.checkpoint_reading import read_checkpoint
from lightllm.server.launch.exit_codes import EXIT_INVALID_CONFIG
from lightllm.server.launch.sizing import resolve_max_req_total_len
from lightllm.server.pd.master.manager import PdMasterManager
from lightllm.server.pd.master.membership_api import membership_router, new_master_id, readiness_router
from lightllm.server.pd.protocol.node_info import NodeInfo
from lightllm.server.pd.master.node_registry import AdmissionCheck, NodeRegistry
from lightllm.server.pd.master.phase_deadlines import PhaseDeadlines
from lightllm.server.run_mode import PD_NODE_MODES, RunMode
from lightllm.server.served_model import ServedModel, served_names
from lightllm.utils.envs_utils import pd_node_busy_retry_timeout_seconds
from lightllm.server.request_defaults import resolve_eos_token_ids
from lightllm.utils.tokenizer_utils import load_tokenizer

if TYPE_CHECKING:
    from lightllm.server.http.transport.front_door import FrontDoor

log = logging.getLogger("lightllm.pd_master")


def node_roles_taking(name: str) -> Tuple[str, ...]:
    """The PD node roles (``prefill``, ``decode``) that read the flag ``name`` (its dest), as its
    declaration says (flag_roles); none for a flag only a normal server reads (``disable_mixed_batches``)."""
    return tuple(role for role in PD_NODE_MODES if role in server_flag_readers()[name])


def _where_it_goes(roles: Tuple[str, ...], count: int) -> str:
    """Where ``count`` flags that ``roles`` take belong, as the refusal says it."""
    them = "it" if count == 1 else "them"
    if roles == (RunMode.PREFILL, RunMode.DECODE):
        return "the prefill and decode nodes"
    if len(roles) == 1:
        other = "decode" if roles[0] == RunMode.PREFILL else "prefill"
        return f"the {roles[0]} nodes (--run_mode {roles[0]}: a {other} node refuses {them})"
    return f"a normal server (--run_mode normal: every PD node refuses {them})"


def check_master_flags(args: argparse.Namespace) -> None:
    """Refuse (``ValueError``, one line) flags of model nodes given to the master.

    The master runs no model: ``--tp``, KV sizing, the prefill-queue strategy, segment limits
    and the like belong on the prefill and decode nodes; silently ignoring them here would hide
    a misconfigured cluster.  The message says which role takes each flag (the prefill-queue
    flags go to the prefill nodes only: a decode node refuses them).
    """
    # Every flag the master does not read configures a model node (flag_roles).
    master_reads = flags_read_by(RunMode.PD_MASTER)
    given = sorted(flags_given(args, [name for name in flag_names(args) if name not in master_reads]))
    if not given:
        return
    by_roles: Dict[Tuple[str, ...], List[str]] = {}
    for name in given:
        by_roles.setdefault(node_roles_taking(name), []).append(f"--{name}")
    one = len(given) == 1
    if len(by_roles) == 1:
        (roles, flags), = by_roles.items()
        where = f"{'it' if one else 'them'} to {_where_it_goes(roles, len(flags))}"
    else:
        # Nodes of both roles first, then one role, then none: the common case leads.
        order = sorted(by_roles, key=lambda roles: -len(roles))
        where = "; ".join(f"{', '.join(by_roles[roles])} to {_where_it_goes(roles, len(by_roles[roles]))}"
                          for roles in order)
    raise ValueError(f"{', '.join(f'--{name}' for name in given)} configure{'s' if one else ''} model nodes and "
                     f"do{'es' if one else ''} nothing on --run_mode pd_master; give {where}")


def build_served_model(args: argparse.Namespace) -> ServedModel:
    """The master's model facts from ``--model_dir`` (tokenizer and config only) and the flags."""
    config, request_defaults = read_checkpoint(args)
    model_name, names = served_names(args.model_dir, args.model_name)
    max_len = resolve_max_req_total_len(args.max_req_total_len, config)
    check_args_against_checkpoint(args, config, max_len)
    beyond = generation_default_beyond_context(request_defaults, args.max_new_tokens_default, max_len)
    if beyond is not None:
        log.warning("%s", beyond)
    return ServedModel(
        model_name=model_name,
        served_model_names=names,
        tokenizer=load_tokenizer(args.model_dir, args.tokenizer_mode),
        vocab_size=config.vocab_size,
        eos_token_ids=resolve_eos_token_ids(args, config),
        max_req_total_len=max_len,
        max_new_tokens_default=args.max_new_tokens_default,
        request_defaults=request_defaults,
        model_path=os.path.abspath(args.model_dir),
    )


def served_model_admission(model: ServedModel) -> AdmissionCheck:
    """A registry admission check: a node must serve one of the master's model names, stop at its EOS
    ids and take requests as long as the master admits."""

    def check(info: NodeInfo) -> List[str]:
        problems = []
        if info.model_name not in model.served_model_names:
            names = ", ".join(repr(name) for name in model.served_model_names)
            problems.append(f"model_name: {info.model_name!r} is not served by this master (it serves {names}; "
                            "give every process the same --model_dir and --model_name)")
        # The nodes decide where generation stops, the master what text it shows for it: they must agree.
        if info.eos_token_ids is not None and sorted(set(info.eos_token_ids)) != sorted(set(model.eos_token_ids)):
            problems.append(f"eos_token_ids: the node stops at {sorted(set(info.eos_token_ids))}, this master at "
                            f"{sorted(set(model.eos_token_ids))} (give every process the same --eos_id, or none)")
        # The master admits requests up to its own limit and places them on any node: a node with a
        # smaller one would refuse, with a 400, requests that are valid for the cluster.
        if info.max_req_total_len is not None and info.max_req_total_len < model.max_req_total_len:
            problems.append(f"max_req_total_len: the node takes at most {info.max_req_total_len} tokens per request, "
                            f"this master admits up to {model.max_req_total_len} (give every process the same "
                            "--max_req_total_len, or none)")
        return problems

    return check


def build_master(args: argparse.Namespace, cluster_key: Optional[str] = None) -> tuple[PdMasterManager, NodeRegistry]:
    """The master's manager and node registry from validated flags (``cluster_key``: see ``AuthPolicy``).

    Reads ``LIGHTLLM_PD_NODE_BUSY_RETRY_TIMEOUT_SECONDS`` (``ValueError``, one line, when invalid).
    """
    model = build_served_model(args)
    registry = NodeRegistry(
        heartbeat_interval_s=args.pd_heartbeat_interval,
        max_missed_heartbeats=args.pd_max_missed_heartbeats,
        admission=served_model_admission(model),
    )
    # Read here, once, before serving: a bad value is a start-up error (exit 2), never a 400 per request.
    deadlines = PhaseDeadlines(prefill_s=args.pd_prefill_timeout_seconds,
                               decode_token_s=args.pd_decode_token_timeout_seconds,
                               busy_retry_s=pd_node_busy_retry_timeout_seconds(),
                               handoff_s=args.pd_transfer_timeout_seconds)
    manager = PdMasterManager(model, registry, deadlines, setup_timeout_s=args.pd_transfer_timeout_seconds,
                              cluster_key=cluster_key, affinity_prefix_tokens=args.pd_prefix_affinity_tokens)
    return manager, registry


def run_pd_master(args: argparse.Namespace, front_door: Optional["FrontDoor"] = None) -> int:
    """Serve as the PD master until stopped; returns the exit code.

    ``front_door``: the bound listening sockets' front door (the launcher opens it before this call).
    """
    # One line per node call would drown the request log lines (each names its request id).
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from lightllm.server.http.server_options import HttpServerOptions
    from lightllm.server.http.transport.uvicorn_config import build_uvicorn_config
    from lightllm.server.http.transport.listen_sockets import display_address

    try:
        check_master_flags(args)
        options = HttpServerOptions.from_args(args)
        manager, registry = build_master(args, options.auth.cluster_key)
    except (ModelConfigError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INVALID_CONFIG
    from lightllm.server.http.app import create_app
    from lightllm.server.http.service.health import SampledReadiness, manager_readiness_refusal
    from lightllm.server.pd.master.membership_api import readiness_problem
    from lightllm.server.launch.supervisor import StopOutsideServing, SupervisedServer, Supervisor, run_uvicorn

    stop = StopOutsideServing()
    membership = membership_router(registry, new_master_id(), has_cluster_key=options.auth.cluster_key is not None,
                                   node_details=manager.node_details,
                                   continuations=manager.continuations_pending)
    routers = [readiness_router(registry, refusal=manager.refusal), membership]
    app = create_app(manager, options, extra_routers=routers)
    supervisor = Supervisor(manager, args.graceful_shutdown_seconds, app.state.preparing)
    readiness = SampledReadiness(lambda: readiness_problem(registry, manager.refusal),  # type: ignore[arg-type, return-value]
                                 immediate=manager_readiness_refusal(manager))
    server = stop.server = SupervisedServer(build_uvicorn_config(app, args, options), supervisor,
                                            front_door=front_door, readiness=readiness)
    if not stop.requested:
        log.info(
            "PD master serving %s on http://%s (max_req_total_len=%d, heartbeat %gs x %d, prefill timeout %gs, "
            "decode token timeout %gs, busy retry %gs)", manager.served.model_name,
            display_address(args.host, args.port), manager.served.max_req_total_len, registry.heartbeat_interval_s,
            registry.max_missed_heartbeats, args.pd_prefill_timeout_seconds, args.pd_decode_token_timeout_seconds,
            manager.deadlines.busy_retry_s,
        )
        run_uvicorn(server)
    interruption = stop.startup_interruption()
    if interruption is not None:
        print(f"error: {interruption}", file=sys.stderr)
    return stop.exit_code(supervisor)
