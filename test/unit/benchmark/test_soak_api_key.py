"""The soak against a server started with ``--api_key``: it had no way to send a key, and the model
lookup ended in a KeyError traceback on the 401's body."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List

import pytest
from canned_server import require_key, serve
from fastapi import FastAPI, Request

from lightllm.benchmark import soak_server

KEY = "soak-key"


def _keyed_app(seen: List[Dict[str, Any]]) -> FastAPI:
    """Answers like a keyed server: 401 without the key; an idle /metrics; completions of the asked length."""
    app = FastAPI()
    require_key(app, KEY, seen)

    @app.get("/v1/models")
    async def models() -> Dict[str, Any]:
        return {"object": "list", "data": [{"id": "m", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Dict[str, Any]:
        body = await request.json()
        return {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}}

    @app.get("/metrics")
    async def metrics() -> str:
        return "lightllm_running_requests 0\nlightllm_waiting_requests 0\n"

    return app


def _argv(base_url: str, tmp_path, *extra: str) -> List[str]:
    return ["--base-url", base_url, "--server-pid", str(os.getpid()), "--rounds", "2", "--streams", "0",
            "--aborts", "0", "--requests", "2", "--vocab", "100", "--settle-s", "0",
            "--output-json", str(tmp_path / "soak.json"), *extra]


@pytest.fixture(autouse=True)
def no_key_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)


def test_without_the_key_the_soak_names_the_servers_refusal(tmp_path, capsys) -> None:
    with serve(_keyed_app([])) as base_url:
        assert soak_server.main(_argv(base_url, tmp_path)) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == [f"error: the server at {base_url} refused /v1/models: HTTP 401: Missing API key"], err


def test_with_the_key_every_call_carries_it_and_the_report_does_not(tmp_path) -> None:
    seen: List[Dict[str, Any]] = []
    with serve(_keyed_app(seen)) as base_url:
        assert soak_server.main(_argv(base_url, tmp_path, "--api-key", KEY)) == 0
    assert {entry["path"] for entry in seen} == {"/v1/models", "/v1/completions", "/metrics"}
    assert all(entry["authorization"] == f"Bearer {KEY}" for entry in seen)
    report = json.loads((tmp_path / "soak.json").read_text())
    assert report["args"]["api_key"] == "<given>" and KEY not in (tmp_path / "soak.json").read_text()
