"""The deployments the benchmark runner can start, by name (``--topology``).

A registry module of its own, so that each topology's module imports only the launcher pieces
it builds on and nothing registers itself by import side effect.
"""

from __future__ import annotations

from typing import Any

from lightllm.benchmark.pd_cluster import XPYD_TOPOLOGIES, PdTopology
from lightllm.benchmark.server_launcher import NormalTopology, Topology

TOPOLOGIES: dict[str, type[Topology]] = {cls.name: cls for cls in (NormalTopology, PdTopology, *XPYD_TOPOLOGIES)}


def make_topology(name: str, **kwargs: Any) -> Topology:
    """The topology registered as ``name``, built with ``kwargs``."""
    try:
        cls = TOPOLOGIES[name]
    except KeyError:
        raise ValueError(f"topology must be one of {sorted(TOPOLOGIES)}, got {name!r}") from None
    return cls(**kwargs)
