"""Mode backends: the step engine with the hooks of one run mode.

``build_backend(run_mode)`` returns the backend class of a run mode; the rank process and the
scheduling simulator both build their backend through it.
"""

from __future__ import annotations

from typing import Dict, Type

from lightllm.server.model_rank.scheduling.base_backend import ModeBackend
from lightllm.server.model_rank.scheduling.decode_backend import DecodeBackend, KvReservationRefused
from lightllm.server.model_rank.scheduling.normal_backend import NormalBackend
from lightllm.server.model_rank.scheduling.pd_node_backend import PdNodeBackend, TransferIntake
from lightllm.server.model_rank.scheduling.prefill_backend import PrefillBackend

BACKENDS: Dict[str, Type[ModeBackend]] = {cls.run_mode: cls for cls in (NormalBackend, PrefillBackend, DecodeBackend)}


def build_backend(run_mode: str) -> Type[ModeBackend]:
    """The backend class of ``run_mode`` (``normal``, ``prefill`` or ``decode``)."""
    try:
        return BACKENDS[run_mode]
    except KeyError:
        raise ValueError(f"unknown run mode {run_mode!r}; choose one of {', '.join(BACKENDS)}") from None


__all__ = [
    "BACKENDS",
    "DecodeBackend",
    "KvReservationRefused",
    "ModeBackend",
    "NormalBackend",
    "PdNodeBackend",
    "PrefillBackend",
    "TransferIntake",
    "build_backend",
]
