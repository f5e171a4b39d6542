"""The HTTP front end's flags: request limits, connections, authentication, browsers (CORS).

A part of the one argument parser (:mod:`lightllm.server.launch.arg_parser`), kept apart
because these flags configure the HTTP process alone; :mod:`lightllm.server.http.server_options`
reads them.
"""

from __future__ import annotations

import argparse

from lightllm.server.http.server_options import DEFAULT_MAX_PREPARING_PER_CLIENT
from lightllm.server.launch.flag_bounds import MAX_PROMPT_CHARS_PER_TOKEN, MIN_REQUEST_BODY_BYTES, as_written
from lightllm.server.launch.flag_roles import EVERY_ROLE, MODEL_ROLES, PUBLIC_API, add_flag
from lightllm.server.launch.seconds_flags import SECONDS_LIMIT_HELP
from lightllm.utils.one_line_errors import finite_float


def add_http_flags(parser: argparse.ArgumentParser) -> None:
    """Add the "HTTP limits and authentication" group to ``parser``."""
    group = parser.add_argument_group("HTTP limits and authentication")
    add_flag(
        group, "--max_request_body_bytes", roles=EVERY_ROLE,
        type=int,
        default=None,
        help="Largest request body; a larger one is answered 413 while it is read (chunked bodies too). "
        f"Default: the larger of 8 MiB and 64 bytes per token of --max_req_total_len; at least {MIN_REQUEST_BODY_BYTES}.",
    )
    add_flag(
        group, "--prompt_chars_per_token", roles=EVERY_ROLE,
        type=finite_float,
        default=None,
        help="Most characters one prompt token may stand for: a prompt longer than --max_req_total_len times this "
        "is refused (400 context_length_exceeded) before it is tokenized. Default: 4 times the longest token "
        "of the tokenizer's vocabulary; 0 turns the check off; otherwise from 1 (a token is at least one character) to "
        f"{as_written(MAX_PROMPT_CHARS_PER_TOKEN)}.",
    )
    add_flag(
        group, "--http_header_timeout", roles=EVERY_ROLE,
        type=finite_float,
        default=10.0,
        help="Seconds a client has to send a whole request head (request line and headers), counted from its "
        "connection or from the first byte of a follow-up request; then 408 and the connection is closed. " + SECONDS_LIMIT_HELP,
    )
    add_flag(
        group, "--http_body_timeout", roles=EVERY_ROLE,
        type=finite_float,
        default=60.0,
        help="Seconds a client has to send a whole request body once the server starts reading it (after its head, or its turn among the client's requests being prepared); then 408 and the connection is closed. " + SECONDS_LIMIT_HELP,
    )
    add_flag(
        group, "--http_keep_alive_timeout", roles=EVERY_ROLE,
        type=finite_float,
        default=5.0,
        help="Seconds an idle keep-alive connection stays open between two requests. " + SECONDS_LIMIT_HELP,
    )
    add_flag(
        group, "--http_send_timeout", roles=EVERY_ROLE,
        type=finite_float,
        default=60.0,
        help="Seconds a client may accept none of its answer (a stream it stopped reading: the socket's buffers full) "
        "before its connection is closed and a request still running on it aborted; generation does not wait for a slow reader, so "
        "the answer would otherwise be buffered until it ends. Any progress restarts the count. " + SECONDS_LIMIT_HELP,
    )
    add_flag(
        group, "--http_max_connections", roles=EVERY_ROLE,
        type=int,
        default=2048,
        help="Most open client connections; beyond it a connection is served only when it is a health probe or "
        "carries a valid API key (in a reserve of an eighth more), others get 503 too_many_connections.",
    )
    add_flag(
        group, "--http_max_connections_per_client", roles=EVERY_ROLE,
        type=int,
        default=None,
        help="Most open connections from one client address; one more gets 503 too_many_client_connections at once. "
        "Default: half of --http_max_connections. Behind a proxy every client shares the proxy's address: raise it.",
    )
    add_flag(
        group, "--http_max_preparing_per_client", roles=EVERY_ROLE,
        type=int,
        default=DEFAULT_MAX_PREPARING_PER_CLIENT,
        help="Most requests of one client address being read, checked and tokenized at once; a request stops "
        "counting when it reaches the engine (a stream does not count while it generates). Further ones wait "
        "their turn, none is refused: one client pipelining cheap requests on many connections cannot take the "
        "event loop from the others. 0: no limit. Health probes, /metrics and the PD cluster's /pd/ paths do not count. "
        "Behind a proxy every client shares the proxy's address: the default keeps the two tokenizer threads busy; "
        "raise it if the proxy forwards request bodies slowly.",
    )
    add_flag(
        group, "--api_key", roles=EVERY_ROLE,
        type=str,
        nargs="+",
        default=None,
        help="Keys clients must send as 'Authorization: Bearer KEY' on every endpoint but the health probes (/health, /health/live, /health/ready, /healthz, /liveness, /readiness, /ping; 401 otherwise). "
        "Several keys are separate words (a comma inside a key is refused). Default: the comma-separated keys in "
        "LIGHTLLM_API_KEY, else no authentication.",
    )
    add_flag(
        group, "--admin_api_key", roles=EVERY_ROLE,
        type=str,
        nargs="+",
        default=None,
        help="Keys of trusted clients: accepted wherever --api_key is and the only ones allowed to set "
        "high_priority_request. Default: the comma-separated keys in LIGHTLLM_ADMIN_API_KEY, else none.",
    )
    add_flag(
        group, "--allowed_origins", roles=PUBLIC_API,
        type=str,
        nargs="*",
        default=["*"],
        help="Browser origins that may call the API (CORS), e.g. https://app.example.com: '*' allows any (as vLLM and "
        "LightLLM do by default); the flag with no value sends no CORS headers. A preflight OPTIONS request is answered "
        "without an API key; the request that follows still needs one.",
    )
    add_flag(
        group, "--slot_wait_seconds", roles=MODEL_ROLES,
        type=finite_float,
        default=600.0,
        help="Seconds a request waits for a free request slot (every slot is taken by requests in flight) before "
        "it is refused with 503 server_busy. " + SECONDS_LIMIT_HELP,
    )
    add_flag(
        group, "--allow_public_priority", roles=EVERY_ROLE,
        action="store_true",
        help="Let every client that may use the API set high_priority_request (by default only --admin_api_key may).",
    )
