"""LIGHTLLM_STEP_TRACE on a real server: rank 0 writes a row for every step that ran a forward."""

from __future__ import annotations

import csv

import httpx

from server_process import start_server


def test_a_served_request_leaves_its_prefill_and_decode_steps_in_the_trace(tiny_llama_dir, tmp_path, monkeypatch):
    trace = tmp_path / "steps.csv"
    monkeypatch.setenv("LIGHTLLM_STEP_TRACE", str(trace))
    server = start_server(tiny_llama_dir, tmp_path, ["--max_total_token_num", "4096"])
    try:
        body = {"model": server.model_name, "prompt": list(range(10, 50)), "max_tokens": 5, "temperature": 0,
                "ignore_eos": True}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        server.stop()
    with open(trace, encoding="utf-8") as file:
        rows = list(csv.DictReader(file))
    # The 40-token prompt in one prefill step (which samples the first token), then four decode steps.
    prefill = [row for row in rows if int(row["prefill_tokens"]) > 0]
    decode = [row for row in rows if int(row["prefill_tokens"]) == 0]
    assert [int(row["prefill_tokens"]) for row in prefill] == [40]
    assert [int(row["decode_rows"]) for row in decode] == [1, 1, 1, 1]
    assert all(float(row["forward_ms"]) > 0 and int(row["minor_faults"]) >= 0 for row in rows)
