"""Shared helpers for the PD master membership tests: node registrations and a fake clock."""

from __future__ import annotations

from typing import Any

from lightllm.server.pd.protocol.node_info import NodeInfo


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def node(node_id: str, role: str, port: int = 9000, **overrides: Any) -> NodeInfo:
    """A valid registration of the tiny demo model, with ``overrides`` applied."""
    fields = dict(
        node_id=node_id,
        role=role,
        model_name="tiny",
        dtype="float32",
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        tp_size=1,
        http_address=f"127.0.0.1:{port}",
        kv_transfer_address=f"127.0.0.1:{port + 1}" if role == "prefill" else "",
    )
    fields.update(overrides)
    return NodeInfo(**fields)
