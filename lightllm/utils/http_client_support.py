"""What the command-line tools that call a running server share: the API key they send, and the
one-line form of an HTTP error answer.

They send the key the way vLLM's ``vllm bench serve`` does: ``Authorization: Bearer <key>``, the
key from ``--api-key`` or else ``OPENAI_API_KEY``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional, Sequence

import httpx

API_KEY_ENV = "OPENAI_API_KEY"
API_KEY_HELP = (f"API key sent as 'Authorization: Bearer KEY' with every request (default: the {API_KEY_ENV} "
                "environment variable, as vLLM's benchmark reads it; '' sends none)")


def default_api_key() -> Optional[str]:
    """The key a tool sends when ``--api-key`` is not given: ``OPENAI_API_KEY``, if set and not empty."""
    return os.environ.get(API_KEY_ENV) or None


def without_api_key(argv: Sequence[str]) -> list[str]:
    """``argv`` with the value of ``--api-key`` replaced by ``<given>``, for a command line a report records."""
    shown: list[str] = []
    hide_next = False
    for token in argv:
        if hide_next:
            shown.append("<given>")
            hide_next = False
        elif token == "--api-key":
            shown.append(token)
            hide_next = True
        elif token.startswith("--api-key="):
            shown.append("--api-key=<given>")
        else:
            shown.append(token)
    return shown


def auth_headers(api_key: Optional[str]) -> dict[str, str]:
    """The header that carries ``api_key`` (none for no key or an empty one)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def http_refusal(response: httpx.Response, limit: int = 500) -> str:
    """``HTTP <status>: <the server's own message>`` on one line, from an error answer.

    The message is the OpenAI error's ``error.message`` (our server's errors), a FastAPI
    ``detail`` or a ``message``; else the body's text, else the status's reason.  httpx's own
    status error says only the status, on two lines with a link, and drops what the server said.
    """
    try:
        body = json.loads(response.content or b"null")
    except ValueError:
        body = None
    message: Any = None
    if isinstance(body, dict):
        error = body.get("error")
        message = error.get("message") if isinstance(error, dict) else error
        if not message:
            message = body.get("detail") or body.get("message")
    if message and not isinstance(message, str):
        message = json.dumps(message, ensure_ascii=False)
    if not message:
        message = response.content.decode("utf-8", "replace").strip() or response.reason_phrase
    text = " ".join(str(message).split())
    return f"HTTP {response.status_code}: {text[:limit]}"
