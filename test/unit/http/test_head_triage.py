"""The front door's decisions from a request head's bytes alone (no socket, no thread)."""

from __future__ import annotations

from typing import List, Optional

from lightllm.server.http.transport.head_triage import (
    Answer,
    DoorState,
    HandOff,
    HeadTriage,
    Wait,
    admission_refusal,
    request_head_timeout,
)
from lightllm.server.http.service.health import starting_readiness
from lightllm.server.http.transport.probe_parsing import MAX_HEAD_BYTES, cors_request_headers
from lightllm.server.http.server_options import AuthPolicy, HttpLimits

LIMITS = HttpLimits(max_connections=20)
KEYED = AuthPolicy(api_keys=("client-key",), cluster_key="cluster-key")


def _ready():
    return None


def _state(phase: str = "serving", readiness=_ready) -> DoorState:
    return DoorState(phase, readiness, None)


def _verdict(data: bytes, reserve: bool = False, phase: str = "serving", auth: AuthPolicy = KEYED,
             reserve_free: bool = True, readiness=_ready, calls: Optional[List[str]] = None):
    def state() -> DoorState:
        if calls is not None:
            calls.append("state")
        return _state(phase, readiness)

    return HeadTriage(LIMITS, auth).verdict(data, reserve, state, lambda: reserve_free)


def test_a_complete_request_on_a_normal_place_goes_to_the_loop() -> None:
    assert isinstance(_verdict(b"POST /generate HTTP/1.1\r\nHost: x\r\n\r\n{"), HandOff)


def test_a_partial_head_that_can_no_longer_be_a_probe_goes_to_the_loop_at_once() -> None:
    # The loop's protocol reads the rest under the same head deadline.
    assert isinstance(_verdict(b"POST /gener"), HandOff)


def test_a_partial_head_that_may_still_be_a_probe_waits() -> None:
    calls: List[str] = []
    assert isinstance(_verdict(b"GET /heal", calls=calls), Wait)
    assert calls == []  # the server's state is not read for a head that decides nothing yet


def test_a_reserve_place_waits_for_the_whole_head_before_deciding() -> None:
    assert isinstance(_verdict(b"POST /generate HTTP/1.1\r\nAuthori", reserve=True), Wait)


def test_an_oversized_head_is_a_400_naming_the_limit() -> None:
    verdict = _verdict(b"GET /x HTTP/1.1\r\nX: " + b"a" * (MAX_HEAD_BYTES + 1))
    assert isinstance(verdict, Answer) and verdict.status == 400
    assert verdict.body["error"]["code"] == "invalid_http_request"
    assert f"{MAX_HEAD_BYTES // 1024} KiB" in verdict.body["error"]["message"]


def test_probes_are_answered_here_in_every_phase_and_head_gets_no_body() -> None:
    for phase in ("starting", "serving", "stopping"):
        verdict = _verdict(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", phase=phase)
        assert isinstance(verdict, Answer) and not verdict.head_only
    head = _verdict(b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert isinstance(head, Answer) and head.head_only and head.refusal is None
    starting = _verdict(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", readiness=starting_readiness)
    assert isinstance(starting, Answer) and starting.status == 503


def test_requests_before_and_after_serving_get_503_with_the_phase_named() -> None:
    starting = _verdict(b"POST /generate HTTP/1.1\r\n\r\n", phase="starting")
    assert isinstance(starting, Answer) and starting.status == 503
    assert starting.body["error"]["code"] == "server_starting"
    stopping = _verdict(b"POST /generate HTTP/1.1\r\n\r\n", phase="stopping")
    assert isinstance(stopping, Answer) and stopping.status == 503
    assert stopping.body["error"]["code"] != "server_starting"


def test_the_reserve_serves_only_keyed_requests_and_counts_each_refusal() -> None:
    head = b"POST /generate HTTP/1.1\r\n%s\r\n"
    refused = _verdict(head % b"", reserve=True)
    assert isinstance(refused, Answer) and refused.status == 503
    assert refused.refusal == "too_many_connections" == refused.body["error"]["code"]
    assert "API key" in refused.body["error"]["message"]
    wrong = _verdict(head % b"Authorization: Bearer nope\r\n", reserve=True)
    assert isinstance(wrong, Answer) and wrong.refusal == "too_many_connections"
    keyed = head % b"Authorization: Bearer client-key\r\n"
    assert isinstance(_verdict(keyed, reserve=True), HandOff)
    full = _verdict(keyed, reserve=True, reserve_free=False)
    assert isinstance(full, Answer) and full.refusal == "too_many_connections"
    assert f"serves {LIMITS.reserve_connections} more" in full.body["error"]["message"]
    # Outside the reserve neither the key nor the reserve's budget is the front door's business.
    assert isinstance(_verdict(head % b"", reserve=False, reserve_free=False), HandOff)


def test_only_the_cluster_key_opens_pd_paths_from_the_reserve() -> None:
    pd_head = b"POST /pd/register HTTP/1.1\r\nAuthorization: Bearer %s\r\n\r\n"
    assert isinstance(_verdict(pd_head % b"cluster-key", reserve=True), HandOff)
    assert isinstance(_verdict(pd_head % b"client-key", reserve=True), Answer)
    no_keys = AuthPolicy()
    assert isinstance(_verdict(b"POST /generate HTTP/1.1\r\n\r\n", reserve=True, auth=no_keys), Answer)


def test_the_timeout_and_admission_answers() -> None:
    timeout = request_head_timeout(2.5)
    assert timeout.status == 408 and "2.5 seconds (--http_header_timeout)" in timeout.body["error"]["message"]
    refused = admission_refusal(("too_many_client_connections", "one client holds too many"))
    assert refused.status == 503 and refused.body["error"]["code"] == "too_many_client_connections"
    assert refused.refusal is None  # the connection book counted it when it refused


def test_an_absolute_form_target_is_read_by_its_path_here_too() -> None:
    # The app routes GET http://host/health/live by its path; the front door, which answers probes
    # while the server starts or stops and judges the reserve's keys, read the whole URL.
    for phase in ("starting", "stopping"):
        verdict = _verdict(b"GET http://x:8000/health/live?probe=1 HTTP/1.1\r\nHost: x\r\n\r\n", phase=phase)
        assert isinstance(verdict, Answer) and verdict.status == 200, phase
    pd_head = b"POST HTTP://x/pd/register HTTP/1.1\r\nAuthorization: Bearer %s\r\n\r\n"
    assert isinstance(_verdict(pd_head % b"cluster-key", reserve=True), HandOff)
    assert isinstance(_verdict(pd_head % b"client-key", reserve=True), Answer)


def test_the_cors_lines_of_an_unparsed_head_are_read_whole_and_stripped() -> None:
    # The values are stripped after the match (a lazy value before optional blanks backtracked over
    # every blank run: 1.4 s of the front door's thread for a 16 KiB line of spaces); Cookie is read
    # because Starlette 0.x then echoes the origin instead of "*".
    head = (b"OPTIONS /health HTTP/1.1\r\nHost: x\r\norigin: \t https://a.example \t\r\n"
            b"Access-Control-Request-Method:GET\nCookie: a=b\r\n\r\n")
    assert cors_request_headers(head) == ("OPTIONS", [(b"origin", b"https://a.example"),
                                                      (b"access-control-request-method", b"GET"),
                                                      (b"cookie", b"a=b")])
    blanks = b"GET /health HTTP/1.1\r\nOrigin: a" + b" " * 16_000 + b"b  \r\n\r\n"
    assert cors_request_headers(blanks) == ("GET", [(b"origin", b"a" + b" " * 16_000 + b"b")])
    assert cors_request_headers(blanks[:-4]) == ("GET", [])  # the Origin line is not complete yet
