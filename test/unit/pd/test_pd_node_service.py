"""A PD node's HTTP-side service over the manager's real inbox dispatch and request streams.

Rank 0's notices travel in its step output stream, so they reach the HTTP process ahead of the
tokens or finish they explain.  Here the real ``HttpServerManager`` dispatch (its inbox handler
hook and ``post``), its ``generate`` and the real ``PendingRequest`` queue carry them to a
:class:`PdNodeService`; only the shared memory, slots and router it submits to are doubles.  The
rank's side of the one path (the step publisher and the detokenizer keeping notices ahead of the
step's texts) is checked at the end.
"""

from __future__ import annotations

import asyncio
import logging
import types
from typing import Any, Dict, List, Optional

import pytest
import zmq

from lightllm.common.sampling import SamplingParams
from lightllm.server.core.objs.finish_status import FINISH_LENGTH
from lightllm.server.core.objs.io_messages import (
    DetokenizedOutput,
    NewRequest,
    PdChannelBroken,
    PdNotice,
    PdSetupDone,
    PdTransferSetup,
    StepOutput,
    StepTexts,
    TokenEvent,
)
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.core.objs.shm_req_layout import PD_KIND_DECODE, PD_KIND_PREFILL
from lightllm.server.httpserver.manager import HttpServerManager
from lightllm.server.httpserver.metrics import ServerMetrics
from lightllm.server.model_rank.step_publisher import StepPublisher
from lightllm.server.model_rank.scheduling.step_report import StepReport
from lightllm.server.pd.node.service import PdNodeService
from lightllm.server.pd.protocol.outcomes import NODE_OUTCOMES, SEGMENT_END_REASONS, node_outcome
from lightllm.server.pd.master.continuation import SegmentEnd

from detokenizer_test_support import detokenizer_rig
from manager_metrics_support import manager_over
from step_publisher_test_support import publisher_over

REQUEST_ID = 41


def _manager() -> HttpServerManager:
    """The manager's inbox dispatch, request streams and generate() over doubles of its records
    (rank 0 scheduled every request), slots and router (``manager.sockets.to_router.sent``)."""
    shm = types.SimpleNamespace(write_request=lambda *args: None, scheduled_ns=lambda slot, request_id: 1)
    return manager_over(ServerMetrics("default", None), shm)


def _submitted(manager: HttpServerManager) -> List[int]:
    """The ids of the requests the manager sent to the router."""
    return [message.request_id for message in manager.sockets.to_router.sent if isinstance(message, NewRequest)]


def _spec(kind: int) -> RequestSpec:
    return RequestSpec.build([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=8), pd_kind=kind,
                             kv_start=1 if kind == PD_KIND_PREFILL else 0)


def _token(token_id: int, finish: Optional[str] = None) -> DetokenizedOutput:
    return DetokenizedOutput(REQUEST_ID, [TokenEvent(token_id, f"t{token_id}", -0.5)], finish, 0)


def _finish(reason: str) -> DetokenizedOutput:
    return DetokenizedOutput(REQUEST_ID, [], reason, 0)


def _run(role: str, steps: List[List[Any]]) -> List[Any]:
    """Run one request on a ``role`` node; ``steps`` are the inbox messages of each step, in order."""
    manager = _manager()
    service = PdNodeService(manager, role, 1.0, "ipc:///unused")
    service.epochs[3] = None

    async def scenario() -> List[Any]:
        kind = PD_KIND_DECODE if role == "decode" else PD_KIND_PREFILL
        events: List[Any] = []

        async def read() -> None:
            async for event in service.generate(_spec(kind), request_id=REQUEST_ID, epoch=3):
                events.append(event)

        reader = asyncio.create_task(read())
        while REQUEST_ID not in _submitted(manager):
            await asyncio.sleep(0)
        for step in steps:
            for message in step:  # the manager's receive loop, one StepTexts at a time
                await manager._handle_message(message)
        await asyncio.wait_for(reader, 5.0)
        return events

    return asyncio.run(scenario())


def test_a_decode_request_reads_its_notices_in_stream_order() -> None:
    events = _run("decode", [
        [PdNotice(REQUEST_ID, "reserved", kv_start=2)],
        [PdNotice(REQUEST_ID, "transferred", seconds=0.25, nbytes=4096), _token(5)],
        [_token(6, "segment_limit")],
    ])
    assert [e.kind for e in events] == ["reserved", "token", "token", "segment_end"]
    reserved, first, second, end = events
    assert reserved.kv_start == 2
    # The first token carries the transfer its notice described; the next one does not.
    assert (first.token.token_id, first.transfer_seconds, first.transfer_bytes) == (5, 0.25, 4096)
    assert (second.token.token_id, second.token.finish_reason, second.transfer_bytes) == (6, None, 0)
    assert end.reason == "segment_limit"


def test_a_prefill_hand_off_carries_the_transfer_of_its_notice() -> None:
    events = _run("prefill", [
        [_token(9)],
        [PdNotice(REQUEST_ID, "transferred", seconds=0.5, nbytes=8192), _finish("handed_off")],
    ])
    assert [(e.kind, e.transfer_seconds, e.transfer_bytes) for e in events] == [
        ("token", 0.0, 0), ("handed_off", 0.5, 8192)]


def test_a_failed_transfer_and_a_busy_answer_say_why() -> None:
    failed = _run("decode", [
        [PdNotice(REQUEST_ID, "reserved", kv_start=0)],
        [PdNotice(REQUEST_ID, "transfer_failed", error_kind="lease_expired", message="no KV within 3 s"),
         _finish("transfer_failed")],
    ])
    assert [(e.kind, e.error_kind, e.message, e.transfer_broken) for e in failed[1:]] == [
        ("error", "lease_expired", "no KV within 3 s", False)]
    busy = _run("decode", [[PdNotice(REQUEST_ID, "busy", error_kind="kv_tokens", message="no KV to reserve"),
                            _finish("busy")]])
    assert [(e.kind, e.message) for e in busy] == [("busy", f"request {REQUEST_ID}: no KV to reserve")]


def test_a_client_finish_rides_on_its_token_and_an_abort_is_an_error() -> None:
    done = _run("decode", [[PdNotice(REQUEST_ID, "reserved")], [_token(5)], [_token(7, "length")]])
    assert [(e.kind, e.token.finish_reason if e.token else None) for e in done] == [
        ("reserved", None), ("token", None), ("token", "length")]
    aborted = _run("decode", [[PdNotice(REQUEST_ID, "reserved")], [_finish("abort")]])
    assert [(e.kind, e.error_kind) for e in aborted[1:]] == [("error", "internal")]


def test_a_notice_for_no_pending_request_is_dropped_and_unknown_messages_are_logged(caplog) -> None:
    manager = _manager()
    PdNodeService(manager, "decode", 1.0, "ipc:///unused")

    async def scenario() -> None:
        await manager._handle_message(PdNotice(99, "reserved"))
        with caplog.at_level(logging.WARNING, logger="lightllm.httpserver"):
            await manager._handle_message(object())

    asyncio.run(scenario())
    assert "no handler" in caplog.text


def test_transfer_setup_waits_for_rank0s_answer_and_a_broken_channel_fails_new_requests(tmp_path) -> None:
    manager = _manager()
    address = f"ipc://{tmp_path}/rank0.sock"
    ctx = zmq.Context()
    rank0 = ctx.socket(zmq.PULL)
    rank0.bind(address)
    service = PdNodeService(manager, "decode", 5.0, address)

    async def answer(error: str = "") -> PdTransferSetup:
        """Rank 0's answer to the setup it received (its epoch and attempt echoed)."""
        while not rank0.poll(0):
            await asyncio.sleep(0.01)
        command = rank0.recv_pyobj()
        await manager._handle_message(PdSetupDone(command.epoch, error, command.setup_id))
        return command

    async def scenario() -> Dict[str, Any]:
        service.start()
        try:
            setup = asyncio.create_task(service.transfer_setup(4, "10.0.0.2:7000"))
            command = await answer()
            await setup
            result: Dict[str, Any] = {"command": command, "epochs": dict(service.epochs)}
            refused = asyncio.create_task(service.transfer_setup(5, "10.0.0.2:7000"))
            await answer("rank 1 could not connect")
            with pytest.raises(RuntimeError, match="rank 1 could not connect"):
                await refused
            result["epochs_after_refusal"] = dict(service.epochs)
            return result
        finally:
            service.stop()

    try:
        result = asyncio.run(scenario())
    finally:
        ctx.destroy(linger=0)
    assert (result["command"].epoch, result["command"].peer_host, result["command"].peer_port) == (4, "10.0.0.2", 7000)
    # A refused setup of another epoch leaves the set-up one as it was.
    assert result["epochs"] == {4: None} and result["epochs_after_refusal"] == {4: None}

    service.epochs[6] = None
    asyncio.run(manager._handle_message(PdChannelBroken(6, "peer gone")))

    async def first_event() -> Any:
        async for event in service.generate(_spec(PD_KIND_DECODE), request_id=1, epoch=6):
            return event

    event = asyncio.run(first_event())
    assert (event.kind, event.error_kind, event.transfer_broken) == ("error", "transfer_broken", True)
    assert _submitted(manager) == []  # refused before reaching the manager


def test_one_table_names_every_pd_outcome_for_both_ends() -> None:
    assert [node_outcome(o.finish_reason) for o in NODE_OUTCOMES] == list(NODE_OUTCOMES)
    assert node_outcome("stop") is None and node_outcome("length") is None and node_outcome(None) is None
    # The master reads every segment_end reason the node can write.
    reasons = [o.reason for o in NODE_OUTCOMES if o.event == "segment_end"]
    assert sorted(reasons) == sorted(SEGMENT_END_REASONS)
    assert {SegmentEnd(reason).value for reason in reasons} == set(reasons)


# --- the rank's side of the one path ------------------------------------------------------------
def _publisher() -> StepPublisher:
    """A publisher over a stand-in buffer: this file checks the messages, not the records."""
    shm = types.SimpleNamespace(
        publish_token=lambda slot, request_id, token, logprob, top=None: 1,
        publish_tokens=lambda slots, request_ids, tokens, logprobs: [1] * len(slots),
        set_finish_status=lambda slot, request_id, status: True,
        published_output_len=lambda slot, request_id: 1,
    )
    return publisher_over(shm)


def test_notices_leave_ahead_of_the_steps_outputs_or_on_their_own() -> None:
    publisher = _publisher()
    sent = publisher.to_detokenization
    publisher.flush_notices()
    assert sent.messages == []  # nothing queued: nothing sent
    req = types.SimpleNamespace(request_id=REQUEST_ID, shm_index=0)
    reserved, transferred = PdNotice(REQUEST_ID, "reserved"), PdNotice(REQUEST_ID, "transferred")
    publisher.notify(reserved)
    publisher.notify(transferred)
    publisher.publish(StepReport(tokens=[(req, 5, -0.5)]))
    assert sent.messages == [StepOutput([(REQUEST_ID, 0, 1)], [], [reserved, transferred])]
    publisher.publish(StepReport(finished=[(req, FINISH_LENGTH)]))
    assert sent.messages[-1].notices == []  # each notice leaves once
    done = PdSetupDone(3)
    publisher.notify(done)
    publisher.flush_notices()
    assert sent.messages[-1] == StepOutput(notices=[done])


def test_the_detokenizer_forwards_notices_ahead_of_the_steps_texts(tiny_llama_dir, tmp_path) -> None:
    with detokenizer_rig(tiny_llama_dir, tmp_path, 1) as rig:
        rig.shm.write_request(0, REQUEST_ID, RequestSpec([5, 6], SamplingParams(temperature=0, max_new_tokens=2)))
        assert rig.shm.publish_token(0, REQUEST_ID, 7, -0.5) == 1
        notice = PdNotice(REQUEST_ID, "transferred", seconds=0.1, nbytes=64)
        rig.manager.handle(StepOutput([(REQUEST_ID, 0, 1)], [], [notice]))
        step = rig.http.recv_pyobj()
        assert isinstance(step, StepTexts)
        assert step.messages[0] == notice
        assert isinstance(step.messages[1], DetokenizedOutput) and step.messages[1].tokens[0].token_id == 7
        # A step output with notices only is forwarded too.
        rig.manager.handle(StepOutput(notices=[PdSetupDone(2)]))
        assert rig.http.recv_pyobj() == StepTexts([PdSetupDone(2)])
