"""Rank 0's step publisher over a given request buffer, with stand-ins for everything else it feeds
(counters, backend, KV view, prefill-wait tracker) and sockets that keep what they are sent."""

from __future__ import annotations

import types
from typing import Any, Dict, List

from lightllm.server.model_rank.step_publisher import StepPublisher


class SentMessages:
    """A push socket that keeps every object it is sent, in order."""

    def __init__(self) -> None:
        self.messages: List[Any] = []

    def send_pyobj(self, message: Any) -> None:
        self.messages.append(message)


def publisher_over(shm: Any) -> StepPublisher:
    """A :class:`StepPublisher` writing to ``shm``; its two sockets are :class:`SentMessages`."""
    stats: Dict[str, int] = {}
    return StepPublisher(
        shm,
        types.SimpleNamespace(set=stats.__setitem__, get=lambda name: stats.get(name, 0)),
        types.SimpleNamespace(requests={}, counter=types.SimpleNamespace(value=0), promised_token_num=lambda: 0),
        types.SimpleNamespace(kv_cache=types.SimpleNamespace(available=0), radix_cache=None,
                              allocatable_token_num=lambda: 0),
        types.SimpleNamespace(on_step=lambda *args: None, fields=lambda: {}),
        SentMessages(), SentMessages(),
    )
