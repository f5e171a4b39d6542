"""The scheduling-cost benchmark runs end to end at a tiny size (its timings are never asserted)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List

import pytest

from lightllm.benchmark.simulator import schedule_cost, schedule_cost_server
from lightllm.server.model_rank.kv_cache.infer_context import InferenceContext
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import available_strategy_names
from lightllm.server.model_rank.scheduling.request_classifier import NORMAL_CLASSIFIER
from lightllm.server.model_rank.scheduling.step_engine import StepEngine
from lightllm.server.model_rank.scheduling.request_state import ReqState
from lightllm.server.router.req_queue.normal_queue import NormalReqQueue


def test_queue_has_the_requested_decode_and_prefill_requests() -> None:
    reqs, counter = schedule_cost.build_queue(waiting=12, running=3, seed=1)
    decode, prefill = NORMAL_CLASSIFIER.split(reqs)
    assert [r.request_id for r in decode] == [0, 1, 2]
    assert len(prefill) == 12
    assert all(schedule_cost.MIN_PROMPT <= r.input_len <= schedule_cost.MAX_PROMPT for r in prefill)
    assert all(r.arrival_processed_prefill_tokens <= counter.value for r in reqs)
    # Deterministic: the same seed builds the same queue.
    again, _ = schedule_cost.build_queue(waiting=12, running=3, seed=1)
    assert [(r.input_len, r.cur_kv_len) for r in again] == [(r.input_len, r.cur_kv_len) for r in reqs]


def test_command_line_prints_a_row_per_strategy_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cost.json"
    rows = schedule_cost.main(
        ["--layout", "engine", "--sizes", "6", "--repeats", "2", "--warmup", "1", "--json", str(out)]
    )
    names = available_strategy_names()
    assert [row.strategy for row in rows] == names
    assert all(row.waiting == 6 and row.running == 0 for row in rows)
    table = capsys.readouterr().out
    assert all(f"| {name} | 6 |" in table for name in names)
    saved = json.loads(out.read_text())
    assert [entry["strategy"] for entry in saved] == names
    assert all(entry["layout"] == "engine" for entry in saved)
    assert all(entry["total_ms"] >= 0 for entry in saved)


def test_bad_repeats_are_rejected() -> None:
    with pytest.raises(ValueError):
        schedule_cost.measure("default", 4, repeats=0)


# --- the server layout: waiting requests in the router, a full batch in the engine ---------------


def test_server_layout_keeps_n_waiting_in_the_router_and_m_running_in_the_engine() -> None:
    layout = schedule_cost_server.ServerLayout("hrrn", running=6, waiting=10, seed=3)
    # The simulator's own objects: the router's queue and a real step engine.
    assert isinstance(layout.router, NormalReqQueue) and isinstance(layout.backend, StepEngine)
    assert layout.router.running_max_req_size == 6
    for index in range(40):
        admit_s, schedule_s, step_s = layout.step()
        assert admit_s >= 0 and schedule_s >= 0 and step_s >= 0
        # Every admission round starts from exactly N waiting requests and fills the batch.
        assert layout.waiting_at_admit == 10
        assert layout.running_after_admit == 6
        assert layout.engine_requests == 6
    decoding, prefilling = layout.counts()
    assert decoding + prefilling == 6 and decoding > 0
    states = {req.state for req in layout.backend.requests.values()}
    assert ReqState.DECODING in states
    # Prompts are not multiples of the chunk size (the last chunk is a partial one).
    prompts = [arrival.prompt_len for arrival in layout.sim._arrivals.values()]
    assert any(prompt % schedule_cost_server.BUDGET for prompt in prompts)
    low, high = schedule_cost_server.PROMPT_RANGE
    assert all(low <= prompt <= high for prompt in prompts)


def test_server_layout_mixes_decoding_and_prefilling_requests_at_a_larger_batch() -> None:
    # Thirty steps into a batch of 60 fresh prompts (about one prompt per 1,024-token step), part
    # of the batch decodes while the rest waits for or runs its prefill.
    layout = schedule_cost_server.ServerLayout("default", running=60, waiting=5, seed=1)
    for _ in range(30):
        layout.step()
    decoding, prefilling = layout.counts()
    assert decoding > 0 and prefilling > 0 and decoding + prefilling == 60


def test_server_rows_cover_every_strategy_and_size_and_are_saved_with_their_layout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cost.json"
    rows = schedule_cost.main(
        ["--sizes", "12", "4", "--running", "5", "--server-warmup", "15", "--server-repeats", "2"]
        + ["--repeats", "1", "--warmup", "0", "--json", str(out)]
    )
    names = available_strategy_names()
    server = [row for row in rows if isinstance(row, schedule_cost_server.ServerCostRow)]
    engine = [row for row in rows if isinstance(row, schedule_cost.CostRow)]
    # Server rows per strategy in ascending router size, then the engine-only rows.
    assert [(row.strategy, row.waiting) for row in server] == [(name, size) for name in names for size in (4, 12)]
    assert rows == server + engine and len(engine) == 2 * len(names)
    for row in server:
        assert row.running == 5 and row.decoding + row.prefilling == 5 and row.repeats == 2
        assert 0 <= row.admit_ms <= row.admit_max_ms
        assert 0 <= row.schedule_ms <= row.schedule_max_ms
        assert 0 <= row.step_ms <= row.step_max_ms
    table = capsys.readouterr().out
    assert "Server layout" in table and "Engine-only layout" in table
    assert all(f"| {name} | radix | 12 | 5 |" in table for name in names)  # the rank's KV view by default
    assert all(row.kv_view == "radix" for row in server)
    saved = json.loads(out.read_text())
    assert [entry["layout"] for entry in saved] == ["server"] * len(server) + ["engine"] * len(engine)


def test_server_layout_takes_in_a_raised_router_before_the_timed_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    # Raising the router from 4 to 40 waiting delivers 36 requests at once.  The first admission
    # round with a free slot then settles every newcomer's overtaking-bound base: a one-off
    # intake, which ``take_in`` runs untimed, so timed rounds settle only the latest arrivals.
    layout = schedule_cost_server.ServerLayout("default", running=5, waiting=4, seed=1, kv_view="count")
    for _ in range(12):
        layout.step()
    layout.waiting = 40
    first_id = layout._next_id
    layout.take_in()
    assert layout.waiting_at_admit == 40 and layout.admitted_at_admit > 0
    assert layout._next_id - first_id >= 36
    assert not layout.router._unsettled  # every newcomer is settled
    for _ in range(10):
        before = layout._next_id
        layout.step()
        # A timed step only replaces what the previous round admitted, at most a batch.
        assert layout._next_id - before <= 5 and layout.waiting_at_admit == 40

    # measure_server takes the intake in at every size before timing.
    taken: List[int] = []
    take_in = schedule_cost_server.ServerLayout.take_in

    def counting_take_in(self: schedule_cost_server.ServerLayout) -> float:
        taken.append(self.waiting)
        return take_in(self)

    monkeypatch.setattr(schedule_cost_server.ServerLayout, "take_in", counting_take_in)
    rows = schedule_cost_server.measure_server("default", 5, [40, 4], warmup_steps=12, repeats=3, kv_view="count")
    assert taken == [4, 40] and [row.waiting for row in rows] == [4, 40]
    assert all(row.intake_admit_ms >= 0 for row in rows)


def test_intake_of_an_empty_router_returns_at_once() -> None:
    layout = schedule_cost_server.ServerLayout("default", running=3, waiting=0, kv_view="count")
    assert layout.take_in() == 0.0 and not len(layout.router)


def test_server_layout_over_the_ranks_own_kv_view_shares_prefixes_and_gives_every_slot_back() -> None:
    layout = schedule_cost_server.ServerLayout("hrrn", running=12, waiting=6, seed=2, kv_view="radix")
    context = layout.backend.kv
    assert isinstance(context, InferenceContext) and context.radix_cache is not None
    cache_hits = 0
    for _ in range(60):
        layout.step()
        cache_hits += sum(
            req.prompt_cache_len >= schedule_cost_server.SYSTEM_PROMPT_LEN for req in layout.backend.requests.values()
        )
    decoding, prefilling = layout.counts()
    assert decoding + prefilling == 12 and decoding > 0
    # Real prompts: distinct ones, and a quarter behind one shared system prompt, which the
    # requests that arrive after it is cached take from the prefix cache.
    arrivals = list(layout.sim._arrivals.values())
    system = tuple(layout._token_pool[: schedule_cost_server.SYSTEM_PROMPT_LEN])
    shared = [a for a in arrivals if a.prompt_ids[: len(system)] == system]
    assert 0 < len(shared) < len(arrivals)
    assert len({a.prompt_ids for a in arrivals}) == len(arrivals)
    assert cache_hits > 0
    # Drain: with nothing more arriving every request ends and every slot is free again or cached.
    layout.waiting = 0
    while layout.sim.has_work():
        layout.sim.step()
    assert context.allocatable_token_num() == context.kv_cache.size


def test_server_layout_count_and_radix_rows_are_kept_apart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = schedule_cost.main(
        ["--layout", "server", "--sizes", "3", "--running", "4", "--server-warmup", "10"]
        + ["--server-repeats", "2", "--strategies", "default", "--kv-view", "count", "radix"]
    )
    assert [(row.strategy, row.kv_view) for row in rows] == [("default", "count"), ("default", "radix")]
    table = capsys.readouterr().out
    assert "| default | count | 3 | 4 |" in table and "| default | radix | 3 | 4 |" in table


def test_bad_server_layout_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="running"):
        schedule_cost_server.ServerLayout("default", running=0)
    with pytest.raises(ValueError, match="repeats"):
        schedule_cost_server.measure_server("default", 4, [2], repeats=0)
    with pytest.raises(ValueError, match="waiting"):
        schedule_cost_server.measure_server("default", 4, [-1])
    with pytest.raises(SystemExit):
        schedule_cost.main(["--layout", "server", "--running", "0"])
    with pytest.raises(ValueError, match="kv_view"):
        schedule_cost_server.ServerLayout("default", running=2, kv_view="slots")
    with pytest.raises(SystemExit):
        schedule_cost.main(["--layout", "server", "--kv-view", "slots"])


@pytest.mark.parametrize("argv, message", [
    (["--layout", "engine", "--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--layout", "engine", "--warmup", "-1"], "--warmup must be >= 0, got -1"),
    (["--layout", "server", "--server-repeats", "0"], "--server-repeats must be >= 1, got 0"),
    (["--layout", "server", "--server-warmup", "-2"], "--server-warmup must be >= 0, got -2"),
])
def test_a_bad_count_is_refused_naming_its_own_flag(argv: List[str], message: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        schedule_cost.main(argv)
    assert message in capsys.readouterr().err
