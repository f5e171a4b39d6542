"""The one check a shared-memory record needs beyond :class:`~.request_spec.RequestSpec`'s own: the id.

A request's fields are checked once, by :class:`~lightllm.server.core.objs.request_spec.RequestSpec`;
the request id is not part of the spec (the HTTP manager, or a PD master, assigns it), so
:meth:`ShmReqBuffer.write_request <lightllm.server.core.objs.shm_req_buffer.ShmReqBuffer.write_request>`,
the manager and a PD node's wire format check it here.  It raises ``ValueError`` naming the id
before anything is written: ``NO_REQUEST`` or a value the record cannot hold would break slot
ownership for every process.
"""

from __future__ import annotations

from lightllm.server.core.objs.shm_req_layout import MAX_REQUEST_ID


def check_request_id(request_id: object) -> None:
    """Raise ``ValueError`` unless ``request_id`` is an id a record can hold."""
    if isinstance(request_id, bool) or not isinstance(request_id, int) or not 0 <= request_id <= MAX_REQUEST_ID:
        raise ValueError(f"request_id must be an int in [0, {MAX_REQUEST_ID}], got {request_id!r}")
