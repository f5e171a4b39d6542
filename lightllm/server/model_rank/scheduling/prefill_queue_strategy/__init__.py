"""Prefill-queue strategies: how ready prefill requests are ordered before budgeting.

Choose one by name with ``build_prefill_queue_strategy`` (CLI: ``--prefill_queue_strategy``).
"""

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
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.registry import (
    DEFAULT_PREFILL_QUEUE_STRATEGY,
    PREFILL_QUEUE_STRATEGIES,
    available_strategy_names,
    build_prefill_queue_strategy,
)

__all__ = [
    "DEFAULT_PREFILL_QUEUE_STRATEGY",
    "PREFILL_QUEUE_STRATEGIES",
    "DefaultStrategy",
    "HrrnStrategy",
    "LongestPrefixMatchStrategy",
    "PrefillQueueStrategy",
    "PromoteShortestStrategy",
    "ShortestWithinSlackStrategy",
    "available_strategy_names",
    "build_prefill_queue_strategy",
]
