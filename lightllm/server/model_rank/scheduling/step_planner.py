"""Select-under-budget phase of a backend step.

The engine classifies the ready requests into decode and prefill, orders the prefill ones with
its prefill-queue strategy, then asks a ``StepPlanner`` which of them run in this step, given
the compute-token budget and the free KV cache.  The planner is plain Python: it sees two lists
of requests and two numbers, so the server, the unit tests and the scheduling simulator share it.

Accounting: the planner computes each prefill request's chunk exactly once, and
``StepPlan.prefill_token_num`` is that sum (plus the decode tokens of a mixed batch).  The
backend passes the plan to ``submit_prefill`` when it submits the prefill forward, which advances
the processed-prefill-token counter by exactly that amount; nothing is recounted later.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple, Union

from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.processed_token_counter import ProcessedPrefillTokenCounter
from lightllm.server.model_rank.scheduling.request_classifier import prefill_need_token_num

KvBudget = Union[int, Callable[[], int]]


@dataclass(frozen=True)
class PrefillChunk:
    """One prefill request's share of this step: tokens ``[start, start + token_num)``."""

    req: InferReq
    start: int
    token_num: int

    @property
    def end(self) -> int:
        """Position after the last token of the chunk (the request's ``cur_kv_len`` afterwards)."""
        return self.start + self.token_num


@dataclass
class StepPlan:
    """What one backend step runs.

    Attributes:
        decode_reqs: decode requests that got a KV token, in queue order.
        prefill_chunks: selected prefill chunks, in queue order.
        prefill_token_num: tokens submitted in the prefill run mode: the chunk tokens, plus one
            per decode request when ``mixed`` (decodes ride in the prefill forward).
        skipped: prefill requests not selected this step for lack of token budget or KV.
        deferred: ``(request, owner)`` for each prefill request that fit but waits a step because
            its chunk repeats one planned for ``owner`` (``defer_repeated_chunks``): it takes those
            tokens from the cache next step.
        kv_starved_decode: decode requests for which no KV token was left; the backend pauses
            or retracts them.
        mixed: whether decode requests are part of the prefill forward.
    """

    decode_reqs: List[InferReq] = field(default_factory=list)
    prefill_chunks: List[PrefillChunk] = field(default_factory=list)
    prefill_token_num: int = 0
    skipped: List[InferReq] = field(default_factory=list)
    deferred: List[Tuple[InferReq, InferReq]] = field(default_factory=list)
    kv_starved_decode: List[InferReq] = field(default_factory=list)
    mixed: bool = False

    @property
    def has_prefill(self) -> bool:
        """True when at least one prefill chunk was selected."""
        return bool(self.prefill_chunks)

    @property
    def prefill_reqs(self) -> List[InferReq]:
        """Requests of the selected prefill chunks, in order."""
        return [chunk.req for chunk in self.prefill_chunks]

    @property
    def kv_token_num(self) -> int:
        """KV tokens the plan allocates: one per decode request plus every chunk token."""
        return len(self.decode_reqs) + sum(chunk.token_num for chunk in self.prefill_chunks)


class StepPlanner:
    """Picks the decode requests and prefill chunks of a step under token and KV budgets.

    Args:
        batch_max_tokens: most tokens one prefill forward may compute.
        chunked_prefill_size: largest chunk of one request per step; ``None`` or ``0`` disables
            chunked prefill (a request's chunk is then its whole pending length).
        mixed: decode rows ride in the prefill forward: they share its token budget and count
            as submitted tokens (the seed's rule for a mixed batch), and the engine runs one
            forward instead of two.
        defer_repeated_chunks: a request (other than the head) at least half of whose next chunk
            is the same tokens, after the same prefix, as a chunk already planned this step waits
            for the next step and takes those tokens from the prefix cache then (the engine shares
            computed prefixes between steps). Without it a burst of prompts with a long common prefix
            computed each chunk of the prefix once per request the step had room for (8 prompts
            with a 1500-token prefix: 3.2 times the prefix). Only with a prefix cache.
        prompt_ends_cached_next_step: whether a chunk that completes its owner's prompt reaches
            the prefix cache by the next step (the owner publishes it in its first decoding
            step). Not on a PD prefill node, where the owner's KV goes to a decode node and
            reaches the cache only when that node acknowledges it: a request waiting for such a
            chunk could wait step after step for nothing.
    """

    def __init__(
        self,
        batch_max_tokens: int,
        chunked_prefill_size: Optional[int] = None,
        mixed: bool = False,
        defer_repeated_chunks: bool = False,
        prompt_ends_cached_next_step: bool = True,
    ) -> None:
        _require_int(batch_max_tokens, "batch_max_tokens", minimum=1)
        if chunked_prefill_size is not None:
            _require_int(chunked_prefill_size, "chunked_prefill_size", minimum=0)
            # A full chunk larger than the whole budget could never be selected.
            if chunked_prefill_size > batch_max_tokens:
                raise ValueError(
                    f"chunked_prefill_size ({chunked_prefill_size}) must not exceed "
                    f"batch_max_tokens ({batch_max_tokens})"
                )
        self.batch_max_tokens = batch_max_tokens
        self.chunked_prefill_size = chunked_prefill_size or None
        self.mixed = mixed
        self.defer_repeated_chunks = defer_repeated_chunks
        self.prompt_ends_cached_next_step = prompt_ends_cached_next_step

    def plan(
        self,
        decode_reqs: Sequence[InferReq],
        prefill_reqs: Sequence[InferReq],
        kv_free_tokens: KvBudget,
    ) -> StepPlan:
        """Select this step's work from the classified, ordered requests.

        ``decode_reqs`` and ``prefill_reqs`` are the engine's classify phase output, the prefill
        ones already ordered by a strategy.  ``kv_free_tokens`` is the number of allocatable KV
        tokens, or a callable returning it (called once).  Decode requests are served first, one
        KV token each, in their order.
        Prefill requests are then taken in queue order.  The first one (the head) always gets a
        chunk, truncated to the remaining token budget and KV if they are smaller than its
        chunk (with chunked prefill disabled it is not truncated: if it does not fit, no prefill
        runs this step).  A later request whose chunk does not fit is skipped, and later
        (smaller) ones may still fit.
        """
        kv_left = kv_free_tokens() if callable(kv_free_tokens) else kv_free_tokens
        _require_int(kv_left, "kv_free_tokens", minimum=0)
        mixed = self.mixed
        plan = StepPlan(mixed=mixed)

        kv_fit = min(len(decode_reqs), kv_left)
        plan.decode_reqs = list(decode_reqs[:kv_fit])
        plan.kv_starved_decode = list(decode_reqs[kv_fit:])
        kv_left -= kv_fit

        token_budget = self.batch_max_tokens
        if mixed:
            token_budget = max(0, token_budget - len(plan.decode_reqs))
        chunk_token_sum = 0
        for position, req in enumerate(prefill_reqs):
            need = prefill_need_token_num(req, self.chunked_prefill_size)
            if need <= 0:
                raise ValueError(
                    f"prefill_reqs holds request {req.request_id} with no pending tokens; "
                    "finished requests must be filtered out before planning"
                )
            if position == 0:
                # The head of the order is never skipped for lack of budget: with chunked
                # prefill it gets whatever is left, so it advances in every step that has any
                # prefill budget.  Without chunking a prompt must go in one piece; if it does not
                # fit, no later request may take the room it waits for.  This is half of the
                # overtaking bound (the other half pulls protected requests forward).
                if self.chunked_prefill_size is not None:
                    need = min(need, token_budget, kv_left)
                if need <= 0 or need > token_budget or need > kv_left:
                    plan.skipped.extend(prefill_reqs)
                    break
            if need > token_budget or need > kv_left:
                plan.skipped.append(req)
                continue
            owner = None
            if position > 0 and self.defer_repeated_chunks:
                owner = _repeated_chunk_owner(req, need, plan.prefill_chunks, self.prompt_ends_cached_next_step)
            if owner is not None:
                plan.deferred.append((req, owner))
                continue
            plan.prefill_chunks.append(PrefillChunk(req=req, start=req.cur_kv_len, token_num=need))
            token_budget -= need
            kv_left -= need
            chunk_token_sum += need
            if token_budget == 0 or kv_left == 0:
                # Nothing more can fit (every chunk is at least one token): the rest of a long
                # queue is skipped in one go instead of walked request by request.
                plan.skipped.extend(prefill_reqs[position + 1 :])
                break

        plan.prefill_token_num = chunk_token_sum + (len(plan.decode_reqs) if mixed else 0)
        return plan


def _repeated_chunk_owner(req: InferReq, need: int, chunks: Sequence[PrefillChunk],
                          prompt_ends_cached_next_step: bool) -> Optional[InferReq]:
    """The request of a chunk planned this step that ``req`` should take its next tokens from, or None.

    Another request's chunk starts where ``req`` stands, after the same prefix, and holds the
    same tokens as at least half of the ``need`` tokens ``req`` would compute now (as far as
    ``req`` may take tokens from the cache): next step ``req`` adopts them instead of computing
    them again now. A smaller overlap is not worth the step ``req`` would wait, and a chunk that
    completes its owner's prompt is not waited for where the prompt is not cached next step.
    """
    start = req.cur_kv_len
    for chunk in chunks:
        if chunk.start != start:
            continue
        if not prompt_ends_cached_next_step and chunk.end >= chunk.req.input_len:
            continue
        end = min(chunk.end, req.cacheable_prefix_len)
        if end - start < (need + 1) // 2:
            continue
        other = chunk.req
        # A cheap probe before comparing the prefixes (prompts of a burst that share nothing
        # part at their first token).
        if req.token_at(start) != other.token_at(start) or req.token_slice(0, start) != other.token_slice(0, start):
            continue
        if _shared_run_end(req, other, start, end) - start >= (need + 1) // 2:
            return other
    return None


def _shared_run_end(req: InferReq, other: InferReq, start: int, end: int) -> int:
    """The end of the run of equal tokens of ``req`` and ``other`` from ``start`` (at most ``end``);
    a binary search over slice comparisons, so a 1024-token chunk costs about ten of them."""
    low, high = start, end
    while low < high:
        middle = (low + high + 1) // 2
        if req.token_slice(start, middle) == other.token_slice(start, middle):
            low = middle
        else:
            high = middle - 1
    return low


def submit_prefill(plan: StepPlan, counter: ProcessedPrefillTokenCounter) -> int:
    """Account for a prefill forward the backend is submitting; return the tokens counted.

    Call it exactly when the prefill batch of ``plan`` is submitted for execution.  The counter
    advances by ``plan.prefill_token_num`` (computed once during selection) only when the plan
    holds prefill work; a decode-only step leaves it unchanged.
    """
    if not plan.has_prefill:
        return 0
    counter.advance(plan.prefill_token_num)
    return plan.prefill_token_num


def _require_int(value: int, param: str, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{param} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{param} must be >= {minimum}, got {value}")
