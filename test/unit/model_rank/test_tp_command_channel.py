"""The TP command channel: rank 0's commands reach the other ranks in order, an idle rank 0 sends
only keep-alives (so the other ranks block instead of looping), and shutdown ends a follower.

The two-rank tests run real torch.distributed gloo processes on loopback.
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import zmq

from lightllm.server.core.objs.io_messages import AbortRequests, AddRequests
from lightllm.server.model_rank import command_channel
from lightllm.server.model_rank.command_channel import FRAME_BYTES, MessageKind, TpCommandChannel
from lightllm.server.model_rank.rank_process import GrammarsReady
from lightllm.utils.free_ports import free_port

KEEPALIVE = 0.2  # seconds; short so an idle period of a second shows a few of them
IDLE_SECONDS = 1.0  # how long rank 0 loops with nothing to do in the rank-level test
TEST_TIMEOUT = timedelta(seconds=60)  # a hung peer fails the test instead of hanging it


def _init(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=TEST_TIMEOUT)


# --- channel level ----------------------------------------------------------------------------
BIG = "x" * (3 * FRAME_BYTES)  # a payload that does not fit the first frame
STEPS: List[List[Any]] = [
    [AddRequests([(7, 0), (8, 1)])],
    [],
    [AbortRequests([7]), AddRequests([(9, 2)])],
    [AbortRequests([8]), BIG],
    [AbortRequests([9]), GrammarsReady([10, 11], failed=[12])],
]


def _order_worker(rank: int, port: int, out_path: str) -> None:
    _init(rank, port)
    channel = TpCommandChannel.open(rank, 2, timeout=TEST_TIMEOUT, keepalive_seconds=KEEPALIVE)
    if rank == 0:
        for commands in STEPS:
            channel.send_step(commands)
        channel.send_shutdown()
    else:
        received = []
        while True:
            message = channel.receive()
            received.append((int(message.kind), message.commands))
            if message.kind is MessageKind.SHUTDOWN:
                break
        with open(out_path, "wb") as out:
            pickle.dump(received, out)
    dist.destroy_process_group()


def test_commands_arrive_in_order_and_shutdown_ends_the_follower(tmp_path):
    out_path = str(tmp_path / "received.pkl")
    mp.spawn(_order_worker, args=(free_port(), out_path), nprocs=2, join=True)  # returns: both ranks ended
    with open(out_path, "rb") as source:
        received = pickle.load(source)
    assert received == [(int(MessageKind.STEP), commands) for commands in STEPS] + [(int(MessageKind.SHUTDOWN), [])]


# --- rank level: ModelRank.receive_commands over a real channel ---------------------------------
def _rank(rank: int) -> Any:
    from lightllm.server.model_rank.rank_process import ModelRank

    # The command loop only; no model, no shared memory.
    backend = SimpleNamespace(has_work=False, has_outside_work=False, grammars_compiled=lambda: ([], []))
    return ModelRank(backend, None, is_leader=rank == 0,
                     channel=TpCommandChannel.open(rank, 2, timeout=TEST_TIMEOUT, keepalive_seconds=KEEPALIVE))


def _idle_worker(rank: int, port: int, out_path: str) -> None:
    import time

    _init(rank, port)
    model_rank = _rank(rank)
    result: Dict[str, Any] = {}
    if rank == 0:
        ctx = zmq.Context()
        model_rank.inbox = ctx.socket(zmq.PULL)
        model_rank.inbox.bind("inproc://rank0")
        router = ctx.socket(zmq.PUSH)
        router.connect("inproc://rank0")
        # Idle: nothing in the inbox and nothing running, for IDLE_SECONDS.
        deadline = time.monotonic() + IDLE_SECONDS
        idle_iterations = 0
        while time.monotonic() < deadline:
            assert model_rank.receive_commands() == []
            idle_iterations += 1
        result["idle_counts"] = dict(model_rank.channel.counts)
        result["idle_iterations"] = idle_iterations
        # Busy: commands arrive, then three steps run with nothing new.
        router.send_pyobj(AbortRequests([1]))
        router.send_pyobj(AbortRequests([2]))
        returned = []  # what rank 0 applied in the iterations it sent a step for
        while sum(len(commands) for commands in returned) < 2:
            commands = model_rank.receive_commands()
            if commands:  # an empty pass while idle sends no step
                returned.append(commands)
        model_rank.backend.has_work = True
        for _ in range(3):
            returned.append(model_rank.receive_commands())
        model_rank.backend.has_work = False
        model_rank.stop()
        result["after_stop"] = model_rank.receive_commands()
        result["returned"] = returned
        ctx.destroy(linger=0)
    else:
        iterations = []  # (kind, commands) per return of receive_commands
        while True:
            before = dict(model_rank.channel.counts)
            commands = model_rank.receive_commands()
            kind = next(k for k, n in model_rank.channel.counts.items() if n != before[k])
            iterations.append((int(kind), commands))
            if commands is None:
                break
        result["iterations"] = iterations
    result["counts"] = {int(k): n for k, n in model_rank.channel.counts.items()}
    with open(f"{out_path}.{rank}", "wb") as out:
        pickle.dump(result, out)
    dist.destroy_process_group()


def _load(path: str) -> Dict[str, Any]:
    with open(path, "rb") as source:
        return pickle.load(source)


def test_idle_rank0_sends_only_keepalives_and_followers_apply_the_same_commands(tmp_path):
    out_path = str(tmp_path / "ranks")
    mp.spawn(_idle_worker, args=(free_port(), out_path), nprocs=2, join=True)
    leader, follower = (_load(f"{out_path}.{r}") for r in (0, 1))
    keepalive, step, shutdown = int(MessageKind.KEEPALIVE), int(MessageKind.STEP), int(MessageKind.SHUTDOWN)

    # Idle: rank 0 looped but sent keep-alives only, and not one per loop (the old broadcast did).
    idle = leader["idle_counts"]
    assert idle[MessageKind.STEP] == 0 and idle[MessageKind.SHUTDOWN] == 0
    assert 1 <= idle[MessageKind.KEEPALIVE] <= IDLE_SECONDS / KEEPALIVE + 2
    # The follower woke once per message: its iterations before the first step are those keep-alives.
    kinds = [kind for kind, _ in follower["iterations"]]
    first_step = kinds.index(step)
    assert set(kinds[:first_step]) == {keepalive}
    assert idle[MessageKind.KEEPALIVE] <= first_step <= IDLE_SECONDS / KEEPALIVE + 3

    # Busy: every rank got the same lists in the same order, one message per iteration.
    steps = [commands for kind, commands in follower["iterations"] if kind == step]
    assert steps == leader["returned"]
    assert [c for commands in steps for c in commands] == [AbortRequests([1]), AbortRequests([2])]
    assert steps[-3:] == [[], [], []]

    # Shutdown: rank 0's stop reaches the follower, whose loop ends.
    assert leader["after_stop"] is None
    assert follower["iterations"][-1] == (shutdown, None)
    assert follower["counts"] == leader["counts"]


# --- single process -------------------------------------------------------------------------
def test_tp1_has_no_channel_and_creates_no_group():
    assert not dist.is_initialized()
    assert TpCommandChannel.open(0, 1) is None  # would raise without a default group if it made one
    assert not dist.is_initialized()


def test_keepalive_period_must_be_well_below_the_timeout():
    with pytest.raises(ValueError, match="keep-alive"):
        TpCommandChannel.open(0, 2, timeout=timedelta(seconds=10), keepalive_seconds=5.0)


def test_keepalive_is_sent_only_after_a_silent_period(monkeypatch):
    sent: List[bytes] = []
    monkeypatch.setattr(command_channel.dist, "broadcast",
                        lambda tensor, src, group: sent.append(bytes(tensor.numpy()[:16])))
    now = [100.0]
    channel = TpCommandChannel(0, group=None, keepalive_seconds=5.0, clock=lambda: now[0])
    assert channel.seconds_until_keepalive() == 5.0
    now[0] = 103.0
    assert not channel.keep_alive() and not sent
    channel.send_step([])  # any message restarts the silent period
    now[0] = 107.0
    assert channel.seconds_until_keepalive() == 1.0 and not channel.keep_alive()
    now[0] = 108.0
    assert channel.keep_alive()
    assert channel.counts == {MessageKind.STEP: 1, MessageKind.KEEPALIVE: 1, MessageKind.SHUTDOWN: 0}
    assert len(sent) == 2


def test_only_rank0_sends_and_only_the_others_receive():
    with pytest.raises(RuntimeError):
        TpCommandChannel(1, group=None).send_step([])
    with pytest.raises(RuntimeError):
        TpCommandChannel(0, group=None).receive()
