"""The HTTP front end's flags: request limits, connections, authentication, browsers (CORS).

A part of the one argument parser (:mod:`lightllm.server.launch.arg_parser`), kept apart
because these flags configure the HTTP process alone; :mod:`lightllm.server.http.server_options`
reads them.
"""

from __future__ import annotations

import argparse

from lightllm.utils.one_line_errors import finite_float


def add_http_flags(parser: argparse.ArgumentParser) -> None:
    """Add the "HTTP limits and authentication" group to ``parser``."""
    group = parser.add_argument_group("HTTP limits and authentication")
    group.add_argument(
        "--max_request_body_bytes",
        type=int,
        default=None,
        help="Largest request body; a larger one is answered 413 while it is read (chunked bodies too). "
        "Default: the larger of 8 MiB and 64 bytes per token of --max_req_total_len; at least 1024.",
    )
    group.add_argument(
        "--prompt_chars_per_token",
        type=finite_float,
        default=None,
        help="Most characters one prompt token may stand for: a prompt longer than --max_req_total_len times this "
        "is refused (400 context_length_exceeded) before it is tokenized. Default: 4 times the longest token "
        "of the tokenizer's vocabulary; 0 turns the check off.",
    )
    group.add_argument(
        "--http_header_timeout",
        type=finite_float,
        default=10.0,
        help="Seconds a client has to send a whole request head (request line and headers), counted from its "
        "connection or from the first byte of a follow-up request; then 408 and the connection is closed. At most 1e6 seconds (about 11.6 days), the limit of every seconds flag.",
    )
    group.add_argument(
        "--http_body_timeout",
        type=finite_float,
        default=60.0,
        help="Seconds a client has to send a whole request body after its head; then 408 and the connection is closed. At most 1e6 seconds (about 11.6 days), the limit of every seconds flag.",
    )
    group.add_argument(
        "--http_keep_alive_timeout",
        type=finite_float,
        default=5.0,
        help="Seconds an idle keep-alive connection stays open between two requests. At most 1e6 seconds (about 11.6 days), the limit of every seconds flag.",
    )
    group.add_argument(
        "--http_max_connections",
        type=int,
        default=2048,
        help="Most open client connections; beyond it a connection is served only when it is a health probe or "
        "carries a valid API key (in a reserve of an eighth more), others get 503 too_many_connections.",
    )
    group.add_argument(
        "--http_max_connections_per_client",
        type=int,
        default=None,
        help="Most open connections from one client address; one more gets 503 too_many_client_connections at once. "
        "Default: half of --http_max_connections. Behind a proxy every client shares the proxy's address: raise it.",
    )
    group.add_argument(
        "--api_key",
        type=str,
        nargs="+",
        default=None,
        help="Keys clients must send as 'Authorization: Bearer KEY' on every endpoint but /health (401 otherwise). "
        "Default: the comma-separated keys in LIGHTLLM_API_KEY, else no authentication.",
    )
    group.add_argument(
        "--admin_api_key",
        type=str,
        nargs="+",
        default=None,
        help="Keys of trusted clients: accepted wherever --api_key is and the only ones allowed to set "
        "high_priority_request. Default: the comma-separated keys in LIGHTLLM_ADMIN_API_KEY, else none.",
    )
    group.add_argument(
        "--allowed_origins",
        type=str,
        nargs="*",
        default=["*"],
        help="Browser origins that may call the API (CORS), e.g. https://app.example.com: '*' allows any (as vLLM and "
        "LightLLM do by default); the flag with no value sends no CORS headers. A preflight OPTIONS request is answered "
        "without an API key; the request that follows still needs one.",
    )
    group.add_argument(
        "--slot_wait_seconds",
        type=finite_float,
        default=600.0,
        help="Seconds a request waits for a free request slot (every slot is taken by requests in flight) before "
        "it is refused with 503 server_busy. At most 1e6 seconds (about 11.6 days), the limit of every seconds flag.",
    )
    group.add_argument(
        "--allow_public_priority",
        action="store_true",
        help="Let every client that may use the API set high_priority_request (by default only --admin_api_key may).",
    )
