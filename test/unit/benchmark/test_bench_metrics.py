"""Metric formulas of the serving benchmark, checked on hand-made timing records."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lightllm.benchmark.metrics import (
    RequestRecord,
    benchmark_duration,
    describe,
    format_summary,
    meets_slo,
    parse_slo,
    percentile,
    read_records_jsonl,
    summarize,
    write_records_jsonl,
)


def _records() -> list[RequestRecord]:
    """Four requests: two short successes, one single-token long, one failed long."""
    return [
        RequestRecord(  # ttft 100 ms, e2e 300 ms, tpot 200/3 ms, itl 50/100/50 ms
            index=0, request_class="short", prompt_tokens=10, scheduled_time=0.95,
            send_time=1.0, first_token_time=1.1, token_times=[1.1, 1.15, 1.25, 1.3],
            end_time=1.3, output_tokens=4, requested_output_tokens=4,
        ),
        RequestRecord(  # one output token: TPOT undefined
            index=1, request_class="long", prompt_tokens=100, scheduled_time=0.0,
            send_time=0.0, first_token_time=0.5, token_times=[0.5],
            end_time=0.5, output_tokens=1, requested_output_tokens=1,
        ),
        RequestRecord(  # ttft 200 ms, e2e 400 ms, tpot 200 ms, itl 200 ms
            index=2, request_class="short", prompt_tokens=10, scheduled_time=0.5,
            send_time=0.5, first_token_time=0.7, token_times=[0.7, 0.9],
            end_time=0.9, output_tokens=2, requested_output_tokens=2,
        ),
        RequestRecord(  # failed: counted, excluded from latency statistics
            index=3, request_class="long", prompt_tokens=100, scheduled_time=0.1,
            send_time=0.2, end_time=2.0, error="HTTP 500: boom", requested_output_tokens=8,
        ),
    ]


def test_per_request_formulas() -> None:
    a, b, c, failed = _records()
    assert a.ttft == pytest.approx(0.1)
    assert a.e2e == pytest.approx(0.3)
    assert a.tpot == pytest.approx(0.2 / 3)
    assert a.inter_token_latencies == pytest.approx([0.05, 0.1, 0.05])
    assert a.send_lag == pytest.approx(0.05)
    assert b.tpot is None and b.inter_token_latencies == []
    assert c.tpot == pytest.approx(0.2)
    assert not failed.success
    assert failed.ttft is None and failed.e2e is None and failed.tpot is None
    assert failed.send_lag == pytest.approx(0.1)


def test_record_without_first_token_is_not_a_success() -> None:
    record = RequestRecord(
        index=0, request_class="short", prompt_tokens=5, scheduled_time=0.0, send_time=0.0, end_time=1.0
    )
    assert not record.success


def test_summary_overall_and_per_class() -> None:
    summary = summarize(_records())
    assert summary["duration_s"] == pytest.approx(2.0)  # last end 2.0 - first send 0.0
    overall = summary["overall"]
    assert (overall["requests"], overall["completed"], overall["failed"]) == (4, 3, 1)
    assert overall["input_tokens"] == 120
    assert overall["output_tokens"] == 7
    assert overall["request_throughput"] == pytest.approx(1.5)
    assert overall["output_throughput"] == pytest.approx(3.5)
    assert overall["total_token_throughput"] == pytest.approx(63.5)
    assert overall["goodput"] is None and overall["slo_met"] is None

    ttft = overall["ttft_ms"]
    assert ttft["count"] == 3
    assert ttft["mean"] == pytest.approx(800 / 3)
    assert ttft["p50"] == pytest.approx(200.0)
    assert ttft["p90"] == pytest.approx(440.0)  # sorted [100, 200, 500], rank 1.8
    assert ttft["p99"] == pytest.approx(494.0)
    tpot = overall["tpot_ms"]
    assert tpot["count"] == 2  # the single-token output is excluded
    assert tpot["mean"] == pytest.approx((200 / 3 + 200) / 2)
    itl = overall["itl_ms"]
    assert itl["count"] == 4
    assert itl["mean"] == pytest.approx(100.0)
    assert itl["p50"] == pytest.approx(75.0)
    assert overall["e2e_ms"]["mean"] == pytest.approx((300 + 500 + 400) / 3)
    assert overall["send_lag_ms"]["count"] == 4
    assert overall["send_lag_ms"]["mean"] == pytest.approx((50 + 0 + 0 + 100) / 4)

    short, long = summary["classes"]["short"], summary["classes"]["long"]
    assert (short["completed"], short["failed"], long["completed"], long["failed"]) == (2, 0, 1, 1)
    assert short["ttft_ms"]["mean"] == pytest.approx(150.0)
    assert long["ttft_ms"]["mean"] == pytest.approx(500.0)
    assert long["tpot_ms"]["count"] == 0 and long["tpot_ms"]["mean"] is None
    # Classes share the overall duration, so their throughputs add up.
    assert short["output_throughput"] + long["output_throughput"] == pytest.approx(overall["output_throughput"])
    assert summary["errors"] == {"HTTP 500: boom": 1}
    json.dumps(summary)  # must be JSON-serialisable


def test_goodput_requires_every_slo() -> None:
    records = _records()
    summary = summarize(records, parse_slo(["ttft:300", "tpot:100"]))
    # a: ttft 100 <= 300, tpot 66.7 <= 100 -> good; b: ttft 500 -> bad; c: tpot 200 -> bad.
    assert summary["overall"]["slo_met"] == 1
    assert summary["overall"]["goodput"] == pytest.approx(0.5)
    assert summary["slo_ms"] == {"ttft": 300.0, "tpot": 100.0}
    loose = summarize(records, {"ttft": 600.0})
    assert loose["overall"]["goodput"] == pytest.approx(1.5)
    assert loose["classes"]["long"]["slo_met"] == 1


def test_tpot_slo_is_vacuous_for_single_token_outputs() -> None:
    _, single, _, failed = _records()
    assert meets_slo(single, {"tpot": 1.0})
    assert not meets_slo(single, {"ttft": 499.0})
    assert meets_slo(single, {"e2e": 500.0})
    assert not meets_slo(failed, {"ttft": 1e9})


def test_percentile_matches_numpy_linear() -> None:
    rng = np.random.default_rng(7)
    for size in (1, 2, 5, 17, 100):
        values = rng.exponential(10.0, size).tolist()
        for q in (0, 1, 50, 90, 95, 99, 100, 33.3):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([10.0], 99) == 10.0


def test_percentile_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="values"):
        percentile([], 50)
    with pytest.raises(ValueError, match="q"):
        percentile([1.0], 101)


def test_describe_empty_and_scaled() -> None:
    assert describe([]) == {"count": 0, "mean": None, "p50": None, "p90": None, "p95": None, "p99": None}
    stats = describe([0.001, 0.003], scale=1e3)
    assert stats["mean"] == pytest.approx(2.0) and stats["p50"] == pytest.approx(2.0)


def test_parse_slo() -> None:
    assert parse_slo(["TTFT:250", "e2e:1000.5"]) == {"ttft": 250.0, "e2e": 1000.5}
    assert parse_slo([]) == {}
    for bad in ("ttft", "latency:5", "tpot:abc", "ttft:-1", "ttft:0"):
        with pytest.raises(ValueError, match="slo"):
            parse_slo([bad])


def test_an_slo_key_named_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="^slo names 'ttft' twice; name each once$"):
        parse_slo(["ttft:5000", "tpot:50", "TTFT:1"])


def test_outputs_of_another_length_than_requested_are_counted_and_warned_about() -> None:
    records = _records()
    summary = summarize(records)
    assert summary["overall"]["output_len_mismatch"] == 0 and "warning" not in format_summary(summary)
    records[0].output_tokens = 2  # a stop sequence ended it; the failed request is not counted
    records[3].output_tokens = 1
    unknown = RequestRecord(index=4, request_class="long", prompt_tokens=1, scheduled_time=0.0, send_time=0.0,
                            first_token_time=0.1, token_times=[0.1], end_time=0.1, output_tokens=1)
    summary = summarize([*records, unknown])  # a record that names no requested length is not counted
    assert summary["overall"]["output_len_mismatch"] == 1
    classes = summary["classes"]
    assert (classes["short"]["output_len_mismatch"], classes["long"]["output_len_mismatch"]) == (1, 0)
    assert format_summary(summary).splitlines()[-1].startswith(
        "warning: 1 of 4 completed requests generated a different number of output tokens than requested")


def test_duration_and_empty_summary() -> None:
    assert benchmark_duration([]) is None
    unsent = RequestRecord(index=0, request_class="short", prompt_tokens=1, scheduled_time=0.0)
    summary = summarize([unsent])
    assert summary["duration_s"] is None
    assert summary["overall"]["request_throughput"] is None
    assert summary["overall"]["failed"] == 1
    assert "duration_s: -" in format_summary(summary)


def test_jsonl_round_trip(tmp_path) -> None:
    path = tmp_path / "records.jsonl"
    records = _records()
    write_records_jsonl(path, records)
    assert len(path.read_text().splitlines()) == 4
    assert read_records_jsonl(path) == records
    with pytest.raises(ValueError, match="unknown fields"):
        RequestRecord.from_dict({**records[0].to_dict(), "bogus": 1})


def test_format_summary_lists_every_class() -> None:
    text = format_summary(summarize(_records(), {"ttft": 300.0}))
    header = text.splitlines()[1]
    assert header.split() == ["metric", "overall", "long", "short"]
    assert "ttft_ms p95" in text and "goodput (req/s)" in text
    assert "error x1: HTTP 500: boom" in text
    assert "slo_ms: ttft<=300" in text
