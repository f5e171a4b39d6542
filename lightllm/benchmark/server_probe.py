"""What ``bench_serving`` asks a running server before it sends anything: whether it answers, and its context.

Both are asked before the tokenizer is loaded and the prompts are built (seconds for a real
tokenizer), so a run that cannot measure anything ends at once.

``GET /v1/models`` lists each model with ``max_model_len`` (vLLM's field; ours is the server's
``--max_req_total_len``).  A request past it is answered with HTTP 400, or has its output cut to
the room its prompt leaves, so the run would report lengths it did not measure; the workload is
refused before anything is sent (:func:`~lightllm.benchmark.workload_context.check_workloads_within`).
The model is looked up by its id; a name the server does not list is still checked against the
context of the only model a server lists (ours also takes its checkpoint path as the model name),
and is refused (:class:`UnknownModel`) when the server lists several, since none of their contexts
is known to be the one the requests meet.
A server that reports no context (another engine, an API without ``/v1/models``) is not checked.
A server that answers ``/v1/models`` with an error (401 without its ``--api_key``) refuses the run
(:class:`ServerRefused`): every request would get the same answer.

The tools that talk to a running server send its API key as :mod:`lightllm.utils.http_client_support` says.
"""

from __future__ import annotations

from typing import Any, Optional

import httpx

from lightllm.benchmark.context_limit import ContextLimit
from lightllm.utils.http_client_support import auth_headers, http_refusal

# Statuses that say the server has no /v1/models (another engine's API), not that it refused us.
NO_LISTING_STATUSES = (404, 405)


class ServerRefused(ValueError):
    """The server answered a request the tool must make with an HTTP error; the message is one line."""


class NoModelListed(ValueError):
    """``GET /v1/models`` answered, but with no model list to take a default model from (one line)."""


class UnknownModel(ValueError):
    """The model named is none of the several models ``GET /v1/models`` lists (one line)."""


def refused_probe(base_url: str, path: str, response: httpx.Response) -> ServerRefused:
    """The one-line refusal of a server that answered ``path`` with an HTTP error."""
    return ServerRefused(f"the server at {base_url.rstrip('/')} refused {path}: {http_refusal(response)}")


def check_reachable(base_url: str, timeout_s: float = 10.0, api_key: Optional[str] = None) -> Optional[str]:
    """Why the server at ``base_url`` cannot be reached, or None when it answers at all.

    Any HTTP answer, even a 404 or a 401, proves a server listens there.
    """
    try:
        httpx.get(base_url.rstrip("/") + "/", timeout=timeout_s, trust_env=False, headers=auth_headers(api_key))
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        return str(exc) or type(exc).__name__
    return None


def _listed_models(listing: Any) -> list[dict[str, Any]]:
    """The entries with an id in a ``/v1/models`` answer (none for anything else)."""
    entries = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(entries, list):
        return []
    return [entry for entry in entries if isinstance(entry, dict) and "id" in entry]


def _model_entry(listing: Any, model: Optional[str], url: str) -> Optional[dict[str, Any]]:
    """The entry of ``model`` in a ``/v1/models`` answer (the first one when ``model`` is None).

    Raises:
        UnknownModel: ``model`` is not listed and the server lists several models.
    """
    entries = _listed_models(listing)
    if not entries:
        return None
    if model is None:
        return entries[0]
    for entry in entries:
        if entry["id"] == model:
            return entry
    if len(entries) == 1:
        # A name the server does not list may be one it takes for its only model (ours takes the
        # checkpoint path as well as the id), and a request can only meet that model's context.
        return entries[0]
    listed = ", ".join(repr(str(entry["id"])) for entry in entries)
    raise UnknownModel(f"model {model!r} is none of the models {url} lists ({listed}); name one of them")


def served_context(base_url: str, model: Optional[str], timeout_s: float = 10.0,
                   api_key: Optional[str] = None) -> Optional[ContextLimit]:
    """The context the server at ``base_url`` reports for ``model`` (its first model when None).

    A ``model`` the server does not list gets the context of the only model it lists.  ``None``
    when it reports none: no ``/v1/models`` (404, 405), no model listed, or no positive integer
    ``max_model_len``; the run then goes on unchecked, as before.

    Raises:
        ServerRefused: the server answered with another HTTP error (401 for a missing or wrong
            ``api_key``): the run would get the same answer to every request.
        UnknownModel: ``model`` is not listed and the server lists several models.
    """
    url = base_url.rstrip("/") + "/v1/models"
    try:
        answer = httpx.get(url, timeout=timeout_s, trust_env=False, headers=auth_headers(api_key))
    except (httpx.HTTPError, httpx.InvalidURL):
        return None
    if answer.status_code >= 400 and answer.status_code not in NO_LISTING_STATUSES:
        raise refused_probe(base_url, "/v1/models", answer)
    try:
        listing = answer.json() if answer.status_code == 200 else None
    except ValueError:
        return None
    entry = _model_entry(listing, model, url)
    tokens = None if entry is None else entry.get("max_model_len")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        return None
    return ContextLimit(tokens, f"max_model_len of model {entry.get('id')!r} in {url}", "the server's context")


async def fetch_default_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id listed by ``GET /v1/models``.

    Raises:
        ServerRefused: the server answered with an HTTP error (its message in one line).
        NoModelListed: it lists no model (or answered something that is not a model list).
    """
    response = await client.get(base_url.rstrip("/") + "/v1/models")
    if response.status_code >= 400:
        raise refused_probe(base_url, "/v1/models", response)
    try:
        listing = response.json()
    except ValueError:
        listing = None
    models = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(models, list) or not models or not isinstance(models[0], dict) or "id" not in models[0]:
        # Not an OpenAI model list (another service on the port, a proxy's page): said, not a traceback.
        raise NoModelListed(f"{base_url}/v1/models lists no model (answered {response.text[:120]!r}); "
                         "pass --model explicitly")
    return str(models[0]["id"])
