"""Small messages that cross process boundaries over zmq (pickled dataclasses).

Request content never travels here: only request ids and shared-memory slot indexes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Tuple, Union


@dataclass
class NewRequest:
    """HTTP -> router: a request was written to ``shm_index``."""

    request_id: int
    shm_index: int


@dataclass
class AbortRequest:
    """HTTP or detokenization -> router -> model ranks: stop a request."""

    request_id: int


@dataclass
class AddRequests:
    """Router -> model rank 0: admit these ``(request_id, shm_index)`` pairs.

    ``leader_time``: rank 0's ``time.monotonic()`` when it screened them (0.0 from the router),
    sent on to every TP rank so that time-based decisions (a decode node's KV hold) agree.
    """

    requests: List[Tuple[int, int]]
    leader_time: float = 0.0


@dataclass
class AbortRequests:
    """Router -> model rank 0: abort these running requests."""

    request_ids: List[int]


@dataclass
class StepOutput:
    """Model rank 0 -> detokenization: new tokens are in shared memory; some requests ended.

    ``updates`` holds ``(request_id, shm_index, output_len)`` of requests whose ``output_len``
    grew or whose ``finish_status`` was set, with the ``output_len`` this step published: the
    detokenizer reads up to it, so a request's last token and its finish status always reach it
    in the same message (a read that ran past into the next step's tokens once delivered the
    finish later, without a token to carry the text the decoder held back); ``released`` the
    requests the backend dropped (their slot is no longer written by anyone).

    ``notices`` are rank 0's messages for the HTTP process (a PD node's :class:`PdNotice`,
    :class:`PdSetupDone`, :class:`PdChannelBroken`), raised since the last step output: the
    detokenizer forwards them unread ahead of the step's texts, so a notice reaches the HTTP
    process before the tokens and finish it precedes, on the one path they share.
    """

    updates: List[Tuple[int, int, int]] = field(default_factory=list)
    released: List[Tuple[int, int]] = field(default_factory=list)
    notices: List[Any] = field(default_factory=list)


@dataclass
class RequestsReleased:
    """Model rank 0 -> router: these requests left the running batch."""

    request_ids: List[int]


@dataclass
class TokenEvent:
    """One generated token as the HTTP process hands it to the client."""

    token_id: int
    text: str
    logprob: float
    # ``(token_id, logprob)`` alternatives, most likely first; None when none were requested.
    top_logprobs: List[Tuple[int, float]] | None = None


@dataclass
class DetokenizedOutput:
    """Detokenization -> HTTP: new text for one request, and whether it ended."""

    request_id: int
    tokens: List[TokenEvent]
    finish_reason: str | None
    prompt_cache_len: int
    # ``(token_id, logprob, top)`` of prompt positions 1.. on the request's first message, for a
    # request that asked for prompt logprobs.
    prompt_logprobs: List[Tuple[int, float, List[Tuple[int, float]]]] | None = None
    # With finish_reason "stop": the stop string or stop token id that ended it (None for EOS).
    stop_reason: int | str | None = None


@dataclass
class SlotReleased:
    """Detokenization -> HTTP: nobody reads or writes this request's slot any more."""

    request_id: int
    shm_index: int


@dataclass
class StepTexts:
    """Detokenization -> HTTP: one step's notices (:attr:`StepOutput.notices`), then its
    :class:`DetokenizedOutput` and :class:`SlotReleased` messages, in order, as one message: the
    HTTP process wakes once per step, not once per request (a 128-request decode step was 128
    socket reads and 128 event-loop wake-ups)."""

    messages: List[Union[DetokenizedOutput, SlotReleased, Any]]


@dataclass
class PdTransferSetup:
    """HTTP -> model rank 0 (-> every rank in the command broadcast): (re)start the KV transfer
    handles for ``epoch``; the handles of other epochs (pairs) are not touched.

    Prefill node: each rank's pair meets in the rank's one store at its own transfer port + rank
    (``peer_host`` and ``peer_port`` unused).  Decode node: each rank joins ``peer_host:peer_port + rank``
    (``peer_host`` bare, as a socket takes it: ``fd00::1``, not ``[fd00::1]``).

    ``setup_id`` names this attempt (the HTTP process numbers its setups from 1; 0: none), and
    rank 0's :class:`PdSetupDone` carries it back: an answer to an attempt the HTTP process gave
    up on must not complete a later attempt of the same epoch.
    """

    epoch: int
    peer_host: str = ""
    peer_port: int = 0
    setup_id: int = 0


@dataclass
class PdTransferTeardown:
    """HTTP -> model rank 0 (-> every rank in the command broadcast): close the KV transfer
    handles of ``epoch`` (its peer left the cluster); a no-op for an epoch a rank does not hold.

    No answer comes back: requests of that epoch still on a rank end with the transfer-broken
    error a request without a live handle gets.
    """

    epoch: int


@dataclass
class PdSetupDone:
    """Model rank 0 -> HTTP (a step output notice): the handles of ``epoch`` were started
    (``error`` empty) or not, by the :class:`PdTransferSetup` whose ``setup_id`` it echoes."""

    epoch: int
    error: str = ""
    setup_id: int = 0


@dataclass
class PdNotice:
    """Model rank 0 -> HTTP (a step output notice), about one PD request, ahead of its tokens or finish.

    ``kind``: ``"reserved"`` (decode node: KV reserved, receiving from ``kv_start``),
    ``"transferred"`` (this side's transfer ended well: ``seconds``, ``nbytes``) or
    ``"transfer_failed"`` (``error_kind``: ``transfer_failed`` | ``lease_expired`` |
    ``transfer_broken``; ``message`` says why) or ``"busy"`` (decode node, ahead of a
    ``FINISH_BUSY`` finish: ``error_kind`` is the limit hit, ``kv_tokens`` | ``request_slots``;
    ``message`` states its numbers).
    """

    request_id: int
    kind: str
    kv_start: int = 0
    seconds: float = 0.0
    nbytes: int = 0
    error_kind: str = ""
    message: str = ""


@dataclass
class PdChannelBroken:
    """Model rank 0 -> HTTP (a step output notice): a rank's transfer group of ``epoch`` failed;
    it needs a new setup."""

    epoch: int
    reason: str
