"""The PD KV transfer layer with real transfer processes joined over gloo.

Two KV caches in this process stand for a prefill rank and a decode rank; each gets its own
transfer process.  Bytes must arrive exactly, into exactly the reserved slots; a geometry
mismatch, an injected failure, a killed peer and a hung peer must each end the transfer with a
clear failure within the bound, and a restarted pair must work again.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest
import torch

from lightllm.common.kv_cache_mem_manager.mem_manager import KVCacheMemoryManager
from lightllm.server.launch.arg_parser import make_argument_parser
from lightllm.server.launch.plan import pd_rank_settings
from lightllm.server.pd.kv_transfer import KVTransferHandle, TransferHeader
from lightllm.utils.envs_utils import pd_transfer_failure_probability

from pd_kv_transfer_support import collect, restart_pair, start_pair

LAYERS, HEADS, HEAD_DIM, SIZE, PAGE = 3, 2, 8, 600, 16
TIMEOUT_S = 3.0


def _cache(head_dim: int = HEAD_DIM, dtype: torch.dtype = torch.float32) -> KVCacheMemoryManager:
    return KVCacheMemoryManager(SIZE, LAYERS, HEADS, head_dim, dtype, shareable=True)


def _filled(seed: int = 0) -> KVCacheMemoryManager:
    cache = _cache()
    gen = torch.Generator().manual_seed(seed)
    cache.k_buffer.copy_(torch.randn(cache.k_buffer.shape, generator=gen))
    cache.v_buffer.copy_(torch.randn(cache.v_buffer.shape, generator=gen))
    return cache


@pytest.fixture(scope="module")
def pair():
    source, target = _filled(), _cache()
    prefill, decode = start_pair(source, target, page_size=PAGE, timeout_s=TIMEOUT_S)
    yield source, target, prefill, decode
    prefill.close()
    decode.close()


def _transfer(prefill: KVTransferHandle, decode: KVTransferHandle, moves, receive_first: bool = True):
    """Run transfers ``{request_id: (src_slots, dst_slots)}``; returns (prefill, decode) results."""
    if receive_first:
        for request_id, (_, dst) in reversed(list(moves.items())):  # order need not match the sends
            decode.receive(request_id, dst)
    for request_id, (src, _) in moves.items():
        prefill.send(request_id, src, first_token=request_id + 7)
    if not receive_first:
        time.sleep(0.1)
        for request_id, (_, dst) in moves.items():
            decode.receive(request_id, dst)
    return collect(prefill, len(moves)), collect(decode, len(moves))


def test_export_and_import_round_trip_through_the_cache_object() -> None:
    source, target = _filled(1), _cache()
    slots = torch.tensor([5, 2, 77, 3])
    data = source.export_slots(slots)
    assert data.shape == (4, 2, LAYERS, HEADS, HEAD_DIM) and data.is_contiguous()
    assert torch.equal(data[2, 0, 1], source.k_buffer[1, 77]) and torch.equal(data[0, 1, 2], source.v_buffer[2, 5])
    target.import_slots(torch.tensor([9, 8, 7, 6]), data)
    assert torch.equal(target.export_slots(torch.tensor([9, 8, 7, 6])), data)
    assert target.k_buffer[:, :6].abs().sum() == 0 and target.k_buffer[:, 10:].abs().sum() == 0
    with pytest.raises(ValueError, match=r"does not fit this cache \(expected \(3, 2, 3, 2, 8\)"):
        target.import_slots(torch.tensor([1, 2, 3]), data)
    with pytest.raises(RuntimeError, match="not shared"):
        KVCacheMemoryManager(8, 1, 1, 4, torch.float32).transfer_view()
    assert KVCacheMemoryManager(8, 1, 1, 4, torch.float32).k_buffer.is_shared() is False  # off by default


def test_bfloat16_round_trip_and_checksum_sees_one_changed_value() -> None:
    from lightllm.server.pd.kv_transfer.checksum import payload_checksum

    cache = KVCacheMemoryManager(40, 2, 1, 6, torch.bfloat16)
    cache.k_buffer.copy_(torch.randn(cache.k_buffer.shape))
    cache.v_buffer.copy_(torch.randn(cache.v_buffer.shape))
    data = cache.export_slots(torch.arange(10, 27))
    other = KVCacheMemoryManager(40, 2, 1, 6, torch.bfloat16)
    other.import_slots(torch.arange(17), data)
    assert torch.equal(other.export_slots(torch.arange(17)), data)
    changed = data.clone()
    changed[16, 1, 1, 0, 5] += 1
    swapped = data[[1, 0] + list(range(2, 17))]
    assert len({payload_checksum(d, 4) for d in (data, changed, swapped)}) == 3


def test_a_handle_refuses_bad_arguments_before_starting_anything() -> None:
    cache = _cache()
    with pytest.raises(ValueError, match="role must be one of"):
        KVTransferHandle("normal", cache, "127.0.0.1", 1)
    with pytest.raises(ValueError, match="page size must be positive, got 0"):
        KVTransferHandle("prefill", cache, "127.0.0.1", 1, page_size=0)
    with pytest.raises(RuntimeError, match="not shared"):
        KVTransferHandle("decode", KVCacheMemoryManager(8, 1, 1, 4, torch.float32), "127.0.0.1", 1)


def test_header_round_trips_and_names_every_mismatch() -> None:
    header = TransferHeader(12, 100, LAYERS, HEADS, HEAD_DIM, torch.bfloat16, 64, 123456789, first_token=4321)
    assert TransferHeader.from_tensor(header.to_tensor()) == header
    assert TransferHeader.from_tensor(header.to_tensor()).first_token == 4321
    # What an announcement in the pair's store holds.
    assert TransferHeader.from_bytes(header.to_bytes()) == header and len(header.to_bytes()) == 88
    with pytest.raises(ValueError, match="received 87 bytes, not a KV transfer header"):
        TransferHeader.from_bytes(header.to_bytes()[:-1])
    old_version = header.to_tensor()
    old_version[1] = 1
    with pytest.raises(ValueError, match="version 1 is not the supported 2"):
        TransferHeader.from_tensor(old_version)
    assert header.payload_bytes == 100 * 2 * LAYERS * HEADS * HEAD_DIM * 2
    assert header.incompatibility(LAYERS, HEADS, HEAD_DIM, torch.bfloat16) is None
    assert header.incompatibility(LAYERS + 1, HEADS, 4, torch.float16) == (
        "prefill KV does not match this decode cache (prefill vs decode): "
        "num_layers 3 vs 4, head_dim 8 vs 4, dtype torch.bfloat16 vs torch.float16"
    )
    with pytest.raises(ValueError, match="not a KV transfer header"):
        TransferHeader.from_tensor(torch.zeros(11, dtype=torch.int64))


def test_failure_probability_env_is_validated(monkeypatch) -> None:
    monkeypatch.delenv("LIGHTLLM_PD_TRANSFER_FAILURE_PROBABILITY", raising=False)
    assert pd_transfer_failure_probability() == 0.0
    monkeypatch.setenv("LIGHTLLM_PD_TRANSFER_FAILURE_PROBABILITY", "0.25")
    assert pd_transfer_failure_probability() == 0.25
    monkeypatch.setenv("LIGHTLLM_PD_TRANSFER_FAILURE_PROBABILITY", "1.5")
    with pytest.raises(ValueError, match="must be a number in \\[0, 1\\], got '1.5'"):
        pd_transfer_failure_probability()


def test_requests_arrive_byte_exact_in_their_slots_only(pair) -> None:
    source, target, prefill, decode = pair
    target.k_buffer.zero_()
    target.v_buffer.zero_()
    gen = torch.Generator().manual_seed(3)
    src_perm, dst_perm = torch.randperm(SIZE, generator=gen), torch.randperm(SIZE, generator=gen)
    moves, used, offset = {}, [], 0
    for request_id, tokens in [(101, 1), (102, PAGE), (103, 2 * PAGE + 5), (104, 100)]:
        src, dst = src_perm[offset : offset + tokens], dst_perm[offset : offset + tokens]
        moves[request_id] = (src, dst)
        used.append(dst)
        offset += tokens
    sent, received = _transfer(prefill, decode, moves)
    token_bytes = source.token_bytes()
    for request_id, (src, dst) in moves.items():
        assert sent[request_id].ok and received[request_id].ok, (sent[request_id], received[request_id])
        assert sent[request_id].bytes == received[request_id].bytes == len(src) * token_bytes
        # The prefill side's first token rides in the header to the decode side's result.
        assert received[request_id].first_token == request_id + 7
        assert torch.equal(target.export_slots(dst), source.export_slots(src))
    untouched = torch.ones(SIZE, dtype=torch.bool)
    untouched[torch.cat(used)] = False
    assert target.k_buffer[:, untouched].abs().sum() == 0 and target.v_buffer[:, untouched].abs().sum() == 0
    # A header may overtake its receive registration by a little.
    src, dst = torch.tensor([1, 3, 5]), torch.tensor([590, 591, 599])
    sent, received = _transfer(prefill, decode, {105: (src, dst)}, receive_first=False)
    assert sent[105].ok and received[105].ok
    assert torch.equal(target.export_slots(dst), source.export_slots(src))


def test_a_header_without_reservation_is_refused_and_the_pair_keeps_working(pair, caplog) -> None:
    source, target, prefill, decode = pair
    caplog.set_level(logging.DEBUG, logger=KVTransferHandle.__module__)
    prefill.send(201, [1, 2, 3])
    result = collect(prefill, 1)[201]
    assert not result.ok
    assert "request 201 refused by the decode side: the decode side has no reservation" in result.reason
    decode.receive(202, [10, 11], wait_s=0.5)
    result = collect(decode, 1)[202]
    assert not result.ok and "no KV arrived from the prefill side within 0.5 s" in result.reason
    sent, received = _transfer(prefill, decode, {203: (torch.tensor([4, 5]), torch.tensor([20, 21]))})
    assert sent[203].ok and received[203].ok and prefill.broken_reason is None
    # Request 201 was never the decode side's (no receive ever waited for it): its refusal is a warning.
    stray = [(r.levelno, r.getMessage()) for r in caplog.records if "request 201" in r.getMessage()]
    assert stray == [(logging.WARNING, "KV transfer result for unknown request 201 dropped")]


def test_a_cancelled_receive_ends_at_once_and_a_late_header_for_it_is_refused(pair, caplog) -> None:
    source, target, prefill, decode = pair
    caplog.set_level(logging.DEBUG, logger=KVTransferHandle.__module__)
    untouched = target.k_buffer[:, 30:32].clone()
    decode.receive(211, [30, 31], wait_s=300)
    decode.cancel_receive(211)
    result = collect(decode, 1)[211]
    assert not result.ok and result.cancelled and "receive cancelled" in result.reason
    prefill.send(211, [1, 2])
    assert "has no reservation" in collect(prefill, 1)[211].reason
    decode.cancel_receive(999)  # nothing in flight: nothing happens
    sent, received = _transfer(prefill, decode, {212: (torch.tensor([4, 5]), torch.tensor([22, 23]))})
    assert sent[212].ok and received[212].ok and prefill.broken_reason is None
    assert torch.equal(target.k_buffer[:, 30:32], untouched)  # nothing was written for the cancelled receive
    # The decode side's refusal of the late header reached its owner, which had its result already:
    # a race of every client leaving as its prefill ends, not a warning ("result for unknown request").
    late = [r for r in caplog.records if "request 211" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in late] == [
        (logging.DEBUG, "request 211: KV refused after its receive ended")]


def test_a_head_dim_mismatch_fails_the_transfer_cleanly() -> None:
    source, target = _filled(), _cache(head_dim=4)
    prefill, decode = start_pair(source, target, page_size=PAGE, timeout_s=TIMEOUT_S)
    try:
        sent, received = _transfer(prefill, decode, {301: (torch.arange(20), torch.arange(20))})
        assert not sent[301].ok and "KV geometry (layers, KV heads, head dim, dtype) differs" in sent[301].reason
        assert not received[301].ok and "head_dim 8 vs 4" in received[301].reason
        assert target.k_buffer.abs().sum() == 0
        assert prefill.broken_reason is None and decode.broken_reason is None  # the group stays usable
    finally:
        prefill.close()
        decode.close()


def test_the_failure_probability_is_read_once_into_a_prefill_node_s_settings(monkeypatch) -> None:
    parse = make_argument_parser().parse_args
    node = ["--model_dir", "m", "--pd_master_ip", "127.0.0.1", "--run_mode"]
    monkeypatch.setenv("LIGHTLLM_PD_TRANSFER_FAILURE_PROBABILITY", "0.25")
    assert pd_rank_settings(parse([*node, "prefill"])).transfer_failure_probability == 0.25
    # A decode node neither reads nor checks it (it sends no KV).
    monkeypatch.setenv("LIGHTLLM_PD_TRANSFER_FAILURE_PROBABILITY", "1.5")
    assert pd_rank_settings(parse([*node, "decode"])).transfer_failure_probability == 0.0


def test_injected_failures_fail_every_transfer_of_the_handles_given_them(monkeypatch) -> None:
    # The variable reaches the handle as a prefill node's ranks get it: read once into PdRankSettings.
    monkeypatch.setenv("LIGHTLLM_PD_TRANSFER_FAILURE_PROBABILITY", "1.0")
    settings = pd_rank_settings(make_argument_parser().parse_args(
        ["--model_dir", "m", "--pd_master_ip", "127.0.0.1", "--run_mode", "prefill"]))
    source, target = _filled(), _cache()
    prefill, decode = start_pair(source, target, page_size=PAGE, timeout_s=TIMEOUT_S,
                                 failure_probability=settings.transfer_failure_probability)
    try:
        moves = {400 + i: (torch.arange(i, i + 40), torch.arange(200 + 40 * i, 240 + 40 * i)) for i in range(3)}
        sent, received = _transfer(prefill, decode, moves)
        for request_id in moves:
            assert not sent[request_id].ok and "payload checksum mismatch (injected failure" in sent[request_id].reason
            assert not received[request_id].ok and "checksum mismatch" in received[request_id].reason
        # A restarted transfer process keeps the value it was given: the variable is not read again.
        monkeypatch.setenv("LIGHTLLM_PD_TRANSFER_FAILURE_PROBABILITY", "0")
        restart_pair(prefill, decode)
        sent, received = _transfer(prefill, decode, {410: (torch.arange(50), torch.arange(300, 350))})
        assert not sent[410].ok and not received[410].ok
    finally:
        prefill.close()
        decode.close()
    with pytest.raises(ValueError, match=r"failure probability must be in \[0, 1\], got 1.5"):
        KVTransferHandle("prefill", _cache(), "127.0.0.1", 1, failure_probability=1.5)


def test_a_peer_killed_mid_transfer_fails_the_other_side_within_the_bound(pair) -> None:
    source, target, prefill, decode = pair
    decode.receive(501, torch.arange(64))
    time.sleep(0.2)
    os.kill(decode.pid, signal.SIGSTOP)  # hold the decode side inside the transfer, then kill it
    started = time.monotonic()
    prefill.send(501, torch.arange(64))
    time.sleep(0.5)
    os.kill(decode.pid, signal.SIGKILL)
    result = collect(prefill, 1, timeout_s=TIMEOUT_S + 30)[501]
    assert not result.ok and time.monotonic() - started < TIMEOUT_S + 30
    # ChannelBroken follows the failed results on the pipe; it may come a poll later.
    deadline = time.monotonic() + 10
    while prefill.broken_reason is None and time.monotonic() < deadline:
        prefill.poll()
        time.sleep(0.01)
    assert prefill.broken_reason is not None
    lost = collect(decode, 1)[501]
    assert not lost.ok and "exited" in lost.reason
    restart_pair(prefill, decode)
    sent, received = _transfer(prefill, decode, {502: (torch.arange(30), torch.arange(30))})
    assert sent[502].ok and received[502].ok


def test_a_hung_peer_times_out_instead_of_hanging(pair) -> None:
    source, target, prefill, decode = pair
    os.kill(decode.pid, signal.SIGSTOP)
    started = time.monotonic()
    prefill.send(601, torch.arange(10))
    result = collect(prefill, 1, timeout_s=TIMEOUT_S + 30)[601]
    elapsed = time.monotonic() - started
    assert not result.ok and "timed out after 3 s" in result.reason, result
    assert TIMEOUT_S * 0.9 <= elapsed < TIMEOUT_S + 30
    # The process reports the broken group after the results of the requests it held, so a poll
    # may see the failed result before it: the next polls see the reason.
    deadline = time.monotonic() + 30
    while prefill.broken_reason is None:
        assert time.monotonic() < deadline, "the broken group was not reported"
        prefill.poll()
        time.sleep(0.005)
    assert "timed out" in prefill.broken_reason
    restart_pair(prefill, decode)  # kills the stopped process
    sent, received = _transfer(prefill, decode, {602: (torch.arange(8), torch.arange(8))})
    assert sent[602].ok and received[602].ok


def test_a_lease_of_any_length_is_held_and_the_process_keeps_serving() -> None:
    """A receive's lease is its master's prefill timeout plus a margin: any finite number of
    seconds.  The transfer process waits for the nearest one on its pipe, whose poll refuses a
    timeout past about 24 days; it must keep serving (own pair: a crash must not spoil the others)."""
    source, target = _filled(1), _cache()
    prefill, decode = start_pair(source, target, page_size=PAGE, timeout_s=TIMEOUT_S)
    try:
        decode.receive(221, [40, 41], wait_s=1e9)
        decode.receive(222, [42, 43], wait_s=1e300)
        sent, received = _transfer(prefill, decode, {223: (torch.tensor([4, 5]), torch.tensor([44, 45]))})
        assert sent[223].ok and received[223].ok and decode.broken_reason is None
        assert torch.equal(target.export_slots(torch.tensor([44, 45])), source.export_slots(torch.tensor([4, 5])))
        for request_id in (221, 222):  # still held, not expired: a cancellation ends them
            decode.cancel_receive(request_id)
        assert all(result.cancelled for result in collect(decode, 2).values())
    finally:
        prefill.close()
        decode.close()
