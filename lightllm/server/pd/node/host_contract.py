"""What a PD node's service needs of its host, and the checks of its control endpoints' arguments.

:class:`PdNodeHost` is the narrow interface through which :class:`~.service.PdNodeService` calls
the node's request manager (``HttpServerManager`` provides it), so the manager knows nothing of PD;
:func:`parse_transfer_address` and :func:`check_epoch` check what the master sends a node's
control endpoints before the service acts on it.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable, Optional, Protocol, Tuple, Type

from lightllm.server.core.objs.request_spec import INT32_MAX, RequestSpec
from lightllm.server.pd.protocol.host_port import HostPortError, parse_host_port
from lightllm.server.request_manager import ServedModelView


class PdNodeHost(Protocol):
    """What the service needs of the node's request manager (``HttpServerManager`` provides it)."""

    served: ServedModelView  # its ``vocab_size`` and ``max_req_total_len`` bound a node request's spec
    metrics: Any  # ``.measured``: the registry the node's /metrics renders

    def add_inbox_handler(self, message_types: Tuple[Type[Any], ...], handler: Callable[[Any], None]) -> None:
        """Call ``handler`` (on the event loop, in arrival order) for every inbox message of these types."""

    def post(self, request_id: int, item: Any) -> bool:
        """Put ``item`` into a pending request's event stream, in arrival order; False if none."""

    def generate(
        self, spec: RequestSpec, *, request: Any = None, request_id: Optional[int] = None,
        slot_wait_seconds: Optional[float] = None, drain_exempt: bool = False,
    ) -> AsyncIterator[Any]:
        """The request's events: ``GenerationEvent`` values and whatever was posted to it
        (``drain_exempt``: it may start while the server drains, as a continuation segment)."""

    async def wait_request_id_free(self, request_id: int, timeout: float) -> bool:
        """Wait until ``request_id`` is no longer in use here; True if it is free."""


def parse_transfer_address(address: object) -> Tuple[str, int]:
    """The prefill node's ``host:port`` -> ``(host, port)``, the host as a socket takes it.

    The contract's one rule (:func:`~lightllm.server.pd.protocol.host_port.parse_host_port`):
    ``[fd00::1]:7000`` gives ``("fd00::1", 7000)``, since the ranks connect to the host with
    plain sockets and ``TCPStore``, which resolve no bracketed name.  ``ValueError`` naming the
    field when ``address`` is not one.
    """
    try:
        return parse_host_port(address)
    except HostPortError as exc:
        raise ValueError(f"prefill_transfer_address {exc}") from None


def check_epoch(epoch: Any) -> int:
    """``epoch`` if it is an int a request's spec can carry (``[0, 2**31 - 1]``), else ``ValueError``."""
    if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch <= INT32_MAX:
        raise ValueError(f"epoch must be an int in [0, {INT32_MAX}], got {epoch!r}")
    return epoch
