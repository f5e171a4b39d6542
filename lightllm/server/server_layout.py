"""What every process of one server must agree on, built once by the launcher.

The shared-memory names, the slot count, the per-request and whole-cache token lengths and the
zmq addresses are decided in :mod:`lightllm.server.launch.start` and handed, as one
:class:`ServerLayout`, to the config of every process (HTTP, router, detokenization, each model
rank).  A process never copies these values into fields of its own, so two processes cannot
disagree about the layout they map.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from lightllm.server.core.objs.shm_heartbeats import HeartbeatStamp, ShmHeartbeats
from lightllm.server.core.objs.shm_req_buffer import ShmReqBuffer
from lightllm.server.core.objs.shm_stats import ShmStats


@dataclass(frozen=True)
class ServerLayout:
    """Names, sizes and addresses shared by every process of one server (picklable for spawn)."""

    shm_req_name: str
    shm_stats_name: str
    # Shared-memory request records, the most requests in flight (waiting, running, streaming out).
    slot_num: int
    # Most prompt + generated tokens of one request: the width of every record's token arrays.
    max_req_total_len: int
    # KV-cache capacity in tokens, for router admission and the ranks' cache.
    max_total_token_num: int
    router_address: str
    model_rank0_address: str
    detokenization_address: str
    http_address: str
    # Rows of top logprobs (segment ``<shm_req_name>_top``) for requests that ask for them
    # (--top_logprobs_slots); 0: none, so no request may ask (test layouts).
    top_slot_num: int = 0
    # The child processes whose main loops beat for the watchdog (--watchdog_timeout), in the order
    # of their fields in the heartbeat segment ``shm_heartbeat_name``; empty: none is watched and
    # there is no such segment (--watchdog_timeout 0, test layouts).
    heartbeat_processes: Tuple[str, ...] = ()
    shm_heartbeat_name: str = ""

    def __post_init__(self) -> None:
        for name in ("slot_num", "max_req_total_len", "max_total_token_num"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ServerLayout.{name} must be a positive int, got {value!r}")
        if isinstance(self.top_slot_num, bool) or not isinstance(self.top_slot_num, int) or self.top_slot_num < 0:
            raise ValueError(f"ServerLayout.top_slot_num must be an int >= 0, got {self.top_slot_num!r}")
        if bool(self.heartbeat_processes) != bool(self.shm_heartbeat_name):
            raise ValueError("ServerLayout.heartbeat_processes and shm_heartbeat_name go together (both empty: no "
                             f"watchdog), got {self.heartbeat_processes!r} and {self.shm_heartbeat_name!r}")
        if len(set(self.heartbeat_processes)) != len(self.heartbeat_processes):
            raise ValueError(f"ServerLayout.heartbeat_processes names a process twice: {self.heartbeat_processes!r}")

    def open_requests(self, create: bool = False) -> ShmReqBuffer:
        """Map the request records and top-logprob rows (``create``: the launcher, once, before any child starts)."""
        return ShmReqBuffer(self.shm_req_name, self.slot_num, self.max_req_total_len, create=create,
                            top_slot_num=self.top_slot_num)

    def shm_segment_bytes(self) -> Dict[str, int]:
        """Bytes of each shared-memory segment this layout maps, by what it holds."""
        records, tops = ShmReqBuffer.segment_bytes(self.slot_num, self.max_req_total_len, self.top_slot_num)
        sizes = {"request records": records, "top-logprob rows": tops, "counters": ShmStats.segment_bytes()}
        if self.heartbeat_processes:
            sizes["heartbeats"] = ShmHeartbeats.segment_bytes(len(self.heartbeat_processes))
        return sizes

    def open_stats(self, create: bool = False) -> ShmStats:
        """Map the shared counters (``create``: the launcher, once)."""
        return ShmStats(self.shm_stats_name, create=create)

    def open_heartbeats(self, create: bool = False) -> Optional[ShmHeartbeats]:
        """Map the heartbeat block (``create``: the launcher, once); None when no process is watched."""
        if not self.heartbeat_processes:
            return None
        return ShmHeartbeats(self.shm_heartbeat_name, len(self.heartbeat_processes), create=create)

    def open_heartbeat(self, process_name: str) -> Optional[HeartbeatStamp]:
        """The writer of ``process_name``'s own heartbeat field; None when no process is watched.

        Raises ValueError when processes are watched but not this one: a child whose name the layout
        does not know would never beat and be taken for hung one timeout after the start.
        """
        if not self.heartbeat_processes:
            return None
        if process_name not in self.heartbeat_processes:
            raise ValueError(f"no heartbeat field for process {process_name!r}: the layout watches "
                             f"{', '.join(self.heartbeat_processes)}")
        block = self.open_heartbeats()
        assert block is not None
        return block.stamp(self.heartbeat_processes.index(process_name))
