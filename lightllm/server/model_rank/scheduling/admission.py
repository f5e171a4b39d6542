"""The model rank's admission check: whether this rank can run a request at all.

A request's own fields were checked when its :class:`~lightllm.server.core.objs.request_spec.RequestSpec`
was built, and again when rank 0 rebuilt it from shared memory.  What remains is this rank's
limits: rank 0's ``screen`` runs :func:`check_request` on every record it reads before any rank
admits the request, so a damaged record (or one no rank here can run) fails alone, with
``FINISH_ERROR``, instead of failing the batch it would join.  Nothing after the screen checks
the request again.
"""

from __future__ import annotations

from typing import Any


class RequestRejected(ValueError):
    """A request cannot run on this rank (its parameters or prompt are invalid here)."""


def check_request(spec: Any, *, vocab_size: int, max_req_total_len: int, grammar_enabled: bool) -> None:
    """Raise :class:`RequestRejected` unless a rank with these limits can run ``spec``.

    ``spec`` is typed ``Any`` because it comes from a shared-memory record and is checked here
    to really be a ``RequestSpec``; ``grammar_enabled`` says whether the rank has structured output.
    """
    # Imported here: the scheduling core (this module included) does not depend on the
    # server's record types at import time.
    from lightllm.server.core.objs.request_spec import RequestSpec

    if not isinstance(spec, RequestSpec):
        raise RequestRejected(f"a request must be a RequestSpec, got {type(spec).__name__}")
    try:
        spec.check_fits(vocab_size, max_req_total_len)
    except ValueError as exc:
        raise RequestRejected(str(exc)) from None
    if spec.params.grammar is not None and not grammar_enabled:
        raise RequestRejected("structured output is not available on this rank")
