"""Request bodies, error responses and streams in the OpenAPI document.

The generation handlers read the raw body and validate it themselves (so every error gets the
OpenAI error shape and names the field), which means FastAPI cannot see their body models.
Each POST route therefore declares its body through ``openapi_extra`` with a reference to the
pydantic model's JSON schema, and :func:`install_request_schemas` adds those schemas (and the
models they nest) to ``components.schemas``, so fuzzers and client generators can work from
``/openapi.json``.

The document also states what else a client can get back: every operation lists the error
statuses the server answers with (all carrying the ``ErrorResponse`` body of
:mod:`lightllm.server.http.errors`; ``/generate`` and ``/generate_stream`` the 403 of a priority
asked for without the right to it), a streaming route's 200 lists ``text/event-stream``
next to ``application/json`` (``/generate_stream``, which always streams, only the former), the
health probes list their 503, an operation lists a 401 only where a key is asked for, and ``/metrics`` its plain-text
exposition.  The document is built for the server's :class:`AuthPolicy`: with API keys (or a PD
cluster key) it declares HTTP bearer schemes and marks each operation that needs one, as
:func:`~lightllm.server.http.middleware.auth.key_guard` decides for the middleware.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from fastapi import FastAPI
from pydantic import BaseModel

from lightllm.server.http.middleware.auth import (API_KEY_GUARD, CLUSTER_KEY_GUARD, PERMISSION_ERROR,
                                                  PRIORITY_NOT_ALLOWED, key_guard)
from lightllm.server.http.service.health import LIVE_PATH, PROBE_PATHS, probe_meaning
from lightllm.server.http.server_options import AuthPolicy

_REF_TEMPLATE = "#/components/schemas/{model}"
ERROR_SCHEMA_NAME = "ErrorResponse"

# The body of every 4xx/5xx answer (api_errors.error_body); extra keys are allowed because a busy
# PD node adds its role.
ERROR_SCHEMA: dict[str, Any] = {
    "title": ERROR_SCHEMA_NAME,
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string"},
            "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "code": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        },
    }},
}

# Status -> when it is answered.  Every operation may get the "all" ones (but the probes, see
# _PROBE_ERRORS); the others by method.
_INTERNAL_ERROR = "Internal error (the details are in the server log)"
_ERRORS_ALL = {
    "401": "Missing or wrong key (the operation's security names which)",
    "500": _INTERNAL_ERROR,
}
_ERRORS_POST = {
    "400": "Invalid request: the message names the field in `param`",
    "404": "The requested `model` is not served",
    "408": "The body did not arrive within the body timeout",
    "413": "The body is larger than the server accepts",
    "415": "The body is not JSON",
    "503": "The server is busy, starting or shutting down; retry later",
}
# Marks an operation whose 200 is never JSON (removed from the document once applied).
_ONLY_STREAMS = "x-lightllm-only-streams"
# Marks an operation whose body may ask for admission priority (auth.check_priority_allowed; removed once applied).
_ASKS_PRIORITY = "x-lightllm-asks-priority"
_ERRORS_PRIORITY = {"403": f"high_priority_request without the right to it (type {PERMISSION_ERROR}, code "
                           f"{PRIORITY_NOT_ALLOWED}): it needs an admin key (--admin_api_key), or a server "
                           "started with --allow_public_priority; with or without --api_key"}
# The HTTP bearer schemes of the keys (key_guard's answers), declared when the policy sets such keys.
_SECURITY_SCHEMES = {
    API_KEY_GUARD: ("bearerAuth", "An API key (--api_key) or an admin key (--admin_api_key), as "
                                  "'Authorization: Bearer <key>'"),
    CLUSTER_KEY_GUARD: ("pdClusterKey", "The PD cluster key (--pd_cluster_key), as 'Authorization: Bearer <key>'; "
                                        "no client or admin key opens these paths"),
}
# Only a GET with a path parameter can name something that does not exist (/v1/models/{model_id}).
_ERRORS_GET_ITEM = {"404": "Not found (an unknown model id)"}
# The probes need no API key (auth.PUBLIC_PATHS), and 503 is how they say no (health.health_answer).
_PROBE_ERRORS = {
    "ready": {"500": _INTERNAL_ERROR,
              "503": "Not ready: the server is starting, draining or shutting down, or a process of it failed; "
                     "the error code says which"},
    "live": {"500": _INTERNAL_ERROR,
             "503": "The server's event loop has not run for a long time (code event_loop_stalled)"},
}
_PROBE_OK_SCHEMA = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}
# Routes whose 200 is not JSON: path -> (media type, description).
_TEXT_RESPONSES = {"/metrics": ("text/plain", "Prometheus metrics in the text exposition format")}
_STREAM_DESCRIPTION = ("Server-sent events (the OpenAI routes with `stream: true`, /generate_stream always), one `data: <JSON chunk>` line per event (an error "
                       "that happens after the first byte comes as a `data: {\"error\": ...}` event); the OpenAI "
                       "routes end with `data: [DONE]`.")


def request_body(model_cls: type[BaseModel], streams: bool | str = False,
                 asks_priority: bool = False) -> dict[str, Any]:
    """``openapi_extra`` for a route whose JSON body is validated into ``model_cls``.

    ``streams``: True when the route answers with server-sent events if the body asks to stream,
    ``"always"`` when it answers with nothing else.  ``asks_priority``: the body may ask for
    admission priority, which an untrusted client is refused with a 403.
    """
    schema = {"$ref": _REF_TEMPLATE.format(model=model_cls.__name__)}
    extra: dict[str, Any] = {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
    if streams:
        description = ("Server-sent events: this route always streams" if streams == "always"
                       else "The response: JSON, or server-sent events when streaming")
        extra["responses"] = {"200": {
            "description": description,
            "content": {"text/event-stream": {"schema": {"type": "string", "description": _STREAM_DESCRIPTION}}}}}
        if streams == "always":
            extra[_ONLY_STREAMS] = True
    if asks_priority:
        extra[_ASKS_PRIORITY] = True
    return extra


def request_body_any(*model_classes: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route whose JSON body is one of ``model_classes`` (``/tokenize``'s two shapes)."""
    refs = [{"$ref": _REF_TEMPLATE.format(model=model_cls.__name__)} for model_cls in model_classes]
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {"anyOf": refs}}}}}


def _errors_of(path: str, method: str, asks_priority: bool, policy: AuthPolicy) -> dict[str, str]:
    """Status -> description of the errors ``method`` on ``path`` can answer with."""
    if path in PROBE_PATHS:
        return _PROBE_ERRORS["live" if probe_meaning(path) == LIVE_PATH else "ready"]
    if method == "post":
        # Everyone may ask for priority on a server started with --allow_public_priority: no 403 there.
        refused_priority = _ERRORS_PRIORITY if asks_priority and not policy.allow_public_priority else {}
        errors = {**_ERRORS_ALL, **_ERRORS_POST, **refused_priority}
    else:
        errors = {**_ERRORS_ALL, **(_ERRORS_GET_ITEM if "{" in path else {})}
    if key_guard(policy, path) is None:
        errors.pop("401")  # the key check never answers where no key is asked for
    return errors


def _describe_success(path: str, responses: dict[str, Any]) -> None:
    """The 200 of a probe (a small status object) or of a plain-text route, where FastAPI guesses JSON."""
    ok = responses.get("200")
    if ok is None:
        return
    if path in PROBE_PATHS:
        ok["description"] = ('Alive: {"status": "alive"}' if probe_meaning(path) == LIVE_PATH
                             else 'Ready to serve requests: {"status": "ok"}')
        ok["content"] = {"application/json": {"schema": _PROBE_OK_SCHEMA}}
    elif path in _TEXT_RESPONSES:
        media_type, description = _TEXT_RESPONSES[path]
        ok["description"] = description
        ok["content"] = {media_type: {"schema": {"type": "string"}}}


def _add_error_responses(document: dict[str, Any], policy: AuthPolicy) -> None:
    """Every operation lists the error statuses it can answer with, each with the error body."""
    body = {"application/json": {"schema": {"$ref": _REF_TEMPLATE.format(model=ERROR_SCHEMA_NAME)}}}
    for path, operations in document.get("paths", {}).items():
        for method, operation in operations.items():
            if not isinstance(operation, dict) or "responses" not in operation:
                continue
            if operation.pop(_ONLY_STREAMS, False):
                operation["responses"]["200"]["content"].pop("application/json", None)
            errors = _errors_of(path, method, operation.pop(_ASKS_PRIORITY, False), policy)
            responses = operation["responses"]
            _describe_success(path, responses)
            # FastAPI's own 422 never happens: bodies are validated by hand into 400s.
            responses.pop("422", None)
            for status, description in errors.items():
                responses.setdefault(status, {"description": description, "content": body})


def _add_security(document: dict[str, Any], policy: AuthPolicy) -> None:
    """The bearer schemes ``policy`` sets keys for, and on each operation the one its path needs."""
    used: set[str] = set()
    for path, operations in document.get("paths", {}).items():
        guard = key_guard(policy, path)
        if guard is None:
            continue
        name = _SECURITY_SCHEMES[guard][0]
        used.add(guard)
        for operation in operations.values():
            if isinstance(operation, dict) and "responses" in operation:
                operation["security"] = [{name: []}]
    if used:
        document["components"]["securitySchemes"] = {
            name: {"type": "http", "scheme": "bearer", "description": description}
            for name, description in (_SECURITY_SCHEMES[guard] for guard in sorted(used))}


def install_request_schemas(app: FastAPI, models: Iterable[type[BaseModel]],
                            policy: AuthPolicy | None = None) -> None:
    """Make ``app.openapi()`` include the JSON schemas of ``models`` as components, and state the
    errors and keys of the server ``policy`` describes (None: an open server)."""
    models = list(models)
    policy = policy or AuthPolicy()
    build_default: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = build_default()
        components = document.setdefault("components", {}).setdefault("schemas", {})
        # FastAPI's 422 schemas: the 422s that used them are removed below (bodies are validated into 400s).
        for unused in ("HTTPValidationError", "ValidationError"):
            components.pop(unused, None)
        components[ERROR_SCHEMA_NAME] = ERROR_SCHEMA
        _add_error_responses(document, policy)
        _add_security(document, policy)
        for model_cls in models:
            schema = model_cls.model_json_schema(ref_template=_REF_TEMPLATE)
            components.update(schema.pop("$defs", {}))
            components[model_cls.__name__] = schema
        app.openapi_schema = document
        return document

    app.openapi = openapi  # type: ignore[method-assign]
