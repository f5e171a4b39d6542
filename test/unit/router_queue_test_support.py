"""Router-queue requests for the router admission tests."""

from __future__ import annotations

from lightllm.server.router.req_queue.normal_queue import RouterReq


def router_req(rid: int, input_len: int = 10, new: int = 10, high: bool = False) -> RouterReq:
    """A router request whose id is also its slot."""
    return RouterReq(rid, rid, input_len, new, high)
