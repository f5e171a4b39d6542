"""The scheduling-cost benchmark runs end to end at a tiny size (its timings are never asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightllm.benchmark.simulator import schedule_cost
from lightllm.server.router.model_infer.mode_backend.prefill_queue_strategy import available_strategy_names
from lightllm.server.router.model_infer.mode_backend.request_classifier import NORMAL_CLASSIFIER


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
    rows = schedule_cost.main(["--sizes", "6", "--repeats", "2", "--warmup", "1", "--json", str(out)])
    names = available_strategy_names()
    assert [row.strategy for row in rows] == names
    assert all(row.waiting == 6 and row.running == 0 for row in rows)
    table = capsys.readouterr().out
    assert all(f"| {name} | 6 |" in table for name in names)
    saved = json.loads(out.read_text())
    assert [entry["strategy"] for entry in saved] == names
    assert all(entry["total_ms"] >= 0 for entry in saved)


def test_bad_repeats_are_rejected() -> None:
    with pytest.raises(ValueError):
        schedule_cost.measure("default", 4, repeats=0)
