"""KV-cache preemption on a real server: requests are paused, counted, resumed and still finish correctly.

The server admits more work than its KV cache holds (``--router_token_ratio`` 4 over a 160-token
cache), so concurrent long greedy generations run out of KV slots mid-decode; the backend pauses
some of them and resumes them later.  Each must still produce exactly the tokens it produces
alone, and the preemption counters must have gone up.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest

from server_process import start_server

PROMPTS = ["Pause one", "Second paused stream", "A third prompt here", "four"]
NEW_TOKENS = 80


@pytest.fixture(scope="module")
def tight_server(tiny_llama_dir, tmp_path_factory):
    handle = start_server(tiny_llama_dir, tmp_path_factory.mktemp("logs"), [
        "--max_total_token_num", "160", "--max_req_total_len", "128", "--router_token_ratio", "4",
        "--disable_dynamic_prompt_cache"])
    yield handle
    handle.stop()


def _body(prompt: str) -> dict:
    return {"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS, "do_sample": False, "ignore_eos": True,
                                             "return_details": True}}


async def _generate_all(url: str) -> list[dict]:
    async with httpx.AsyncClient(timeout=300) as client:
        answers = await asyncio.gather(*(client.post(f"{url}/generate", json=_body(p)) for p in PROMPTS))
    assert all(answer.status_code == 200 for answer in answers), [a.text for a in answers]
    return [answer.json() for answer in answers]


def _preemptions(handle) -> tuple[float, float]:
    return handle.metric("vllm:num_preemptions_total"), handle.metric("lightllm_preemptions_total")


def test_paused_requests_are_counted_and_finish_with_their_own_tokens(tight_server):
    before = _preemptions(tight_server)
    together = asyncio.run(_generate_all(tight_server.url))
    tight_server.wait_idle()
    after = _preemptions(tight_server)
    # 4 requests x (prompt + 80) tokens need about twice the 160 slots: some must have been paused.
    assert after[0] > before[0] and after[1] - before[1] == after[0] - before[0]
    assert tight_server.metric("lightllm_paused_requests") == 0
    for prompt, answer in zip(PROMPTS, together):
        assert answer["finish_reason"] == "length" and answer["count_output_tokens"] == NEW_TOKENS
        alone = httpx.post(f"{tight_server.url}/generate", json=_body(prompt), timeout=300).json()
        assert [t["id"] for t in answer["tokens"]] == [t["id"] for t in alone["tokens"]], prompt
        assert answer["generated_text"] == alone["generated_text"]
    # Nothing paused while each ran alone, and every KV slot came back.
    assert _preemptions(tight_server) == after
    tight_server.wait_idle()
    assert tight_server.metric("lightllm_kv_free_tokens") == tight_server.metric("lightllm_kv_total_tokens")


def test_paused_dynamic_ntk_requests_keep_the_rotation_their_tokens_had(tiny_llama_dir, tmp_path):
    """Dynamic NTK rotates a generated token by the length it made; a paused request prefilled again
    with its generated tokens must get those same keys back, so it still matches its run alone."""
    model_dir = tmp_path / "ntk"
    shutil.copytree(tiny_llama_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    scaling = {"rope_type": "dynamic", "factor": 2.0}
    rope = {**config.get("rope_parameters", {"rope_theta": config.get("rope_theta", 10000.0)}), **scaling}
    # Every generation runs far past the 16 positions the checkpoint was "trained" on.
    (model_dir / "config.json").write_text(json.dumps(
        {**config, "max_position_embeddings": 16, "rope_scaling": scaling, "rope_parameters": rope}))
    server = start_server(model_dir, tmp_path, [
        "--max_total_token_num", "160", "--max_req_total_len", "128", "--router_token_ratio", "4"])
    try:
        before = _preemptions(server)
        together = asyncio.run(_generate_all(server.url))
        server.wait_idle()
        assert _preemptions(server)[0] > before[0]
        alone = [httpx.post(f"{server.url}/generate", json=_body(p), timeout=300).json() for p in PROMPTS]
    finally:
        server.stop()
    for prompt, paused, single in zip(PROMPTS, together, alone):
        assert [t["id"] for t in paused["tokens"]] == [t["id"] for t in single["tokens"]], prompt
