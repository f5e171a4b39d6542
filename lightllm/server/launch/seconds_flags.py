"""Upper bound of every flag that counts seconds (timeouts, intervals, leases).

A wait longer than the code can take does not wait longer: it crashes the thread that waits.
epoll and zmq take a timeout of at most INT_MAX milliseconds (2**31 - 1 ms, about 24.8 days); an
``--http_header_timeout 1e7`` ended the front door's thread in ``selector.select`` with
``OverflowError`` while its port stayed open, and ``--schedule_time_interval 1e7`` the router in
its zmq poll (that flag now has a range of its own, at most 1 s). One documented maximum, :data:`MAX_WAIT_SECONDS`, leaves room for the longest sum
the code waits in one call: a PD reservation's lease, ``--pd_prefill_timeout_seconds`` plus
``--pd_transfer_timeout_seconds`` (2e6 s, still under INT_MAX ms).
"""

from __future__ import annotations

import argparse
from typing import Tuple

from lightllm.server.argument_error import ArgumentError
from lightllm.server.launch.flag_bounds import as_written

# About 11.6 days; see the module docstring for why not more.
MAX_WAIT_SECONDS = 1e6
_DAYS = f"about {MAX_WAIT_SECONDS / 86400:.1f} days"
_AT_MOST = (f"must be at most {MAX_WAIT_SECONDS:,.0f} seconds ({_DAYS}, the longest wait the server's event "
            "loops and polls can take)")
# The sentence every seconds flag's help ends with (the flags' docs are generated from it).
SECONDS_LIMIT_HELP = f"At most {as_written(MAX_WAIT_SECONDS)} seconds ({_DAYS}), the limit of every seconds flag."

# Every seconds-valued flag of the parser (the lower bounds are checked with each flag's own rule).
SECONDS_FLAGS: Tuple[str, ...] = (
    "graceful_shutdown_seconds",
    "watchdog_timeout",
    "http_header_timeout",
    "http_body_timeout",
    "http_keep_alive_timeout",
    "http_send_timeout",
    "slot_wait_seconds",
    "pd_heartbeat_interval",
    "pd_reserve_lease_seconds",
    "pd_transfer_timeout_seconds",
    "pd_prefill_timeout_seconds",
    "pd_decode_token_timeout_seconds",
)


def check_seconds_flags(args: argparse.Namespace) -> None:
    """Refuse (one line naming the flag) a seconds flag above :data:`MAX_WAIT_SECONDS`.

    Also the master's node expiry, ``--pd_heartbeat_interval`` x ``--pd_max_missed_heartbeats``,
    which a node waits for in one call too.
    """
    for name in SECONDS_FLAGS:
        value = getattr(args, name)
        if value is not None and value > MAX_WAIT_SECONDS:
            raise ArgumentError(f"--{name} {_AT_MOST}, got {value!r}")
    interval, missed = args.pd_heartbeat_interval, args.pd_max_missed_heartbeats
    if interval * missed > MAX_WAIT_SECONDS:
        raise ArgumentError(f"--pd_max_missed_heartbeats {missed} x --pd_heartbeat_interval {interval!r} {_AT_MOST}")
