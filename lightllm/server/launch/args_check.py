"""Checks on the parsed flags: settings that cannot work together end in one line.

The start-up code calls :func:`validate_args` on what :func:`~lightllm.server.launch.arg_parser.make_argument_parser`
parsed; every refusal is an :class:`ArgumentError` whose message names the flag.
"""

from __future__ import annotations

import argparse
import math
import re
from typing import Optional

from lightllm.server.argument_error import ArgumentError
from lightllm.server.launch.arg_parser import flags_given
from lightllm.server.launch.flag_bounds import (
    MAX_PD_KV_PAGE_SIZE,
    MAX_PROMPT_CHARS_PER_TOKEN,
    MAX_RESERVED_MEMORY_GB,
    MAX_ROUTER_MAX_WAIT_TOKENS,
    MAX_ROUTER_TOKEN_RATIO,
    MAX_SCHEDULE_TIME_INTERVAL,
    MIN_REQUEST_BODY_BYTES,
    MIN_SCHEDULE_TIME_INTERVAL,
    PD_HEARTBEAT_INTERVAL_RANGE,
    PORT_RANGE,
)
from lightllm.server.launch.flag_combinations import check_flag_combinations
from lightllm.utils.host_names import host_problem
from lightllm.utils.wildcard_hosts import is_wildcard
from lightllm.server.pd.protocol.host_port import HostPortError, format_host_port
from lightllm.server.launch.role_refusals import refuse_flags_not_read
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound import (
    MAX_PREFILL_OVERTAKE_FRACTION,
    MAX_PREFILL_OVERTAKE_TOKENS,
)
from lightllm.server.launch.seconds_flags import check_seconds_flags
from lightllm.server.launch.watchdog import MIN_WATCHDOG_TIMEOUT_SECONDS
from lightllm.server.run_mode import PD_NODE_MODES, PD_RUN_MODES, RunMode
from lightllm.utils.envs_utils import key_character_problem, numbered_key
from lightllm.server.pd.protocol.node_info import NODE_ID_PATTERN


# A browser origin as its Origin header spells it.
_ORIGIN = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s:]+(:[0-9]{1,5})?$")


def _check_port(name: str, value: Optional[int]) -> None:
    """Refuse ``--name`` outside :data:`PORT_RANGE` (None: not given, nothing to check)."""
    low, high = PORT_RANGE
    if value is not None and not low <= value <= high:
        raise ArgumentError(f"--{name} must be in {low}..{high}, got {value}")


def _check_pd_flag_roles(args: argparse.Namespace) -> None:
    """Refuse flags given to a role that does not read them, then a PD process's bad master address or node id."""
    refuse_flags_not_read(args)
    run_mode = args.run_mode
    if run_mode not in PD_RUN_MODES:
        return
    if run_mode in PD_NODE_MODES:
        # The node dials the master itself, so a zone (fe80::1%eth0) names one of its own interfaces.
        problem = host_problem(args.pd_master_ip, allow_zone=True)
        if problem:
            raise ArgumentError(f"--pd_master_ip {args.pd_master_ip!r}: {problem}")
    node_id = args.pd_node_id
    if node_id is not None and not NODE_ID_PATTERN.fullmatch(node_id):
        raise ArgumentError("--pd_node_id must be 1-128 characters of letters, digits and '._:-' starting with a "
                            f"letter or digit, got {node_id!r}")


def _validate_pd_args(args: argparse.Namespace) -> None:
    for name in ("pd_master_port", "pd_transfer_port"):
        _check_port(name, getattr(args, name))
    # Refused here, before the role checks, in words of its own; the master refuses every node
    # flag itself, naming the role that takes it (pd_master.py).
    if args.pd_transfer_port is not None and args.run_mode == RunMode.DECODE:
        raise ArgumentError("--pd_transfer_port is for prefill nodes (--run_mode prefill); a decode node joins the "
                            "port the master gives it")
    for name in ("pd_kv_page_size", "pd_max_missed_heartbeats"):
        if getattr(args, name) <= 0:
            raise ArgumentError(f"--{name} must be positive, got {getattr(args, name)}")
    if args.pd_kv_page_size > MAX_PD_KV_PAGE_SIZE:
        raise ArgumentError(f"--pd_kv_page_size must be at most {MAX_PD_KV_PAGE_SIZE} tokens, got {args.pd_kv_page_size}")
    for name in ("pd_heartbeat_interval", "pd_reserve_lease_seconds", "pd_transfer_timeout_seconds",
                 "pd_prefill_timeout_seconds", "pd_decode_token_timeout_seconds"):
        value = getattr(args, name)
        if value is not None and not 0 < value < float("inf"):
            raise ArgumentError(f"--{name} must be a positive, finite number of seconds, got {value}")
    low, high = PD_HEARTBEAT_INTERVAL_RANGE
    if not low <= args.pd_heartbeat_interval <= high:
        raise ArgumentError(f"--pd_heartbeat_interval must be {low:g} to {high:g} seconds, got "
                            f"{args.pd_heartbeat_interval!r} (shorter drops healthy nodes whose heartbeat is late; "
                            "longer leaves a dead node unnoticed for minutes)")
    if args.pd_prefix_affinity_tokens < 0:
        raise ArgumentError(f"--pd_prefix_affinity_tokens must be >= 0 (0: no affinity), got {args.pd_prefix_affinity_tokens}")
    if args.pd_max_segment_tokens < 0:
        raise ArgumentError(f"--pd_max_segment_tokens must be >= 0 (0: no limit), got {args.pd_max_segment_tokens}")
    key = args.pd_cluster_key
    if key is not None:
        if args.run_mode not in PD_RUN_MODES:
            raise ArgumentError("--pd_cluster_key is for PD clusters: give it with --run_mode pd_master, prefill or decode")
        if not key.strip() or key != key.strip():
            raise ArgumentError("--pd_cluster_key must be non-empty and carry no surrounding whitespace")
        problem = key_character_problem(key, ascii_only=True)
        if problem is not None:
            raise ArgumentError(f"--pd_cluster_key: {problem}")
    _check_pd_flag_roles(args)


def advertised_http_address(args: argparse.Namespace, host: str) -> str:
    """The ``host:port`` a PD node registers as its HTTP endpoint: ``host`` (what it advertises,
    :func:`~lightllm.server.launch.pd_node.advertised_host`) and ``--port``.

    Raises :class:`ArgumentError` naming ``--host`` for a host the master could not use.
    """
    try:
        return format_host_port(host, args.port)
    except HostPortError as exc:
        # A wildcard --host advertises the address of its route to the master, which for a
        # link-local master is link-local too: only a --host naming the address helps there.
        fix = (f" (--host {args.host} advertises the address its route to --pd_master_ip leaves from; pass --host "
               "with a routable address of this node)" if is_wildcard(args.host) else "")
        raise ArgumentError(f"--host {args.host!r}: this node would advertise its address as {host!r}, which "
                            f"the master cannot use: {exc}{fix}") from None


def _validate_advertised_host(args: argparse.Namespace) -> None:
    """A PD node advertises a --host that is no wildcard as given: one the master cannot use is refused here.

    Checked again once a wildcard is resolved (pd_node.prepare_pd_node); here, a link-local
    --host failed at the bind first (EINVAL, "is another server running on this port?"), and one
    with a zone only after the model's config was read.
    """
    if args.run_mode in PD_NODE_MODES and not is_wildcard(args.host):
        advertised_http_address(args, args.host)


def _validate_http_args(args: argparse.Namespace) -> None:
    if not args.host.strip():
        # "--host $HOST" with HOST unset listened on every interface.  Anything else is left to the
        # bind, which names what it cannot listen on (a name /etc/hosts knows need not be RFC 1123).
        raise ArgumentError(f"--host {args.host!r} is empty: give an address or host name to listen on (0.0.0.0 or "
                            ":: listens on every interface)")
    if any(mark in args.host for mark in "[]:%"):
        # The listener strips one pair of brackets, so "[1.2.3.4]" served, while a PD node stopped
        # saying it "would advertise" a host the master cannot use: refused alike for every role.
        # No host name has ':' or '%', so an IPv6 address (and its zone) is read by the flags' rule
        # bracketed or not: "fe80::1%25eth0" got "cannot resolve it", not the %25 hint.
        # A PD node advertises a --host that is no wildcard as given, where no zone is taken: a
        # zone there is _validate_advertised_host's to refuse (the %25 hint here named a zone that
        # was refused next).
        advertised = args.run_mode in PD_NODE_MODES and not is_wildcard(args.host)
        problem = None if advertised and "%" in args.host else host_problem(args.host, allow_zone=True)
        if problem:
            raise ArgumentError(f"--host {args.host!r}: {problem} (only an IPv6 address goes in brackets, as [::1])"
                                if problem == "unbalanced brackets" else f"--host {args.host!r}: {problem}")
    for name in ("max_request_body_bytes", "http_max_connections"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ArgumentError(f"--{name} must be positive, got {value}")
    origins = args.allowed_origins
    if "*" in origins and len(origins) > 1:
        raise ArgumentError("--allowed_origins: '*' already allows every origin; give it alone or list origins")
    for origin in origins:
        if origin != "*" and not _ORIGIN.fullmatch(origin):
            raise ArgumentError(f"--allowed_origins: {origin!r} is not an origin (scheme://host[:port], no path or "
                                "trailing slash, e.g. https://app.example.com)")
    body_limit = args.max_request_body_bytes
    if body_limit is not None and body_limit < MIN_REQUEST_BODY_BYTES:
        # Below this every real request (a model name, a prompt, a few parameters) gets 413.
        raise ArgumentError(f"--max_request_body_bytes must be at least {MIN_REQUEST_BODY_BYTES}, got {body_limit}")
    per_client = args.http_max_connections_per_client
    if per_client is not None and not 0 < per_client <= args.http_max_connections:
        raise ArgumentError(f"--http_max_connections_per_client must be in 1..--http_max_connections "
                            f"({args.http_max_connections}), got {per_client}")
    if args.http_max_preparing_per_client < 0:
        raise ArgumentError(f"--http_max_preparing_per_client must be >= 0 (0: no limit), got "
                            f"{args.http_max_preparing_per_client}")
    for name in ("http_header_timeout", "http_body_timeout", "http_keep_alive_timeout", "http_send_timeout"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ArgumentError(f"--{name} must be a positive number of seconds, got {value}")
    if not 0 < args.slot_wait_seconds < float("inf"):
        raise ArgumentError("--slot_wait_seconds must be a positive, finite number of seconds, "
                            f"got {args.slot_wait_seconds}")
    chars = args.prompt_chars_per_token
    if chars is not None and not (chars == 0 or 1 <= chars <= MAX_PROMPT_CHARS_PER_TOKEN):
        # A token stands for at least one character: below 1 the check refuses prompts that fit.
        raise ArgumentError(f"--prompt_chars_per_token must be 0 (the check off) or in [1, "
                            f"{MAX_PROMPT_CHARS_PER_TOKEN:g}] (every token is at least one character), got {chars}")
    for name in ("api_key", "admin_api_key"):
        keys = getattr(args, name) or ()
        for index, key in enumerate(keys, 1):
            if not key.strip() or key != key.strip():
                raise ArgumentError(f"--{name} values must be non-empty and carry no surrounding whitespace")
            if "," in key:
                # The environment variable's value is split at commas; the flag takes keys as separate
                # words, so a copied variable value would become one key no client sends.
                raise ArgumentError(f"--{name} values hold one key each: give several as separate words "
                                    f"(--{name} KEY1 KEY2), not one comma-separated value")
            problem = key_character_problem(key)
            if problem is not None:
                raise ArgumentError(f"--{name} ({numbered_key(index, len(keys))}): {problem}")
    for model_name in args.model_name or ():
        # A blank id served '' (/v1/models listed it, every request naming the model was a 404).
        if not model_name.strip() or model_name != model_name.strip():
            raise ArgumentError(f"--model_name values must be non-empty and carry no surrounding whitespace, "
                                f"got {model_name!r}")


def validate_device_args(args: argparse.Namespace, cuda_device_count: int) -> None:
    """Raise :class:`ArgumentError` (one line) when ``--device``/``--tp`` ask for more GPUs than are visible.

    Separate from the other checks because the count comes from the device probe
    (:mod:`lightllm.server.launch.device_probe`), which the launcher asks only after the flags passed.
    """
    if args.device in ("auto", "cuda") and cuda_device_count > 0 and args.tp > cuda_device_count:
        raise ArgumentError(f"--tp {args.tp} needs {args.tp} GPUs but only {cuda_device_count} are visible")
    if args.device == "cuda" and cuda_device_count == 0:
        raise ArgumentError("--device cuda was given but no CUDA device is visible")


def chunked_prefill_size_for(args: argparse.Namespace) -> Optional[int]:
    """The ``--chunked_prefill_size`` the server uses: the flag's value, except that a default chunk
    above ``--batch_max_tokens`` follows the budget down.

    Users of vLLM and LightLLM set the step budget alone: the default chunk follows it down rather
    than refusing a flag they never typed. A chunk the user typed is kept (and refused when too large).
    """
    if (args.batch_max_tokens is not None and not args.disable_chunked_prefill
            and args.chunked_prefill_size > args.batch_max_tokens and not flags_given(args, ["chunked_prefill_size"])):
        return args.batch_max_tokens
    return args.chunked_prefill_size


def resolve_args(args: argparse.Namespace) -> None:
    """Write into ``args`` the values its flags imply but do not hold (:func:`chunked_prefill_size_for`).

    The start-up code calls it after :func:`validate_args`, which checks the same values and writes
    nothing; what reads ``args`` afterwards (the sizing, every process's config) sees them resolved.
    """
    args.chunked_prefill_size = chunked_prefill_size_for(args)


def _validate_sizes(args: argparse.Namespace) -> None:
    """Refuse a non-positive size, a ``--max_req_total_len`` with no room for a completion, a memory
    share outside its range and a ``--reserved_memory_gb`` outside its range."""
    for name in ("tp", "running_max_req_size", "chunked_prefill_size"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise ArgumentError(f"--{name} must be positive, got {getattr(args, name)}")
    for name in ("max_total_token_num", "max_req_total_len", "batch_max_tokens", "top_logprobs_slots"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ArgumentError(f"--{name} must be positive, got {value}")
    if args.max_req_total_len == 1:
        raise ArgumentError("--max_req_total_len 1 leaves no room for a completion beside a one-token prompt; "
                            "give at least 2")
    if not 0 < args.mem_fraction <= 1:
        raise ArgumentError(f"--mem_fraction must be in (0, 1], got {args.mem_fraction}")
    if args.reserved_memory_gb is not None and not 0 <= args.reserved_memory_gb <= MAX_RESERVED_MEMORY_GB:
        raise ArgumentError(f"--reserved_memory_gb must be in [0, {MAX_RESERVED_MEMORY_GB:g}] GiB, got "
                            f"{args.reserved_memory_gb}")


def _validate_sampling_seed(args: argparse.Namespace) -> None:
    """Refuse a ``--sampling_seed`` outside the unsigned 64-bit range."""
    seed = args.sampling_seed
    if seed is not None and not 0 <= seed < 2**64:
        raise ArgumentError(f"--sampling_seed must be in [0, 2**64), got {seed}")


def _validate_overtake_bound(args: argparse.Namespace) -> None:
    """Refuse the replaced ``--prefill_max_wait_tokens`` and an overtaking bound outside what rank 0 can publish."""
    if args.prefill_max_wait_tokens is not None:
        raise ArgumentError(
            "--prefill_max_wait_tokens was replaced by the overtaking bound: use --prefill_max_overtake_tokens and "
            "--prefill_overtake_fraction (or --disable_prefill_overtake_bound)"
        )
    # Upper limits too: rank 0 publishes both to the int64 stats block (the fraction in millionths),
    # and a value past them would pass here and crash rank 0 after the model loaded.
    if args.prefill_max_overtake_tokens < 0:
        raise ArgumentError(f"--prefill_max_overtake_tokens must be >= 0, got {args.prefill_max_overtake_tokens}")
    if args.prefill_max_overtake_tokens > MAX_PREFILL_OVERTAKE_TOKENS:
        raise ArgumentError(f"--prefill_max_overtake_tokens must be at most {MAX_PREFILL_OVERTAKE_TOKENS:,} "
                            f"(for no bound use --disable_prefill_overtake_bound), got {args.prefill_max_overtake_tokens}")
    if not (math.isfinite(args.prefill_overtake_fraction) and args.prefill_overtake_fraction >= 0):
        raise ArgumentError(f"--prefill_overtake_fraction must be a finite number >= 0, got {args.prefill_overtake_fraction}")
    if args.prefill_overtake_fraction > MAX_PREFILL_OVERTAKE_FRACTION:
        raise ArgumentError(f"--prefill_overtake_fraction must be at most {MAX_PREFILL_OVERTAKE_FRACTION:g} "
                            f"(for no bound use --disable_prefill_overtake_bound), got {args.prefill_overtake_fraction!r}")


def _validate_scheduling(args: argparse.Namespace) -> None:
    """Refuse router settings outside their ranges: the token ratio, the overtaking bound, the wait before
    joining a running batch and the polling interval (checked in that order)."""
    if not 0 < args.router_token_ratio <= MAX_ROUTER_TOKEN_RATIO:
        raise ArgumentError(f"--router_token_ratio must be in (0, {MAX_ROUTER_TOKEN_RATIO:g}] (above 1 it overcommits "
                            f"the KV cache and pauses requests when it runs out), got {args.router_token_ratio}")
    _validate_overtake_bound(args)
    if not 0 <= args.router_max_wait_tokens <= MAX_ROUTER_MAX_WAIT_TOKENS:
        # A new request waits this many decode steps of the running batch before it may join it.
        raise ArgumentError(f"--router_max_wait_tokens must be in [0, {MAX_ROUTER_MAX_WAIT_TOKENS}] decode steps (a "
                            f"new request waits up to that many steps to join a running batch), got "
                            f"{args.router_max_wait_tokens}")
    if not MIN_SCHEDULE_TIME_INTERVAL <= args.schedule_time_interval <= MAX_SCHEDULE_TIME_INTERVAL:
        # The router polls at most once a millisecond; less would only spin it on an idle server.
        raise ArgumentError(f"--schedule_time_interval must be in [{MIN_SCHEDULE_TIME_INTERVAL:g}, "
                            f"{MAX_SCHEDULE_TIME_INTERVAL:g}] seconds (a request arriving between two rank steps "
                            f"waits up to one round to be admitted), got {args.schedule_time_interval!r}")


def _validate_shutdown_and_watchdog(args: argparse.Namespace) -> None:
    """Refuse a negative or infinite ``--graceful_shutdown_seconds``, and a ``--watchdog_timeout`` that is
    infinite or would take an idle rank for hung (0 turns it off)."""
    if not 0 <= args.graceful_shutdown_seconds < float("inf"):
        raise ArgumentError(f"--graceful_shutdown_seconds must be a finite number >= 0, got {args.graceful_shutdown_seconds}")
    watchdog = args.watchdog_timeout
    if watchdog != 0 and not MIN_WATCHDOG_TIMEOUT_SECONDS <= watchdog < float("inf"):
        # Below the minimum a healthy idle TP rank, which hears from rank 0 every 5 s, would be taken for hung.
        raise ArgumentError(f"--watchdog_timeout must be 0 (off) or at least {MIN_WATCHDOG_TIMEOUT_SECONDS:g} seconds "
                            f"(an idle TP rank's loop completes an iteration only every 5-6 s), got {watchdog!r}")


def _validate_chunked_prefill(args: argparse.Namespace) -> None:
    """Refuse a chunk above ``--batch_max_tokens`` (as :func:`resolve_args` will set it) and a chunk given
    with chunking off."""
    # Checked as resolve_args will set it: a default chunk above the budget is no error.
    chunk = chunked_prefill_size_for(args)
    if args.batch_max_tokens is not None and not args.disable_chunked_prefill and chunk > args.batch_max_tokens:
        raise ArgumentError(
            f"--chunked_prefill_size ({chunk}) cannot exceed --batch_max_tokens ({args.batch_max_tokens})"
        )
    if args.disable_chunked_prefill and flags_given(args, ["chunked_prefill_size"]):
        raise ArgumentError("--chunked_prefill_size does nothing with --disable_chunked_prefill (every prompt is "
                            "prefilled in one piece); give one of them")


def _validate_max_new_tokens_default(args: argparse.Namespace) -> None:
    """Refuse a ``--max_new_tokens_default`` below one token."""
    default_new = args.max_new_tokens_default
    if default_new is not None and default_new < 1:
        raise ArgumentError(f"--max_new_tokens_default must be >= 1, got {default_new}")


def _validate_ports(args: argparse.Namespace) -> None:
    """Refuse ``--port`` or ``--nccl_port`` outside :data:`PORT_RANGE`, and the two on one port."""
    _check_port("port", args.port)
    nccl_port = args.nccl_port
    _check_port("nccl_port", nccl_port)
    if nccl_port is not None and nccl_port == args.port:
        raise ArgumentError(f"--nccl_port ({nccl_port}) must differ from --port: the HTTP server listens there")


def validate_args(args: argparse.Namespace, cuda_device_count: Optional[int] = None) -> None:
    """Raise :class:`ArgumentError` (one line) for settings that cannot work together; ``args`` is not changed
    (:func:`resolve_args` fills in the values its flags imply).

    The checks run in a fixed order and the first that fails is the one reported.
    ``cuda_device_count``: when given, :func:`validate_device_args` runs too.
    """
    if not args.model_dir:
        # The master reads the tokenizer and config from it (and loads no weights).
        raise ArgumentError("--model_dir is required")
    _validate_pd_args(args)
    _validate_sizes(args)
    _validate_sampling_seed(args)
    _validate_scheduling(args)
    _validate_shutdown_and_watchdog(args)
    _validate_chunked_prefill(args)
    check_flag_combinations(args)
    check_seconds_flags(args)
    _validate_max_new_tokens_default(args)
    _validate_http_args(args)
    _validate_ports(args)
    _validate_advertised_host(args)
    if cuda_device_count is not None:
        validate_device_args(args, cuda_device_count)
