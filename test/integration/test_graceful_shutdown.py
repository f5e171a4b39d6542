"""SIGTERM drains for at most --graceful_shutdown_seconds, and resources of a server killed with
SIGKILL are removed when the next server starts (issue 14)."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from failure_clients import alive, child_pids, leftovers, payload, run_client, wait_all_ended
from server_process import start_server

GRACE_SECONDS = 8.0  # generous: a short request must finish within it on a loaded 2-core CI machine
SHORT = 16  # tokens: done long before the deadline
LONG = 3500  # tokens: far beyond the deadline on the small model


def test_killed_launcher_leftovers_are_removed_and_sigterm_drains(tiny_llama_dir, small_llama_dir, tmp_path):
    # A launcher killed with SIGKILL cannot clean up; its children follow it within a second or two.
    killed = start_server(tiny_llama_dir, tmp_path, ["--max_total_token_num", "4096"])
    killed_children = child_pids(killed.log())
    killed.stop(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in killed_children.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert any("lightllm-" in path for path in leftovers(killed.proc.pid)), "expected the IPC folder to be left"
    # The resource tracker may already have removed the segments; plant one to be sure.
    stale_segment = Path(f"/dev/shm/lightllm_{killed.proc.pid}_0badc0de_req")
    stale_segment.write_bytes(b"x")
    # Resources of a live process (this test) must survive.
    live_segment = Path(f"/dev/shm/lightllm_{os.getpid()}_0badc0de_req")
    live_segment.write_bytes(b"x")
    live_dir = Path(tempfile.mkdtemp(prefix=f"lightllm-{os.getpid()}-"))
    try:
        server = start_server(small_llama_dir, tmp_path, ["--max_total_token_num", "32768",
                                                          "--graceful_shutdown_seconds", str(GRACE_SECONDS)])
        assert not leftovers(killed.proc.pid)
        assert live_segment.exists() and live_dir.exists()
    finally:
        live_segment.unlink(missing_ok=True)
        live_dir.rmdir()
        stale_segment.unlink(missing_ok=True)

    try:
        children = child_pids(server.log())
        model = server.model_name
        # Each request is in flight before the next one starts, so that every wait below is about
        # its own request: a stream shows it with its first event; a non-streaming request shows
        # no event until it ends, so the test waits until the server counted its prompt (with
        # another request still connecting, that count could be the other one's).
        short_plain = [_started(server.url, lambda: run_client(
            server.url, "/v1/completions", payload("/v1/completions", model, SHORT), stream=False))]
        long_stream = _streaming(run_client(
            server.url, "/v1/completions", payload("/v1/completions", model, LONG), stream=True))
        long_plain = _started(server.url, lambda: run_client(
            server.url, "/generate", payload("/generate", model, LONG), stream=False))
        long_ones = [long_stream, long_plain]
        short_streams = [_streaming(run_client(
            server.url, "/generate_stream", payload("/generate_stream", model, SHORT), stream=True))]
        signalled_at = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        refused = httpx.post(f"{server.url}/generate", json=payload("/generate", model, 4), timeout=10)
        health = httpx.get(f"{server.url}/health", timeout=10)
        wait_all_ended(long_ones + short_plain + short_streams, GRACE_SECONDS + 5)
        code = server.proc.wait(GRACE_SECONDS + 10)
        exited_after = time.monotonic() - signalled_at
    finally:
        server.stop(signal.SIGKILL)

    assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down", refused.text
    assert health.status_code == 503
    for result in short_plain + short_streams:
        assert result.status == 200 and result.error() is None, (result.body, result.events[-1:])
        assert result.finish_reasons() == ["length"]
    for result in long_ones:
        ended_after = result.ended_at - signalled_at
        assert GRACE_SECONDS - 0.5 <= ended_after <= GRACE_SECONDS + 2, (result.path, ended_after, result.status, result.body, result.events[-1:])
        error = result.error()
        assert error is not None and error["code"] == "server_shutting_down", (result.body, result.events[-1:])
        assert "graceful shutdown period" in error["message"]
    assert long_ones[0].status == 200 and long_ones[0].done_sentinel  # error event, then the stream ends
    assert long_ones[1].status == 503
    assert code == 0
    assert exited_after <= GRACE_SECONDS + 5
    assert not leftovers(server.proc.pid)
    assert not [name for name, pid in children.items() if alive(pid)]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_to_the_whole_process_group_still_drains(tiny_llama_dir, tmp_path, signum):
    """Ctrl-C in a terminal and systemd's default stop signal every process of the server's group,
    and a closed terminal hangs it up (SIGHUP, which uvicorn does not handle).

    The children must let the signal pass: the main process drains the request in flight and
    then stops them, instead of a child dying under it and failing every request.
    """
    server = start_server(tiny_llama_dir, tmp_path, ["--max_total_token_num", "4096",
                                                     "--graceful_shutdown_seconds", "30"], own_process_group=True)
    try:
        children = child_pids(server.log())
        stream = _streaming(run_client(
            server.url, "/v1/completions", payload("/v1/completions", server.model_name, 1000), stream=True))
        signalled_at = time.monotonic()
        os.killpg(server.proc.pid, signum)
        wait_all_ended([stream], 60)
        code = server.proc.wait(60)
    finally:
        server.stop(signal.SIGKILL)
    log = server.log()
    assert stream.ended_at > signalled_at  # it was in flight when the group got the signal
    assert stream.status == 200 and stream.error() is None, (stream.body, stream.events[-1:])
    assert stream.finish_reasons() == ["length"]
    assert code == 0, log
    assert "exited unexpectedly" not in log
    assert "every request finished" in log
    assert f"received {signal.Signals(signum).name}: taking no new requests" in log
    assert "resource_tracker" not in log  # multiprocessing's tracker got the signal too and died
    assert not leftovers(server.proc.pid)
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in children.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [name for name, pid in children.items() if alive(pid)]


def _streaming(result):
    """Wait until the stream ``result`` received its first event (its request is in flight)."""
    assert result.first_event.wait(30) and result.status == 200, (result.body, result.transport_error)
    return result


def _started(url: str, start):
    """Run ``start()`` (which sends one request) and wait until the server has taken that request."""
    before = _prompt_tokens_total(url)
    result = start()
    deadline = time.monotonic() + 30
    while _prompt_tokens_total(url) == before:
        assert time.monotonic() < deadline, "the request never reached the server"
        time.sleep(0.02)
    return result


def _prompt_tokens_total(url: str) -> float:
    """The server's ``lightllm_prompt_tokens_total`` (prompt tokens of every request it took)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("lightllm_prompt_tokens_total"))


def test_a_request_still_being_tokenized_at_sigterm_gets_its_answer(tiny_llama_dir, tmp_path):
    """A multi-MB prompt takes seconds to tokenize; the manager knows nothing of it yet. The drain
    waits for it, and the client gets the server's own answer (here the JSON 400 of a prompt beyond
    the context), not a cancelled handler's plain-text 500."""
    server = start_server(tiny_llama_dir, tmp_path, ["--max_total_token_num", "4096", "--prompt_chars_per_token", "0",
                                                     "--graceful_shutdown_seconds", "60"])
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    prompt = " ".join(words[i % len(words)] + str(i % 97) for i in range(600_000))
    answers = []
    try:
        sender = threading.Thread(target=lambda: answers.append(httpx.post(
            f"{server.url}/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 1}}, timeout=300)))
        sender.start()
        # Signalled once the body has arrived (the server logs nothing per request, so this waits
        # on the client side); whether tokenization is still running then or not, the answer must
        # be the endpoint's own.
        time.sleep(1.0)
        server.proc.send_signal(signal.SIGTERM)
        sender.join(300)
        code = server.proc.wait(120)
    finally:
        server.stop(signal.SIGKILL)
    (answer,) = answers
    assert answer.status_code == 400, answer.text
    assert answer.headers["content-type"] == "application/json"
    assert answer.json()["error"]["code"] == "context_length_exceeded"
    assert code == 0 and "every request finished" in server.log()


def test_a_body_still_arriving_at_the_deadline_gets_the_drain_503(tiny_llama_dir, tmp_path):
    """A client that stalls in the middle of its body holds the drain to the deadline; then it gets
    the drain's JSON 503 (not the HTTP server's plain-text 500 of a cancelled handler)."""
    server = start_server(tiny_llama_dir, tmp_path, ["--max_total_token_num", "4096", "--graceful_shutdown_seconds", "2"])
    host, port = server.url.rsplit("/", 1)[-1].split(":")
    body = b'{"prompt": "hello", "max_tokens": 4}'
    answer = []

    def stalled_client() -> None:
        with socket.create_connection((host, int(port)), timeout=60) as connection:
            connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                               b"Content-Length: %d\r\n\r\n" % len(body) + body[:10])
            received = b""
            while chunk := connection.recv(65536):
                received += chunk
            answer.append(received)

    try:
        client = threading.Thread(target=stalled_client)
        client.start()
        # Time for the head and part of the body to arrive; had they not, the answer would be the
        # same code (a request arriving during the drain is refused with it at once).
        time.sleep(1.0)
        server.proc.send_signal(signal.SIGTERM)
        client.join(60)
        code = server.proc.wait(60)
    finally:
        server.stop(signal.SIGKILL)
    (received,) = answer
    head, _, payload = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), received[:300]
    error = json.loads(payload)["error"]
    assert error["code"] == "server_shutting_down"
    assert code == 0 and "Traceback" not in server.log()
