"""API-key authentication and the admission-priority rule.

* With API keys configured (``--api_key`` or ``LIGHTLLM_API_KEY``), every endpoint except
  the health probes (``/health``, ``/health/live``, ``/health/ready``, LightLLM's ``/healthz``,
  ``/liveness``, ``/readiness``, and vLLM's ``/ping``) needs ``Authorization: Bearer <key>``
  (what OpenAI clients send); ``/metrics``, ``/v1/models``, ``/tokenize``, ``/detokenize``,
  ``/version`` and the OpenAPI pages included. A missing or unknown key gets 401 with
  ``WWW-Authenticate: Bearer``. Admin keys are accepted wherever API keys are. Without API keys
  the API is open, and a bearer token that is not an admin key is ignored (OpenAI clients always
  send one).
* ``high_priority_request`` puts a request ahead of every other one at admission, so it is
  honoured only from trusted requests: those with an admin key (``--admin_api_key`` or
  ``LIGHTLLM_ADMIN_API_KEY``), or from everyone allowed to use the API when the operator opens it
  with ``--allow_public_priority``. Anyone else asking for it gets 403 naming the field.

* A PD master or node with a cluster key (``--pd_cluster_key`` or ``LIGHTLLM_PD_CLUSTER_KEY``)
  accepts only that key on the cluster's own endpoints (every path under ``/pd/``): nodes and
  master send it to each other, client and admin keys do not open those paths, and the cluster
  key opens nothing else. Without a cluster key those paths follow the rule above (a PD process
  with client keys but no cluster key is refused at start-up, see ``AuthPolicy.check_cluster``).

Keys are compared in constant time over their SHA-256 digests, so neither content nor length leaks
through timing.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from typing import Any, Dict, Iterable, Optional, Tuple

from fastapi import Request
from fastapi.responses import JSONResponse

from lightllm.server.http.errors import APIError, error_body
from lightllm.server.http.service.health import PROBE_PATHS
from lightllm.server.http.middleware.request_guard import ASGIApp, Receive, Scope, Send, header, header_refusal
from lightllm.server.http.server_options import AuthPolicy

PUBLIC_PATHS = PROBE_PATHS  # /health, /health/live, /health/ready, their LightLLM names and /ping
CLUSTER_PATH_PREFIX = "/pd/"
AUTHENTICATION_ERROR = "authentication_error"
PERMISSION_ERROR = "permission_error"
PRIORITY_NOT_ALLOWED = "priority_not_allowed"
_PRIORITY_ALLOWED = "lightllm_priority_allowed"
# What key_guard answers: the key a path needs.
API_KEY_GUARD = "api_key"
CLUSTER_KEY_GUARD = "cluster_key"


# "<scheme> <token>" once the header's outer whitespace is gone: spaces or tabs between the two.
HTTP_WHITESPACE = " \t"
_SCHEME_AND_TOKEN = re.compile(r"([^ \t]+)[ \t]+(.+)", re.DOTALL)


def key_guard(policy: AuthPolicy, path: str) -> Optional[str]:
    """The key a request to ``path`` must carry under ``policy``, or None when it needs none.

    :data:`CLUSTER_KEY_GUARD` on a PD cluster path when a cluster key is set; :data:`API_KEY_GUARD`
    (an API or an admin key) on every other path but the probes when API keys are set.  The
    middleware decides by it, and so does the OpenAPI document's ``security``, so the two agree.
    """
    if policy.cluster_key and path.startswith(CLUSTER_PATH_PREFIX):
        return CLUSTER_KEY_GUARD
    if policy.requires_key and path not in PUBLIC_PATHS:
        return API_KEY_GUARD
    return None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def bearer_token(scope: Scope) -> Optional[str]:
    """The token of an ``Authorization: Bearer <token>`` header, or None.

    The scheme is case-insensitive (RFC 7235: ``bearer``, ``BEARER`` and ``Bearer`` are the same)
    and may be followed by any run of spaces or tabs; the token itself is compared exactly.  Only
    spaces and tabs separate (HTTP's whitespace): ``str.split()`` would also take a no-break space
    or a control character read from the header's Latin-1 bytes.
    """
    value = header(scope, b"authorization")
    if value is None:
        return None
    parts = _SCHEME_AND_TOKEN.fullmatch(value.strip(HTTP_WHITESPACE))
    if parts is None or parts[1].lower() != "bearer":
        return None
    return parts[2]


class KeySet:
    """A set of secret keys checked in constant time."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests: Tuple[bytes, ...] = tuple(_digest(key) for key in keys)

    def __bool__(self) -> bool:
        return bool(self._digests)

    def contains(self, token: Optional[str]) -> bool:
        """True when ``token`` is one of the keys; every key is compared, whatever matches."""
        if token is None:
            return False
        candidate = _digest(token)
        found = False
        for digest in self._digests:
            found |= hmac.compare_digest(candidate, digest)
        return found


def _unauthorized(message: str, code: str, challenge: str) -> JSONResponse:
    return JSONResponse(error_body(message, AUTHENTICATION_ERROR, None, code), status_code=401,
                        headers={"www-authenticate": challenge})


def cluster_key_headers(cluster_key: Optional[str]) -> Optional[Dict[str, str]]:
    """Headers that carry ``cluster_key`` on a call to another process of the cluster (None: no key)."""
    return {"Authorization": f"Bearer {cluster_key}"} if cluster_key else None


def _cluster_key_refusal(token: Optional[str]) -> JSONResponse:
    if token is None:
        return _unauthorized("This is a PD cluster endpoint: send the cluster key (--pd_cluster_key or "
                             "LIGHTLLM_PD_CLUSTER_KEY) as 'Authorization: Bearer <key>'",
                             "missing_cluster_key", 'Bearer realm="lightllm-pd"')
    return _unauthorized("Invalid PD cluster key", "invalid_cluster_key",
                         'Bearer realm="lightllm-pd", error="invalid_token"')


class ApiKeyMiddleware:
    """Answers 401 to requests without a valid key and records whether a request may ask for priority."""

    def __init__(self, app: ASGIApp, *, policy: AuthPolicy) -> None:
        self.app = app
        self.policy = policy
        self._user_keys = KeySet(policy.api_keys)
        self._admin_keys = KeySet(policy.admin_keys)
        self._cluster_key = KeySet([policy.cluster_key] if policy.cluster_key else [])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = header_refusal(scope)
        if refusal is not None:
            # Before the key: with Authorization sent twice, the first copy alone decided 401 or a
            # later 400, so the answer depended on the order of the copies.
            await refusal(scope, receive, send)
            return
        token = bearer_token(scope)
        guard = key_guard(self.policy, str(scope.get("path", "")))
        if guard == CLUSTER_KEY_GUARD:
            if not self._cluster_key.contains(token):
                await _cluster_key_refusal(token)(scope, receive, send)
                return
            scope.setdefault("state", {})[_PRIORITY_ALLOWED] = False
            await self.app(scope, receive, send)
            return
        is_admin = self._admin_keys.contains(token)
        if guard == API_KEY_GUARD and not is_admin:
            if token is None:
                response = _unauthorized("Missing API key: send it as 'Authorization: Bearer <key>'",
                                         "missing_api_key", 'Bearer realm="lightllm"')
                await response(scope, receive, send)
                return
            if not self._user_keys.contains(token):
                response = _unauthorized("Invalid API key", "invalid_api_key",
                                         'Bearer realm="lightllm", error="invalid_token"')
                await response(scope, receive, send)
                return
        scope.setdefault("state", {})[_PRIORITY_ALLOWED] = is_admin or self.policy.allow_public_priority
        await self.app(scope, receive, send)


def check_priority_allowed(request: Request, requested: Any) -> None:
    """Raise 403 naming ``high_priority_request`` when an untrusted request asks for priority."""
    if not requested:
        return
    if request.scope.get("state", {}).get(_PRIORITY_ALLOWED, False):
        return
    raise APIError(
        403,
        "high_priority_request is reserved for trusted clients: send an admin key "
        "('Authorization: Bearer <admin key>', see --admin_api_key), or ask the operator to start the "
        "server with --allow_public_priority",
        PERMISSION_ERROR,
        "high_priority_request",
        PRIORITY_NOT_ALLOWED,
    )
