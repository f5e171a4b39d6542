"""The id a client gives its request: the ``X-Request-Id`` header, else the body's ``request_id``.

Gateways and tracing set ``X-Request-Id`` to correlate a call across services; vLLM builds the
response id from it (``cmpl-<header>``), ahead of the body's ``request_id``.  The id ends up in
the response's ``id``, in its ``x-request-id`` header and in the server log, so it is held to the
body field's rule (letters, digits and ``._:-``, at most 128 characters) and a header outside it
is a 400 naming the header rather than an id dropped without a word.
"""

from __future__ import annotations

import re
from typing import Any

from lightllm.server.http.errors import invalid_request

REQUEST_ID_HEADER = "x-request-id"
# The id rule, shared with the body's request_id (openai_models.OpenAISamplingRequest.request_id).
REQUEST_ID_MAX_LENGTH = 128
REQUEST_ID_PATTERN = r"^[A-Za-z0-9._:-]+$"
_CLIENT_ID = re.compile(REQUEST_ID_PATTERN)


def client_request_id(request: Any, body_request_id: str | None) -> str | None:
    """The client's id for this request: the ``X-Request-Id`` header when sent, else ``body_request_id``.

    ``request`` is the Starlette request (anything with ``headers``); a header that repeats or
    breaks the id rule is a 400 naming ``X-Request-Id``.
    """
    headers = getattr(request, "headers", None)
    values = headers.getlist(REQUEST_ID_HEADER) if headers is not None else []
    if not values:
        return body_request_id
    if len(values) > 1:
        raise invalid_request(f"the X-Request-Id header is sent {len(values)} times; send it once", "X-Request-Id")
    value = values[0]
    if len(value) > REQUEST_ID_MAX_LENGTH or not _CLIENT_ID.fullmatch(value):
        shown = value if len(value) <= 40 else value[:40] + "..."
        raise invalid_request(f"the X-Request-Id header {shown!r} is not a request id: use 1 to 128 letters, digits "
                              "or '._:-'", "X-Request-Id")
    return value
