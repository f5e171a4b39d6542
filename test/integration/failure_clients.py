"""Threaded HTTP clients and process probes for the failure, shutdown and disconnect tests."""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import httpx

LONG = 900  # tokens: several seconds of generation on the tiny model, far beyond each test's kill


@dataclass
class ClientResult:
    """What one client saw, with the monotonic time its request ended."""

    path: str
    stream: bool
    status: Optional[int] = None
    events: List[Dict[str, Any]] = field(default_factory=list)
    done_sentinel: bool = False
    body: Any = None
    transport_error: Optional[str] = None
    ended_at: Optional[float] = None
    first_event: threading.Event = field(default_factory=threading.Event)

    def error(self) -> Optional[Dict[str, Any]]:
        """The error object the client received (JSON body or last stream event), if any."""
        if isinstance(self.body, dict) and "error" in self.body:
            return self.body["error"]
        if self.events and "error" in self.events[-1]:
            return self.events[-1]["error"]
        return None

    def finish_reasons(self) -> List[str]:
        """Finish reasons of normally finished choices/streams this client received."""
        reasons = []
        for event in self.events:
            reasons += [c["finish_reason"] for c in event.get("choices", []) if c.get("finish_reason")]
            if event.get("finish_reason"):
                reasons.append(event["finish_reason"])
        if isinstance(self.body, dict):
            reasons += [c["finish_reason"] for c in self.body.get("choices", []) if c.get("finish_reason")]
            if self.body.get("finish_reason"):
                reasons.append(self.body["finish_reason"])
        return reasons


def payload(path: str, model: str, max_tokens: int = LONG, prompt: str = "hello world") -> Dict[str, Any]:
    """A long ignore_eos request for ``path``."""
    if path.startswith("/generate"):
        return {"inputs": prompt, "parameters": {"max_new_tokens": max_tokens, "ignore_eos": True}}
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}


def run_client(url: str, path: str, body: Dict[str, Any], stream: bool, timeout: float = 60.0) -> ClientResult:
    """Start one client in a thread; the returned result fills in as it runs (see ``ended_at``)."""
    result = ClientResult(path, stream)
    if stream and path.startswith("/v1/"):
        body = {**body, "stream": True}

    def run() -> None:
        try:
            if not stream:
                response = httpx.post(url + path, json=body, timeout=timeout)
                result.status = response.status_code
                result.body = response.json()
                return
            with httpx.stream("POST", url + path, json=body, timeout=timeout) as response:
                result.status = response.status_code
                if response.status_code != 200:
                    result.body = json.loads(response.read())
                    return
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        result.done_sentinel = True
                        continue
                    result.events.append(json.loads(data))
                    result.first_event.set()
        except Exception as exc:  # noqa: BLE001 - recorded for the test's assertion message
            result.transport_error = repr(exc)
        finally:
            result.ended_at = time.monotonic()
            result.first_event.set()

    threading.Thread(target=run, daemon=True).start()
    return result


def wait_all_ended(results: List[ClientResult], timeout: float) -> None:
    """Wait until every client's request ended (bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(r.ended_at is None for r in results):
        time.sleep(0.02)


def child_pids(log_text: str) -> Dict[str, int]:
    """Child name -> pid, from the launcher's "children ready" log line."""
    match = re.search(r"children ready: (.*)", log_text)
    assert match, log_text
    return {name: int(pid) for name, pid in re.findall(r"(\w+) pid=(\d+)", match.group(1))}


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (zombies count as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def leftovers(launcher_pid: int) -> List[str]:
    """Shared-memory segments and IPC folders that still carry ``launcher_pid``."""
    shm = [str(p) for p in Path("/dev/shm").glob(f"lightllm_{launcher_pid}_*")]
    ipc = [str(p) for p in Path(tempfile.gettempdir()).glob(f"lightllm-{launcher_pid}-*")]
    return shm + ipc


def metric_sum(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for match in re.finditer(rf"^{re.escape(name)}(?:{{([^}}]*)}})? (\S+)$", text, re.MULTILINE):
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(2))
    return total
