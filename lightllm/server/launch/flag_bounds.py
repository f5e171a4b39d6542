"""The ranges of flags, written once: :mod:`.args_check` refuses values outside them and the flags'
help texts (:mod:`.batching_flags`, :mod:`.http_flags`, :mod:`.pd_flags`) state them from here, so
a bound changes in one place.

A module of its own because the flag modules are imported by the argument parser, which
:mod:`.args_check` imports: the flag modules cannot import :mod:`.args_check`.
"""

from __future__ import annotations

# How often the master hears from each node: below this a loaded node's heartbeat misses the
# window and healthy nodes are dropped; above it a dead node goes unnoticed for minutes.
PD_HEARTBEAT_INTERVAL_RANGE = (0.5, 60.0)
# The router's poll granularity (it waits in whole milliseconds).
MIN_SCHEDULE_TIME_INTERVAL = 0.001
# A request that arrives between two rank steps waits for the router's next round: at 1e6 s (the
# former limit, that of every seconds flag) a request sent while another ran waited for all of it.
MAX_SCHEDULE_TIME_INTERVAL = 1.0
# The smallest body limit that still admits an ordinary request.
MIN_REQUEST_BODY_BYTES = 1024

# Upper bounds of float flags that are multiplied into integers (bytes, characters): a finite
# 1e300 overflowed to infinity there and the start failed with a traceback. Far beyond any use:
# a reserve above the machine's memory is refused anyway (no room for the KV cache), and no
# tokenizer's token stands for a thousandth of this many characters.
MAX_RESERVED_MEMORY_GB = 1e6
MAX_PROMPT_CHARS_PER_TOKEN = 1e6
# Overcommit of admission: 100x the KV cache is far past where pausing and recomputing pays.
MAX_ROUTER_TOKEN_RATIO = 100.0
# Decode steps between admission rounds: beyond this a new request waits seconds behind a batch.
MAX_ROUTER_MAX_WAIT_TOKENS = 1000
# Tokens per KV page on the PD wire: 2**31 - 1, far beyond any context (the transfer header
# carries it as an int64, which a larger flag value could overflow).
MAX_PD_KV_PAGE_SIZE = 2**31 - 1
# Every TCP port flag.
PORT_RANGE = (1, 65535)


def as_written(value: float) -> str:
    """``value`` as a help text writes it: ``100``, ``0.001``, ``1e6`` (``:g`` would print ``1e+06``)."""
    return f"{value:g}".replace("e+0", "e").replace("e+", "e")
