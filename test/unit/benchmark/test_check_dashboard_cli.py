"""``python -m lightllm.utils.check_dashboard`` refuses a dashboard it cannot read in one line naming the file.

A missing dashboard used to end in a FileNotFoundError traceback (with a saved exposition) or be
reported as the metrics URL's fault (the URL was fetched first); a file that is not JSON ended in
a JSONDecodeError traceback.
"""

from __future__ import annotations

import json

import pytest
from cli_refusal_support import one_line_refusal

from lightllm.utils import check_dashboard

EXPOSITION = "# TYPE up gauge\nup 1\n"
DASHBOARD = {"panels": [{"targets": [{"expr": 'up{job="x"}'}]}]}


@pytest.fixture
def saved_metrics(tmp_path):
    path = tmp_path / "metrics.txt"
    path.write_text(EXPOSITION)
    return str(path)


@pytest.mark.parametrize("metrics", ["http://127.0.0.1:1/metrics", "<saved>"])
def test_a_missing_dashboard_is_named_in_one_line(metrics, saved_metrics, monkeypatch, capsys):
    # The dashboard is read before the URL is fetched: nothing may be asked of the network.
    import httpx

    def no_fetch(*args, **kwargs):
        raise AssertionError("the metrics were fetched before the dashboard was read")

    monkeypatch.setattr(httpx, "get", no_fetch)
    metrics = saved_metrics if metrics == "<saved>" else metrics
    line = one_line_refusal(check_dashboard.main, ["/nonexistent.json", metrics], capsys)
    assert "/nonexistent.json" in line and "dashboard" in line, line


def test_a_dashboard_that_is_not_json_is_named_in_one_line(tmp_path, saved_metrics, capsys):
    path = tmp_path / "board.json"
    path.write_text("{not json")
    line = one_line_refusal(check_dashboard.main, [str(path), saved_metrics], capsys)
    assert str(path) in line and "JSON" in line, line


def test_a_missing_metrics_file_is_named_in_one_line(tmp_path, capsys):
    path = tmp_path / "board.json"
    path.write_text(json.dumps(DASHBOARD))
    line = one_line_refusal(check_dashboard.main, [str(path), str(tmp_path / "none.txt")], capsys)
    assert "none.txt" in line, line


def test_a_readable_pair_is_still_checked(tmp_path, saved_metrics, capsys):
    path = tmp_path / "board.json"
    path.write_text(json.dumps(DASHBOARD))
    assert check_dashboard.main([str(path), saved_metrics]) == 0


def test_a_keyed_or_starting_server_is_named_with_its_answer_and_the_key_is_sent(tmp_path, monkeypatch, capsys):
    """The tool had no way to send a key and parsed a 401's (or a loading server's 503) JSON body as an
    exposition: "not a Prometheus text exposition: Invalid labels: "error":{...}"."""
    from canned_server import require_key, serve
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    dashboard = tmp_path / "dashboard.json"
    dashboard.write_text(json.dumps(DASHBOARD))
    seen: list = []
    app = FastAPI()
    require_key(app, "metrics-key", seen)
    loading = {"now": False}

    @app.get("/metrics")
    async def metrics():
        if loading["now"]:
            return JSONResponse({"error": {"message": "The server is starting (loading the model); retry later",
                                           "code": "server_starting"}}, status_code=503)
        return PlainTextResponse(EXPOSITION)

    with serve(app) as base:
        url = base + "/metrics"
        line = one_line_refusal(check_dashboard.main, [str(dashboard), url], capsys)
        assert f"{url} answered HTTP 401: Missing API key" in line, line
        assert check_dashboard.main([str(dashboard), url, "--api-key", "metrics-key"]) == 0
        assert seen[-1]["authorization"] == "Bearer metrics-key"
        monkeypatch.setenv("OPENAI_API_KEY", "metrics-key")  # the default, as the benchmark tools read it
        assert check_dashboard.main([str(dashboard), url]) == 0
        loading["now"] = True
        line = one_line_refusal(check_dashboard.main, [str(dashboard), url], capsys)
        assert "answered HTTP 503: The server is starting" in line, line
