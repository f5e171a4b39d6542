"""The real ``python -m lightllm.server.api_server --run_mode pd_master`` process.

Registration, /health and the 503 before nodes, a refused incompatible node, one request served
through node stand-ins (pd_node_stand_in.py), and a SIGTERM drain with exit code 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from pd_node_stand_in import Handoff, NodeStandIn, reference_tokens
from lightllm.utils.free_ports import free_port


def test_master_process_registration_health_and_a_request(tiny_llama_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "master.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lightllm.server.api_server", "--run_mode", "pd_master", "--model_dir",
             str(tiny_llama_dir), "--port", str(port), "--pd_heartbeat_interval", "0.5"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    nodes = []
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            try:
                health = httpx.get(f"{url}/health", timeout=2)
                # The port answers from the start; "server_starting" until the master serves.
                if health.status_code != 503 or health.json()["error"]["code"] != "server_starting":
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        assert health.status_code == 503 and health.json()["error"]["code"] == "pd_not_ready"
        response = httpx.post(f"{url}/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}})
        assert response.status_code == 503 and response.json()["error"]["code"] == "pd_not_ready"

        handoff = Handoff()
        name = tiny_llama_dir.name
        nodes = [NodeStandIn("prefill", url, handoff, name), NodeStandIn("decode", url, handoff, name)]
        for node in nodes:
            node.register()
        # Probes are answered off the event loop from a view of the registry refreshed every 0.1 s.
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/health").status_code != 200:
            assert time.monotonic() < deadline, "the master never became ready"
            time.sleep(0.05)
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}

        bad = NodeStandIn("decode", url, handoff, name, node_id="d-tp2", tp_size=2)
        nodes.append(bad)
        refused = httpx.post(f"{url}/pd/register", json=bad.info().to_dict())
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "incompatible_node"
        assert "tp_size: 2 != 1" in refused.json()["error"]["message"]

        prompt_ids = [5, 6, 7, 8]
        response = httpx.post(f"{url}/v1/completions", timeout=30,
                              json={"model": name, "prompt": prompt_ids, "max_tokens": 5})
        assert response.status_code == 200, response.text
        # The master decodes the text itself from the token ids (the stand-ins' own text is ignored).
        tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
        expected = tokenizer.decode(reference_tokens(prompt_ids, 5), skip_special_tokens=True)
        assert response.json()["choices"][0]["text"] == expected
        assert response.json()["usage"]["completion_tokens"] == 5

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        text = log_path.read_text()
        assert "incompatible with the cluster" in text and "tp_size: 2 != 1" in text  # the refusal is logged
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        for node in nodes:
            node.stop()
