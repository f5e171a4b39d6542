"""Name -> class registry of prefill-queue strategies.

The CLI builds its ``--prefill_queue_strategy`` choices from ``available_strategy_names()``.
To add a strategy, subclass ``PrefillQueueStrategy`` and add an entry here.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Type

from lightllm.server.model_rank.scheduling.prefill_queue_strategy.base import PrefillQueueStrategy
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.default import DefaultStrategy
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.hrrn import HrrnStrategy
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.lpm import LongestPrefixMatchStrategy
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.promote_shortest import (
    PromoteShortestStrategy,
)
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.shortest_within_slack import (
    ShortestWithinSlackStrategy,
)
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound import OvertakeBoundSpec

DEFAULT_PREFILL_QUEUE_STRATEGY = DefaultStrategy.name

PREFILL_QUEUE_STRATEGIES: Dict[str, Type[PrefillQueueStrategy]] = {
    cls.name: cls
    for cls in (
        DefaultStrategy,
        PromoteShortestStrategy,
        HrrnStrategy,
        LongestPrefixMatchStrategy,
        ShortestWithinSlackStrategy,
    )
}


def available_strategy_names() -> List[str]:
    """Registered strategy names, ``default`` first."""
    return list(PREFILL_QUEUE_STRATEGIES)


def build_prefill_queue_strategy(
    name: str, overtake_bound: Optional[OvertakeBoundSpec] = None
) -> PrefillQueueStrategy:
    """Instantiate the strategy registered as ``name`` under ``overtake_bound`` (``None``: defaults).

    Unknown names and invalid bounds raise ``ValueError``.
    """
    cls = PREFILL_QUEUE_STRATEGIES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(
            f"unknown prefill_queue_strategy {name!r}; valid names: {', '.join(available_strategy_names())}"
        )
    return cls(overtake_bound)
