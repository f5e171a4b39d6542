"""A request manager whose generations are scripted texts, behind the real HTTP app: for tests of how
the HTTP layer reads and shapes a generated text (tool calls), whatever the model would write."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from fastapi.testclient import TestClient

from api_fakes import FakeEvent, FakeManager
from lightllm.server.http.app import create_app
from lightllm.server.http.server_options import HttpServerOptions


class ScriptedManager(FakeManager):
    """A FakeManager whose every generation yields the pieces of ``script`` and stops."""

    def __init__(self, script: list[str], finish: str = "stop") -> None:
        super().__init__()
        self.script = script
        self.finish = finish

    async def generate(self, spec: Any, *, request: Any = None) -> AsyncIterator[FakeEvent]:
        prompt_ids = list(spec.prompt_ids)
        self.calls.append(type("Call", (), {"params": spec.params, "prompt_ids": prompt_ids})())
        for position, piece in enumerate(self.script):
            await asyncio.sleep(0)
            finish = self.finish if position == len(self.script) - 1 else None
            yield FakeEvent(len(self.calls), 20 + position, piece, -0.5, finish, len(prompt_ids), 0, position + 1, None)


def make_client(script: list[str], parser: str | None = "hermes",
                finish: str = "stop") -> tuple[TestClient, ScriptedManager]:
    manager = ScriptedManager(script, finish)
    app = create_app(manager, HttpServerOptions(tool_call_parser=parser))
    return TestClient(app, raise_server_exceptions=False), manager
