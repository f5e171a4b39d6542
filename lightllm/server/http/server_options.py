"""The HTTP front end's limits and keys, read from the parsed flags, and the uvicorn config built from them.

Flags and their defaults live in :mod:`lightllm.server.launch.arg_parser`; this module only turns them into
the objects the app (:func:`lightllm.server.http.app.create_app`) and uvicorn need.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
from dataclasses import dataclass, field
from typing import Optional, Tuple

from lightllm.server.run_mode import PD_NODE_MODES, PD_RUN_MODES, RunMode
from lightllm.utils.envs_utils import (VLLM_API_KEY_ENV, api_keys_from_env, key_character_warning, numbered_key,
                                      pd_cluster_key_from_env)

log = logging.getLogger(__name__)

MIB = 1 << 20
# A body may carry a whole context as text (a few bytes per token, up to 6 for a JSON-escaped
# character), or as token ids ("123456, " is 8 bytes), plus chat structure: 64 bytes per token is
# several times what a legitimate request needs while still bounding memory per request.
BODY_BYTES_PER_CONTEXT_TOKEN = 64
MIN_DEFAULT_BODY_BYTES = 8 * MIB
# Beyond --http_max_connections, an eighth more (at least 16) connections may be read to find
# health probes and requests with an API key among them (see lightllm/server/http/transport/front_door.py).
RESERVE_SHARE = 8
RESERVE_MIN_CONNECTIONS = 16
# File descriptors kept free for the server's own sockets, shared memory and logs.
RESERVED_FILE_DESCRIPTORS = 256
# Requests of one client address being prepared at once (--http_max_preparing_per_client): with
# two tokenizer threads, enough for a proxy's many clients to keep tokenization busy.
DEFAULT_MAX_PREPARING_PER_CLIENT = 16


@dataclass(frozen=True)
class HttpLimits:
    """Per-connection and per-request limits of the HTTP front end."""

    max_body_bytes: Optional[int] = None
    prompt_chars_per_token: Optional[float] = None
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    keep_alive_timeout: float = 5.0
    send_timeout: float = 60.0
    max_connections: int = 2048
    # None: half of max_connections, so one client cannot take every connection.
    max_connections_per_client: Optional[int] = None
    # Requests of one client address being prepared at once
    # (lightllm/server/http/middleware/client_share.py); 0: no limit.
    max_preparing_per_client: int = DEFAULT_MAX_PREPARING_PER_CLIENT

    def __post_init__(self) -> None:
        if self.max_connections_per_client is None:
            object.__setattr__(self, "max_connections_per_client", max(1, self.max_connections // 2))

    @property
    def reserve_connections(self) -> int:
        """Connections beyond the cap whose request head is read, so probes and keyed requests get in."""
        return max(RESERVE_MIN_CONNECTIONS, self.max_connections // RESERVE_SHARE)

    def body_limit(self, max_req_total_len: int) -> int:
        """The body-size limit in bytes, derived from the context length unless given."""
        if self.max_body_bytes is not None:
            return self.max_body_bytes
        return max(MIN_DEFAULT_BODY_BYTES, BODY_BYTES_PER_CONTEXT_TOKEN * max_req_total_len)


PD_CLUSTER_KEY_ENV = "LIGHTLLM_PD_CLUSTER_KEY"


@dataclass(frozen=True)
class AuthPolicy:
    """Who may use the API, who may ask for admission priority, and the PD cluster's own key.

    ``cluster_key`` (``--pd_cluster_key``): when set, the cluster's endpoints (paths under
    ``/pd/``) accept only it, and client keys do not open them.
    """

    api_keys: Tuple[str, ...] = ()
    admin_keys: Tuple[str, ...] = ()
    allow_public_priority: bool = False
    cluster_key: Optional[str] = None
    # Where api_keys came from, for the refusals that name it: the flag or its environment variable.
    api_key_source: str = "--api_key"
    admin_key_source: str = "--admin_api_key"

    @property
    def requires_key(self) -> bool:
        """True when every endpoint but the health probes needs a key."""
        return bool(self.api_keys)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "AuthPolicy":
        """Keys from the flags; a flag not given falls back to its environment variable.

        Raises ``ValueError`` naming the variable when it is set but holds an empty key
        (:func:`~lightllm.utils.envs_utils.api_keys_from_env`), or when vLLM's ``VLLM_API_KEY`` is
        set and no key is on a server that serves the public API (not a PD node): the launcher's
        one-line exit 2.
        """
        api_keys = tuple(args.api_key) if args.api_key else tuple(api_keys_from_env("LIGHTLLM_API_KEY"))
        if not api_keys and os.environ.get(VLLM_API_KEY_ENV) and args.run_mode not in PD_NODE_MODES:
            # A deployment moved from vLLM keeps its variable; ignored, the API would be open.  A PD
            # node serves no public API (its cluster key guards it): there it is only named as unread.
            raise ValueError(f"{VLLM_API_KEY_ENV} is set, but this server reads its API keys from --api_key or "
                             "LIGHTLLM_API_KEY (comma-separated), not from vLLM's variable, and would serve without "
                             "authentication: set LIGHTLLM_API_KEY to the same key, or unset "
                             f"{VLLM_API_KEY_ENV} to serve without keys")
        api_key_source = "--api_key" if args.api_key else "LIGHTLLM_API_KEY"
        admin_keys = tuple(args.admin_api_key or api_keys_from_env("LIGHTLLM_ADMIN_API_KEY"))
        admin_key_source = "--admin_api_key" if args.admin_api_key else "LIGHTLLM_ADMIN_API_KEY"
        cluster_key = args.pd_cluster_key
        if cluster_key is None and args.run_mode in PD_RUN_MODES:
            cluster_key = pd_cluster_key_from_env()
        return cls(api_keys=api_keys, admin_keys=admin_keys, allow_public_priority=args.allow_public_priority,
                   cluster_key=cluster_key, api_key_source=api_key_source, admin_key_source=admin_key_source)

    def key_warnings(self) -> list[str]:
        """One line per client key that only some clients can send (see ``key_character_warning``)."""
        lines = []
        for source, keys in ((self.api_key_source, self.api_keys), (self.admin_key_source, self.admin_keys)):
            for index, key in enumerate(keys, 1):
                warning = key_character_warning(key)
                if warning is not None:
                    lines.append(f"{source} ({numbered_key(index, len(keys))}) {warning}")
        return lines

    def check_cluster(self, run_mode: str) -> None:
        """Refuse (``ValueError``, one line) a PD master or node with client keys but no cluster key,
        or with a cluster key that is also a client key.

        Its nodes (or its master) could not call the ``/pd/`` endpoints: client keys do not open
        them, and leaving them open would let any client with a key join the cluster.
        """
        if self.cluster_key is not None and self.cluster_key in self.api_keys + self.admin_keys:
            # Whoever holds that client key could register a node and be sent the cluster's prompts.
            raise ValueError("the PD cluster key (--pd_cluster_key or LIGHTLLM_PD_CLUSTER_KEY) is also an API or "
                             "admin key: client keys must not open the cluster's /pd/ endpoints; give the cluster "
                             "a secret of its own (the same on the master and every node)")
        if run_mode in PD_RUN_MODES and self.api_keys and self.cluster_key is None:
            role = "a PD master" if run_mode == RunMode.PD_MASTER else f"a PD {run_mode} node"
            raise ValueError(
                f"{self.api_key_source} on {role} needs a cluster key for the cluster's own endpoints: set "
                f"{PD_CLUSTER_KEY_ENV} (or --pd_cluster_key) to the same secret on the master and every node"
            )


@dataclass(frozen=True)
class HttpServerOptions:
    """Everything the HTTP front end takes from the command line."""

    limits: HttpLimits = field(default_factory=HttpLimits)
    auth: AuthPolicy = field(default_factory=AuthPolicy)
    # --tool_call_parser: the format tool calls are read from (tool_choice "auto"); None refuses "auto".
    tool_call_parser: Optional[str] = None
    # --trust_request_chat_template: a request may bring its own chat_template.
    trust_request_chat_template: bool = False
    # --allowed_origins: browser origins answered with CORS headers ("*": any; empty: no CORS headers).
    allowed_origins: Tuple[str, ...] = ("*",)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "HttpServerOptions":
        """Options from parsed flags (keys as :meth:`AuthPolicy.from_args` reads them)."""
        limits = HttpLimits(
            max_body_bytes=args.max_request_body_bytes,
            prompt_chars_per_token=args.prompt_chars_per_token,
            header_timeout=args.http_header_timeout,
            body_timeout=args.http_body_timeout,
            keep_alive_timeout=args.http_keep_alive_timeout,
            send_timeout=args.http_send_timeout,
            max_connections=args.http_max_connections,
            max_connections_per_client=args.http_max_connections_per_client,
            max_preparing_per_client=args.http_max_preparing_per_client,
        )
        return cls(limits=limits, auth=AuthPolicy.from_args(args),
                   tool_call_parser=args.tool_call_parser,
                   trust_request_chat_template=args.trust_request_chat_template,
                   # A PD node's endpoints serve the master, never a browser: no CORS headers there.
                   allowed_origins=() if args.run_mode in PD_NODE_MODES else tuple(args.allowed_origins))


def ensure_file_descriptors(limits: HttpLimits) -> None:
    """Raise the soft open-file limit so the connection cap and its reserve fit, or say plainly that they do not.

    Called once per process, by the front door, which accepts every connection.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # The reserve holds heads being read and connections served from it, each up to its size.
    needed = limits.max_connections + 2 * limits.reserve_connections + RESERVED_FILE_DESCRIPTORS
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < needed:
        log.warning(
            "the open-file limit (%d) is below the %d files --http_max_connections %d needs (with twice its reserve of "
            "%d connections and %d for the server's own files); connections beyond it fail at accept() instead of "
            "getting a 503: raise 'ulimit -n' or lower --http_max_connections",
            soft, needed, limits.max_connections, limits.reserve_connections, RESERVED_FILE_DESCRIPTORS,
        )
