"""The router's admission queue of each run mode: ``build_req_queue(run_mode, ...)``.

A whole engine and a PD prefill node admit under the KV projection, the request cap and the
overtaking bound (:class:`~.normal_queue.NormalReqQueue`); a PD decode node answers every
arrival at once (:class:`~.decode_arrival_queue.DecodeArrivalQueue`).  Adding a run mode's
queue: subclass :class:`~.base_queue.ReqQueue` and register it in :data:`REQ_QUEUES`.
"""

from __future__ import annotations

from typing import Dict, Optional, Type

from lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound import OvertakeBoundSpec
from lightllm.server.router.req_queue.base_queue import ReqQueue
from lightllm.server.router.req_queue.decode_arrival_queue import DecodeArrivalQueue
from lightllm.server.router.req_queue.normal_queue import NormalReqQueue
from lightllm.server.run_mode import RunMode

REQ_QUEUES: Dict[str, Type[ReqQueue]] = {
    RunMode.NORMAL.value: NormalReqQueue,
    RunMode.PREFILL.value: NormalReqQueue,
    RunMode.DECODE.value: DecodeArrivalQueue,
}


def build_req_queue(
    run_mode: str, capacity_tokens: int, running_max_req_size: int, overtake_bound: Optional[OvertakeBoundSpec] = None
) -> ReqQueue:
    """The admission queue of ``run_mode`` (``normal``, ``prefill`` or ``decode``).

    ``capacity_tokens``: projected KV tokens the running batch may hold; ``running_max_req_size``:
    requests it may hold; ``overtake_bound``: how far the high-priority lane may overtake (None:
    the defaults).  A queue whose ranks answer every request at once ignores them.
    """
    try:
        queue_class = REQ_QUEUES[RunMode(run_mode).value]
    except (KeyError, ValueError):
        raise ValueError(f"no router queue for run mode {run_mode!r}; choose one of {', '.join(REQ_QUEUES)}") from None
    return queue_class(capacity_tokens, running_max_req_size, overtake_bound=overtake_bound)
