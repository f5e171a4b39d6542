"""What the router knows of a request (:class:`RouterReq`) and the running set (:class:`RunningRequests`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Tuple

from lightllm.server.core.objs.shm_req_layout import PD_KIND_PREFILL

if TYPE_CHECKING:
    from lightllm.server.core.objs.request_spec import RequestSpec


def reserved_new_tokens(max_new_tokens: int, pd_kind: int) -> int:
    """The new tokens whose KV admission reserves room for on this node.

    A PD prefill node computes the prompt and samples only the first token, which it hands to
    the decode node with the prompt's KV; every later token's KV lives on the decode node.
    Reserving the client's whole ``max_new_tokens`` there would hold room the node never uses,
    and where KV binds, admission (first come, first served) would wait for that room instead
    of admitting work the strategies could order.
    """
    return 1 if pd_kind == PD_KIND_PREFILL else max_new_tokens


@dataclass
class RouterReq:
    """What admission needs to know about a request: a few numbers of its ``RequestSpec``.

    The router process reads them from the request's record (``ShmReqBuffer.admission_fields``,
    so admission never copies a prompt); code that holds the spec builds one with
    :meth:`from_spec`.  The inference-side priority is not here: admission does not order by
    it, and the model rank reads it with the rest of the spec.  ``max_new_tokens`` is what this
    node reserves KV for (:func:`reserved_new_tokens`): 1 on a PD prefill node.
    """

    request_id: int
    shm_index: int
    input_len: int
    max_new_tokens: int
    high_priority_request: bool = False

    @classmethod
    def from_spec(cls, request_id: int, shm_index: int, spec: "RequestSpec") -> "RouterReq":
        """The admission view of ``spec``."""
        return cls(request_id, shm_index, spec.prompt_len,
                   reserved_new_tokens(spec.params.max_new_tokens, spec.pd.kind),
                   spec.priority.high_priority_request)

    @property
    def projected_token_num(self) -> int:
        """KV tokens the request may hold at its largest: prompt plus every allowed new token."""
        return self.input_len + self.max_new_tokens


class RunningRequests(dict):
    """The running set (request id -> request), keeping the sum of its projected tokens.

    Admission needs that sum on every round; keeping it current on every insertion and removal
    makes it O(1) instead of a pass over up to ``running_max_req_size`` requests.  Every way of
    adding or removing an entry goes through the total, so code that writes the set directly
    keeps it right.  A request's ``input_len`` and
    ``max_new_tokens`` must not change while it runs (nothing changes them).
    """

    def __init__(self, items: Iterable[Tuple[int, RouterReq]] = ()) -> None:
        super().__init__()
        self.projected_tokens = 0
        for key, req in items:
            self[key] = req

    def __setitem__(self, key: int, req: RouterReq) -> None:
        old = super().get(key)
        if old is not None:
            self.projected_tokens -= old.projected_token_num
        super().__setitem__(key, req)
        self.projected_tokens += req.projected_token_num

    def __delitem__(self, key: int) -> None:
        req = super().pop(key)
        self.projected_tokens -= req.projected_token_num

    def pop(self, key: int, *default: Any) -> Any:
        """``dict.pop``, keeping the total."""
        if key in self:
            req = super().pop(key)
            self.projected_tokens -= req.projected_token_num
            return req
        if default:
            return default[0]
        raise KeyError(key)

    def popitem(self) -> Tuple[int, RouterReq]:
        """``dict.popitem``, keeping the total."""
        key, req = super().popitem()
        self.projected_tokens -= req.projected_token_num
        return key, req

    def setdefault(self, key: int, default: RouterReq) -> RouterReq:  # type: ignore[override]
        """``dict.setdefault``, keeping the total."""
        if key not in self:
            self[key] = default
        return self[key]

    def update(self, *args: Any, **kwargs: Any) -> None:
        """``dict.update``, keeping the total."""
        for key, req in dict(*args, **kwargs).items():
            self[key] = req

    def __ior__(self, other: Any) -> "RunningRequests":  # type: ignore[override]
        self.update(other)
        return self

    def clear(self) -> None:
        """``dict.clear``, keeping the total."""
        super().clear()
        self.projected_tokens = 0
