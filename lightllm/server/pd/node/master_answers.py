"""How a PD node reads its master's answers: errors, final refusals, and an older master's 400s.

The registration client (:mod:`lightllm.server.pd.node.registration_client`) sends each
registration and heartbeat with the node's report fields (:data:`REPORT_FIELDS`).  A master of an
older version refuses a field it does not know with a 400 naming it (:func:`refuses_report`): the
client then leaves the fields out for that master.  Any other error answer is read by
:func:`error_of`, tolerating a body that is not the project's error shape (a proxy's page); a
refusal that is final for this node is a :class:`NodeRegistrationRefused`.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import httpx

from lightllm.server.pd.protocol.membership import LOAD_KEY, STATE_KEY


class NodeRegistrationRefused(RuntimeError):
    """The master refused this node for good; ``code`` is the master's error code."""

    def __init__(self, message: str, code: Optional[str]):
        super().__init__(message)
        self.code = code


# The fields ``report`` may add; a 400 naming one of them comes from a master that predates it.
REPORT_FIELDS = (LOAD_KEY, STATE_KEY)


def error_of(response: httpx.Response) -> tuple[str, Optional[str]]:
    """(message, code) of an error answer, tolerating a body that is not the project's shape."""
    try:
        error = response.json()["error"]
        return str(error["message"]), error.get("code")
    except Exception:  # noqa: BLE001 - a proxy's HTML error page is still an error
        return f"HTTP {response.status_code}: {response.text[:200]}", None


def refuses_report(response: httpx.Response, sent: Mapping[str, Any]) -> bool:
    """Whether the answer is a 400 about one of the report fields the body carried."""
    if response.status_code != 400 or not sent:
        return False
    try:
        param = response.json()["error"].get("param")
    except Exception:  # noqa: BLE001 - not the project's error shape: not about our fields
        return False
    # "load" itself, or one of its fields ("load.free_kv_tokens") a master reads otherwise.
    return isinstance(param, str) and param.split(".", 1)[0] in sent
