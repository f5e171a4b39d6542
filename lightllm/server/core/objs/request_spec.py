"""One request as it travels from the HTTP process to the model ranks: :class:`RequestSpec`.

A spec is built once where a request enters the server (the HTTP layer's fan-out, a PD node's
wire body, the simulator) and then passed whole: ``HttpServerManager.generate`` writes it into a
shared-memory record (:meth:`~lightllm.server.core.objs.shm_req_buffer.ShmReqBuffer.write_request`),
every model rank reads it back (:meth:`~lightllm.server.core.objs.shm_req_buffer.ShmReqBuffer.read_request`)
and turns it into an ``InferReq``.

A request's checks live here; nothing on its way checks it again but the shared-memory buffer,
for what its fixed-width record needs:

* each group (:class:`Priority`, :class:`Segment`, :class:`PdPlacement`) refuses its own bad
  values when it is built, and :class:`RequestSpec` the rules that span groups and the prompt;
* :meth:`RequestSpec.check_fits` holds what depends on the serving model (vocabulary size,
  context length).  The request manager runs it at the boundary; model rank 0 runs it on what it
  read from shared memory before any rank admits the request (its ``screen``), which is the
  guard of shared memory: a damaged record fails its own request there, alone.

Every refusal is a :class:`RequestSpecError` (a ``ValueError``) whose message names the field and
whose ``field`` holds that name, as the shared-memory record and a PD node's body spell it (the
body keeps ``max_new_tokens`` in ``params``).  This module imports no torch.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Sequence, Tuple

from lightllm.common.sampling import SamplingParams
from lightllm.server.core.objs.shm_req_layout import PD_KIND_DECODE, PD_KIND_NONE, PD_KIND_PREFILL, PD_KINDS

# The record stores every request field (and prompt token) as a 32-bit integer.
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


class RequestSpecError(ValueError):
    """A request field breaks an invariant of :class:`RequestSpec`; ``field`` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name


def _is_int(value: object) -> bool:
    # bool is an int subclass, but True as a segment index is a caller's bug.
    return isinstance(value, int) and not isinstance(value, bool)


def _require_int(name: str, value: object, low: int, high: int) -> None:
    if not _is_int(value) or not low <= value <= high:
        raise RequestSpecError(name, f"{name} must be an int in [{low}, {high}], got {value!r}")


@dataclass(frozen=True)
class Priority:
    """How a request is ranked against others.

    ``high_priority_request``: the client's admission priority (the router admits it in its
    high-priority lane).  ``infer_high_priority``: internal, never from a public API field;
    negative means the rank prefills it before normal requests (a PD continuation segment).
    """

    high_priority_request: bool = False
    infer_high_priority: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.high_priority_request, bool):
            raise RequestSpecError("high_priority_request",
                                   f"high_priority_request must be a bool, got {self.high_priority_request!r}")
        if not _is_int(self.infer_high_priority) or not INT32_MIN <= self.infer_high_priority <= INT32_MAX:
            raise RequestSpecError("infer_high_priority",
                                   f"infer_high_priority must be a 32-bit int, got {self.infer_high_priority!r}")


@dataclass(frozen=True)
class Segment:
    """Which part of a longer generation a request is (a PD master splits one into segments).

    ``segment_index``: 0 for the first segment, k for the k-th continuation.
    ``generated_before``: how many trailing prompt tokens earlier segments generated; sampling
    counts them as output, so a continuation samples what the unsplit generation would.
    """

    segment_index: int = 0
    generated_before: int = 0

    def __post_init__(self) -> None:
        _require_int("segment_index", self.segment_index, 0, INT32_MAX)
        _require_int("generated_before", self.generated_before, 0, INT32_MAX)
        if self.generated_before and self.segment_index == 0:
            raise RequestSpecError(
                "generated_before",
                f"generated_before must be 0 for a first segment (segment_index 0), got {self.generated_before}",
            )


@dataclass(frozen=True)
class PdPlacement:
    """How a PD node runs the request (internal; a normal server's requests have kind NONE).

    ``kind``: one of :data:`~lightllm.server.core.objs.shm_req_layout.PD_KINDS`.  ``kv_start``
    (a prefill node's request only): the first prompt position whose KV is sent, i.e. the
    decode node's own prefix-cache hit.  ``epoch``: the transfer pair (P, D) the master set up for
    this request, which picks the rank's KV transfer handle on a node connected to several peers
    (0: none, a normal request).  ``lease_s`` (a decode node's request only): how long the master
    is prepared to wait for this request's KV (its prefill timeout plus the hand-off margin), which
    the decode ranks use as the reservation's lease, bounded by ``--pd_reserve_lease_seconds``
    when that is set (0.0: the master sent none; the node's own lease applies).
    """

    kind: int = PD_KIND_NONE
    kv_start: int = 0
    epoch: int = 0
    lease_s: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.kind, bool) or self.kind not in PD_KINDS:
            raise RequestSpecError("pd_kind", f"pd_kind must be one of {PD_KINDS}, got {self.kind!r}")
        _require_int("kv_start", self.kv_start, 0, INT32_MAX)
        if self.kv_start and self.kind != PD_KIND_PREFILL:
            raise RequestSpecError("kv_start", "kv_start applies to PD prefill requests only")
        _require_int("pd_epoch", self.epoch, 0, INT32_MAX)
        if self.epoch and self.kind == PD_KIND_NONE:
            raise RequestSpecError("pd_epoch", "pd_epoch applies to PD requests only")
        lease = self.lease_s
        # An int is a caller's whole seconds; bool is not a number of seconds.
        if isinstance(lease, bool) or not isinstance(lease, (int, float)) or not 0 <= lease < math.inf:
            raise RequestSpecError("pd_lease_s", f"pd_lease_s must be a finite number of seconds >= 0, got {lease!r}")
        object.__setattr__(self, "lease_s", float(lease))
        if self.lease_s and self.kind != PD_KIND_DECODE:
            raise RequestSpecError("pd_lease_s", "pd_lease_s applies to PD decode requests only")


@dataclass(frozen=True)
class RequestSpec:
    """One request's inputs: prompt, sampling parameters and the internal groups.

    ``prompt_ids`` is stored as a tuple of ints (any sequence of integers is accepted).  The
    sampling parameters validated themselves when they were built; their model-dependent
    checks and the context length are :meth:`check_fits`'s.
    """

    prompt_ids: Tuple[int, ...]
    params: SamplingParams
    priority: Priority = field(default_factory=Priority)
    segment: Segment = field(default_factory=Segment)
    pd: PdPlacement = field(default_factory=PdPlacement)

    def __post_init__(self) -> None:
        if isinstance(self.prompt_ids, (str, bytes)):
            raise RequestSpecError("prompt_ids", "prompt_ids must be a sequence of token ids, not text")
        try:
            # operator.index refuses floats and strings at C speed; prompts run to 100K tokens.
            prompt = tuple(map(operator.index, self.prompt_ids))
        except TypeError:
            raise RequestSpecError("prompt_ids", "prompt_ids must hold integer token ids") from None
        if not prompt:
            raise RequestSpecError("prompt_ids", "prompt_ids must hold at least one token")
        # The upper bound is the vocabulary's (check_fits); a record refuses ids past 32 bits itself.
        if min(prompt) < 0:
            raise RequestSpecError("prompt_ids", f"prompt_ids must hold non-negative token ids, got {min(prompt)}")
        object.__setattr__(self, "prompt_ids", prompt)
        if not isinstance(self.params, SamplingParams):
            raise RequestSpecError("params", f"params must be SamplingParams, got {type(self.params).__name__}")
        for name, group in (("priority", Priority), ("segment", Segment), ("pd", PdPlacement)):
            if not isinstance(getattr(self, name), group):
                raise RequestSpecError(name, f"{name} must be a {group.__name__}, got {getattr(self, name)!r}")
        # Rules spanning a group and the prompt (or two groups).
        prompt_len = len(prompt)
        if self.segment.generated_before >= prompt_len:
            raise RequestSpecError(
                "generated_before",
                f"generated_before must be an int in [0, {prompt_len - 1}] (less than the prompt length "
                f"{prompt_len}), got {self.segment.generated_before}",
            )
        if self.pd.kv_start >= prompt_len:
            raise RequestSpecError(
                "kv_start",
                f"kv_start must be an int in [0, {prompt_len - 1}] (less than the prompt length {prompt_len}), "
                f"got {self.pd.kv_start}",
            )
        if self.priority.infer_high_priority != 0 and self.segment.segment_index == 0:
            # Only a PD master's continuations are promoted; a first segment never is.
            raise RequestSpecError(
                "infer_high_priority",
                f"infer_high_priority must be 0 for a first segment (segment_index 0), "
                f"got {self.priority.infer_high_priority}",
            )

    @property
    def prompt_len(self) -> int:
        """Number of prompt tokens."""
        return len(self.prompt_ids)

    def check_fits(self, vocab_size: int, max_req_total_len: int) -> None:
        """Raise ``ValueError`` naming the field unless a server with these limits can run the request.

        ``vocab_size`` bounds the prompt's token ids and the ids the sampling parameters name
        (stop tokens, logit bias); prompt plus ``max_new_tokens`` must fit ``max_req_total_len``.
        """
        self.params.validate(vocab_size)  # SamplingParamError (a ValueError) names its field
        total = self.prompt_len + self.params.max_new_tokens
        if total > max_req_total_len:
            raise RequestSpecError(
                "max_new_tokens",
                f"prompt ({self.prompt_len}) + max_new_tokens ({self.params.max_new_tokens}) exceeds "
                f"max_req_total_len ({max_req_total_len}): this model's maximum context length is "
                f"{max_req_total_len} tokens",
            )
        if max(self.prompt_ids) >= vocab_size:
            raise RequestSpecError("prompt_ids", f"prompt_ids must hold token ids in [0, {vocab_size}), "
                                                 f"got {max(self.prompt_ids)}")

    @classmethod
    def build(
        cls,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        high_priority_request: bool = False,
        infer_high_priority: int = 0,
        segment_index: int = 0,
        generated_before: int = 0,
        pd_kind: int = PD_KIND_NONE,
        kv_start: int = 0,
        pd_epoch: int = 0,
        pd_lease_s: float = 0.0,
    ) -> "RequestSpec":
        """A spec from flat fields (the record's and a PD body's names)."""
        return cls(
            prompt_ids,  # type: ignore[arg-type]  # normalised to a tuple by __post_init__
            params,
            Priority(high_priority_request, infer_high_priority),
            Segment(segment_index, generated_before),
            PdPlacement(pd_kind, kv_start, pd_epoch, pd_lease_s),
        )

