"""The run modes of a server process, named once.

A server is either a whole engine (``normal``) or one role of a prefill/decode (PD) cluster: the
``pd_master`` that serves the public API, or a ``prefill`` or ``decode`` node. Every module that
branches on the mode or lists the PD roles takes the names from here, so a new role is one edit.
"""

from __future__ import annotations

from enum import Enum
from typing import Tuple


class RunMode(str, Enum):
    """``--run_mode``; a ``str`` subclass, so a member compares equal to its flag value."""

    NORMAL = "normal"
    PREFILL = "prefill"
    DECODE = "decode"
    PD_MASTER = "pd_master"


# The two kinds of PD node: they load weights, run ranks and move KV between them.
PD_NODE_MODES: Tuple[str, ...] = (RunMode.PREFILL.value, RunMode.DECODE.value)
# Every process of a PD cluster: the nodes and the master.
PD_RUN_MODES: Tuple[str, ...] = PD_NODE_MODES + (RunMode.PD_MASTER.value,)
# The modes whose ranks prefill, and so order a prefill queue: a decode node only decodes.
PREFILLING_MODES: Tuple[str, ...] = (RunMode.NORMAL.value, RunMode.PREFILL.value)


def prefill_queue_description(run_mode: str, strategy: str, overtake_bound: str) -> str:
    """The start-up log's words for the prefill queue: a decode node has none (it refuses the flags)."""
    if run_mode not in PREFILLING_MODES:
        return "prefill_queue=none"
    return f"prefill_queue_strategy={strategy} overtake_bound={overtake_bound}"


# The choices of --run_mode.
RUN_MODES: Tuple[str, ...] = (RunMode.NORMAL.value,) + PD_RUN_MODES
