"""``NormalBackend``: a whole engine's backend (``--run_mode normal``).

A request is prefilled here and then decoded here until it finishes; the engine's default hooks
are this mode's, and the intake only joins the request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from lightllm.server.core.objs.request_spec import PdPlacement
from lightllm.server.model_rank.scheduling.base_backend import ModeBackend
from lightllm.server.model_rank.scheduling.infer_req import InferReq

if TYPE_CHECKING:
    from lightllm.server.core.objs.request_spec import RequestSpec

# A request that names no placement on a cluster node: the only kind a whole engine runs.
_UNPLACED = PdPlacement()


class NormalBackend(ModeBackend):
    """Normal mode: a request is prefilled, then decoded here until it finishes."""

    run_mode: ClassVar[str] = "normal"

    def intake(self, request_id: int, spec: "RequestSpec", shm_index: int = -1) -> InferReq:
        """Join the request (see :meth:`add_request`); one placed on a cluster node cannot run here."""
        if spec.pd != _UNPLACED:
            raise ValueError(f"a normal node cannot run a request of PD kind {spec.pd.kind}")
        return self.add_request(request_id, spec, shm_index)
