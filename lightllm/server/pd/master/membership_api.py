"""The HTTP side of PD membership: the endpoints nodes call, and the master's readiness probe.

Endpoints of :func:`membership_router` (JSON in and out; errors in the project's
``{"error": {"message", "type", "param", "code"}}`` shape):

* ``POST /pd/register`` -- body: a :class:`~.node_info.NodeInfo` as JSON, optionally with the
  node's ``load`` and ``state`` (:mod:`lightllm.server.pd.protocol.membership`).  200
  ``{"node_id", "master_id", "heartbeat_interval_s", "max_missed_heartbeats", "cluster_key"}``
  (``cluster_key``: whether the master sends the cluster key on its calls to nodes); 400 for an
  invalid body (``param`` names the field); 409 ``incompatible_node`` (the message names every
  mismatched field) or ``node_id_in_use``.
* ``POST /pd/heartbeat`` -- body ``{"node_id": str}``, optionally with ``"load"`` (an object of
  :class:`~lightllm.server.pd.protocol.membership.NodeLoad` fields) and ``"state"``
  (``serving`` or ``draining``); a bad value is a 400 naming the field.  200 with the same body
  as a registration; 404 ``unknown_node`` when the master does not know the node (it was
  dropped, or the master restarted): the node registers again.  Both answers carry
  ``continuations_pending``: for a draining node, how many generations in flight may still send it
  a continuation segment (while no serving node of its role is left; 0 otherwise), which its
  drain waits for.
* ``POST /pd/deregister`` -- body ``{"node_id": str}``: a draining node that stops leaves the
  live set at once.  200 ``{"node_id", "dropped": bool, "message"}``: ``dropped`` false (with the
  reason in ``message``) for a node the master does not know or that is not draining (a node
  restarted under the same id keeps its new incarnation); the silence rule drops it later anyway.
* ``GET /pd/nodes`` -- ``{"ready", "missing", "master_id", "heartbeat_interval_s",
  "max_missed_heartbeats", "nodes": [registration + "heartbeats", "last_heartbeat_age_s",
  "state", "load", "load_age_s" + what the master adds per node (``node_details``: its
  in-flight requests and transfer pairs)]}``.

:func:`readiness_response` is the master's ``/health``: 200 ``{"status": "ok"}`` once at least
one prefill and one decode node are alive, else 503 with code ``pd_not_ready`` and a message
naming what is missing (``"no decode node registered"``).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Callable, Dict, Optional, Tuple

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from lightllm.server.http.errors import INVALID_REQUEST, NOT_FOUND, SERVICE_UNAVAILABLE, APIError, invalid_request
from lightllm.server.pd.protocol.membership import (
    CONTINUATIONS_PENDING_KEY,
    DEREGISTER_PATH,
    HEARTBEAT_PATH,
    LOAD_KEY,
    NODES_PATH,
    REGISTER_PATH,
    STATE_KEY,
    UNKNOWN_NODE_CODE,
    MembershipBodyError,
    NodeLoad,
    parse_state,
)
from lightllm.server.pd.protocol.node_info import NodeInfo, NodeInfoError
from lightllm.server.pd.master.node_registry import NOT_READY_CODE, NodeRegistry, RegistrationRefused

# Per-node fields the master's request side adds to /pd/nodes (node id -> fields).
NodeDetails = Callable[[str], Dict[str, Any]]
# How many generations in flight may still send the node a continuation segment (node id -> count).
PendingContinuations = Callable[[str], int]


def _load_and_state(body: Dict[str, Any]) -> Tuple[Optional[NodeLoad], Optional[str]]:
    """Take the optional ``load`` and ``state`` out of ``body`` (a 400 naming a bad field)."""
    try:
        load = NodeLoad.from_body(body.pop(LOAD_KEY)) if body.get(LOAD_KEY) is not None else None
        state = parse_state(body.pop(STATE_KEY)) if body.get(STATE_KEY) is not None else None
    except MembershipBodyError as exc:
        raise invalid_request(str(exc), exc.param) from None
    body.pop(LOAD_KEY, None)
    body.pop(STATE_KEY, None)
    return load, state


async def _json_object(request: Request) -> Dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError):
        raise invalid_request("the request body must be a JSON object", None, "invalid_json") from None
    if not isinstance(body, dict):
        message = f"the request body must be a JSON object, got {type(body).__name__}"
        raise invalid_request(message, None, "invalid_json")
    return body


def readiness_response(registry: NodeRegistry, refusal: Optional[Callable[[], Optional[Exception]]] = None) -> Response:
    """200 ``{"status": "ok"}`` when the cluster is ready, else a 503 naming what is missing.

    ``refusal`` (the master's manager) returns the error new requests get while the master
    refuses them (it is stopping); /health then answers that error's 503.
    """
    problem = readiness_problem(registry, refusal)
    if problem is None:
        return JSONResponse({"status": "ok"})
    return APIError(503, problem[1], SERVICE_UNAVAILABLE, None, problem[0]).to_response()


def readiness_problem(registry: NodeRegistry, refusal: Optional[Callable[[], Optional[Exception]]] = None
                      ) -> Optional[Tuple[Optional[str], str]]:
    """None when the cluster is ready, else (code, message) of its 503 (the front door answers with it too)."""
    refused = refusal() if refusal is not None else None
    if refused is not None:
        return getattr(refused, "code", None), str(refused)
    missing = registry.missing()
    if not missing:
        return None
    return NOT_READY_CODE, f"The PD cluster is not ready: {'; '.join(missing)}"


def new_master_id() -> str:
    """A fresh id for one start of the master process."""
    return uuid.uuid4().hex[:12]


class MembershipEndpoints:
    """The ``/pd/*`` membership endpoints over one registry, one method a route (see the module docstring).

    The route methods carry comments, not docstrings: FastAPI would put a docstring in the
    OpenAPI schema as the route's description.
    """

    def __init__(self, registry: NodeRegistry, master_id: str, has_cluster_key: bool = False,
                 node_details: Optional[NodeDetails] = None,
                 continuations: Optional[PendingContinuations] = None) -> None:
        self.registry = registry
        self.master_id = master_id
        self.has_cluster_key = has_cluster_key
        self.node_details = node_details
        self.continuations = continuations

    def router(self) -> APIRouter:
        """An APIRouter with ``POST /pd/register``, ``/pd/heartbeat`` and ``/pd/deregister``, and
        ``GET``/``HEAD /pd/nodes``."""
        router = APIRouter()
        router.add_api_route(REGISTER_PATH, self.register, methods=["POST"])
        router.add_api_route(HEARTBEAT_PATH, self.heartbeat, methods=["POST"])
        router.add_api_route(DEREGISTER_PATH, self.deregister, methods=["POST"])
        router.add_api_route(NODES_PATH, self.nodes, methods=["GET"])
        router.add_api_route(NODES_PATH, self.nodes, methods=["HEAD"], include_in_schema=False)
        return router

    def _accepted(self, node_id: str) -> Dict[str, Any]:
        """The body of a 200 answer to a registration or a heartbeat of ``node_id``."""
        return {
            "node_id": node_id,
            "master_id": self.master_id,
            "heartbeat_interval_s": self.registry.heartbeat_interval_s,
            "max_missed_heartbeats": self.registry.max_missed_heartbeats,
            "cluster_key": self.has_cluster_key,
            CONTINUATIONS_PENDING_KEY: self.continuations(node_id) if self.continuations is not None else 0,
        }

    # POST /pd/register
    async def register(self, request: Request) -> Response:
        try:
            body = await _json_object(request)
            load, state = _load_and_state(body)
            info = NodeInfo.from_dict(body)
            self.registry.register(info, load, state)
        except APIError as exc:
            return exc.to_response()
        except NodeInfoError as exc:
            return invalid_request(str(exc), exc.param, "invalid_node_info").to_response()
        except RegistrationRefused as exc:
            return APIError(409, str(exc), INVALID_REQUEST, None, exc.code).to_response()
        return JSONResponse(self._accepted(info.node_id))

    # POST /pd/heartbeat
    async def heartbeat(self, request: Request) -> Response:
        try:
            body = await _json_object(request)
            unknown = sorted(set(body) - {"node_id", LOAD_KEY, STATE_KEY})
            if unknown:
                raise invalid_request(f"unknown heartbeat field(s): {', '.join(unknown)}", unknown[0])
            load, state = _load_and_state(body)
        except APIError as exc:
            return exc.to_response()
        node_id = body.get("node_id")
        if not isinstance(node_id, str) or not node_id:
            return invalid_request(f"node_id must be a non-empty string, got {node_id!r}", "node_id").to_response()
        if not self.registry.heartbeat(node_id, load, state):
            message = (
                f"node {node_id!r} is not registered with this master (it was dropped or the master "
                f"restarted); register again"
            )
            return APIError(404, message, NOT_FOUND, "node_id", UNKNOWN_NODE_CODE).to_response()
        return JSONResponse(self._accepted(node_id))

    # POST /pd/deregister
    async def deregister(self, request: Request) -> Response:
        try:
            body = await _json_object(request)
        except APIError as exc:
            return exc.to_response()
        unknown = sorted(set(body) - {"node_id"})
        if unknown:
            return invalid_request(f"unknown deregistration field(s): {', '.join(unknown)}", unknown[0]).to_response()
        node_id = body.get("node_id")
        if not isinstance(node_id, str) or not node_id:
            return invalid_request(f"node_id must be a non-empty string, got {node_id!r}", "node_id").to_response()
        why_not = self.registry.leave(node_id)
        message = why_not if why_not is not None else f"node {node_id!r} left the cluster"
        return JSONResponse({"node_id": node_id, "dropped": why_not is None, "message": message})

    # GET and HEAD /pd/nodes
    async def nodes(self) -> Response:
        listed = self.registry.snapshot()
        if self.node_details is not None:
            listed = [{**entry, **self.node_details(str(entry["node_id"]))} for entry in listed]
        return JSONResponse(
            {
                "ready": self.registry.ready,
                "missing": self.registry.missing(),
                "master_id": self.master_id,
                "heartbeat_interval_s": self.registry.heartbeat_interval_s,
                "max_missed_heartbeats": self.registry.max_missed_heartbeats,
                "nodes": listed,
            }
        )


def membership_router(registry: NodeRegistry, master_id: str, has_cluster_key: bool = False,
                      node_details: Optional[NodeDetails] = None,
                      continuations: Optional[PendingContinuations] = None) -> APIRouter:
    """An APIRouter with the ``/pd/*`` membership endpoints over ``registry`` (:class:`MembershipEndpoints`).

    ``master_id`` (see :func:`new_master_id`) identifies this start of the master in every
    answer, so a node's log shows when it is talking to a restarted master.  ``has_cluster_key``
    tells the nodes whether the master sends a cluster key on its calls to them.
    ``node_details`` adds the request side's fields to each node of ``GET /pd/nodes``;
    ``continuations`` gives a draining node's answers their ``continuations_pending``.
    """
    return MembershipEndpoints(registry, master_id, has_cluster_key, node_details, continuations).router()


def readiness_router(registry: NodeRegistry, path: str = "/health",
                     refusal: Optional[Callable[[], Optional[Exception]]] = None) -> APIRouter:
    """An APIRouter answering ``GET``/``HEAD path`` with :func:`readiness_response`."""
    router = APIRouter()

    async def health() -> Response:
        return readiness_response(registry, refusal)

    # /health/ready is the same probe under the name Kubernetes users look for.
    for route_path in (path, f"{path}/ready"):
        router.add_api_route(route_path, health, methods=["GET"])
        router.add_api_route(route_path, health, methods=["HEAD"], include_in_schema=False)
    return router
