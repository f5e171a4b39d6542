"""Real servers on the newer architectures: Qwen3 over two tensor-parallel ranks, a multi-query Qwen2
whose one KV head both ranks replicate, and a Mistral with a sliding window, greedy over HTTP against transformers; and the launcher's one-line refusals of
checkpoints it cannot serve, before any process starts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightllm.server.launch.exit_codes import EXIT_INVALID_CONFIG
from lightllm.utils.demo_model import generate_demo_model
from lightllm.utils.free_ports import free_port
from server_process import start_server, stream_token_ids

WINDOW = 64


def _rewrite_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _reference(model_dir: Path, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation, token by token (its generate would stop at the checkpoint's EOS ids)."""
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    out = []
    for prompt in prompts:
        sequence = tokenizer(prompt)["input_ids"]
        start = len(sequence)
        with torch.no_grad():
            for _ in range(max_tokens):
                sequence.append(int(hf(torch.tensor([sequence])).logits[0, -1].argmax()))
        out.append(sequence[start:])
    return out


def _prompts(model_dir: Path, lengths: tuple[int, ...]) -> list[str]:
    """Text prompts of at least these token counts (at most two more)."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    words = [tokenizer.decode([t]).strip() or "x" for t in range(40, 240)]
    prompts = []
    for n in lengths:
        text, i = "", 0
        while len(tokenizer(text)["input_ids"]) < n:
            text += " " + words[(i * 53 + n) % len(words)]
            i += 1
        prompts.append(text)
    return prompts


def test_qwen3_over_two_tensor_parallel_ranks_serves_transformers_greedy(tiny_qwen3_dir, tmp_path):
    prompts = _prompts(tiny_qwen3_dir, (7, 45, 130))
    server = start_server(tiny_qwen3_dir, tmp_path, ["--tp", "2", "--max_total_token_num", "4096"])
    try:
        served = [stream_token_ids(server.url, p, 12) for p in prompts]
    finally:
        server.stop()
    assert served == _reference(tiny_qwen3_dir, prompts, 12)


def _one_kv_head(source: Path, out: Path) -> Path:
    """A copy of ``source`` made multi-query: the k/v projections keep their first head only."""
    shutil.copytree(source, out)
    config = json.loads((out / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    for path in out.glob("*.safetensors"):
        tensors = load_file(str(path))
        for name in [n for n in tensors if n.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias"))]:
            tensors[name] = tensors[name][:head_dim].clone()
        save_file(tensors, str(path), metadata={"format": "pt"})
    _rewrite_config(out, num_key_value_heads=1)
    return out


def test_a_multi_query_model_over_two_ranks_replicates_its_kv_head_and_serves_transformers_greedy(
        tiny_qwen2_dir, tmp_path):
    model_dir = _one_kv_head(tiny_qwen2_dir, tmp_path / "qwen2_mqa")
    prompts = _prompts(model_dir, (7, 45, 130))
    server = start_server(model_dir, tmp_path, ["--tp", "2", "--max_total_token_num", "4096"])
    try:
        served = [stream_token_ids(server.url, p, 12) for p in prompts]
    finally:
        server.stop()
    assert served == _reference(model_dir, prompts, 12)


def test_a_sliding_window_checkpoint_is_served_within_its_window(tmp_path):
    model_dir = generate_demo_model(tmp_path / "mistral_window", arch="mistral", size="tiny", seed=3)
    _rewrite_config(model_dir, sliding_window=WINDOW)
    prompts = _prompts(model_dir, (9, WINDOW - 16))
    assert all(len(ids) + 12 <= WINDOW for ids in AutoTokenizer.from_pretrained(str(model_dir))(prompts)["input_ids"])
    server = start_server(model_dir, tmp_path, ["--max_total_token_num", "4096"])
    try:
        models = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]
        assert models[0]["max_model_len"] == WINDOW  # the window, not max_position_embeddings (1024)
        served = [stream_token_ids(server.url, p, 12) for p in prompts]
        too_long = httpx.post(f"{server.url}/v1/completions", timeout=30, json={
            "model": server.model_name, "prompt": "word " * WINDOW, "max_tokens": 8})
        assert too_long.status_code == 400 and str(WINDOW) in too_long.json()["error"]["message"]
    finally:
        server.stop()
    assert "sliding window of 64 tokens" in server.log()
    assert served == _reference(model_dir, prompts, 12)


def _launch(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lightllm.server.api_server", "--port", str(free_port()), *args],
                          capture_output=True, text=True, timeout=300)


def _errors(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]


def test_the_launcher_refuses_what_it_cannot_serve_in_one_line(tiny_mistral_dir, tmp_path):
    other = tmp_path / "gpt2"
    other.mkdir()
    # A tokenizer, as every checkpoint has: a directory without one is refused before the flags are read.
    shutil.copy(tiny_mistral_dir / "tokenizer.json", other / "tokenizer.json")
    (other / "config.json").write_text(json.dumps({**json.loads((tiny_mistral_dir / "config.json").read_text()),
                                                   "model_type": "gpt2"}))
    proc = _launch(["--model_dir", str(other)])
    assert proc.returncode == EXIT_INVALID_CONFIG
    assert _errors(proc) == ["error: model_type 'gpt2' is not supported; supported: llama, mistral, qwen2, qwen3"]
    (other / "config.json").write_text(json.dumps({**json.loads((tiny_mistral_dir / "config.json").read_text()),
                                                   "sliding_window": WINDOW}))
    proc = _launch(["--model_dir", str(other), "--max_req_total_len", "100"])
    assert proc.returncode == EXIT_INVALID_CONFIG
    assert _errors(proc) == [
        "error: --max_req_total_len 100 exceeds the checkpoint's sliding window (64 tokens); this server attends "
        "to the whole sequence, which matches the model only within the window: give at most 64"]
    assert "starting: model=" not in proc.stdout + proc.stderr


def _greedy_ids(url: str, model: str, prompt: list[int], max_tokens: int) -> list[int]:
    choice = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "logprobs": 0, "return_tokens_as_token_ids": True}).json()["choices"][0]
    return [int(token.split(":")[1]) for token in choice["logprobs"]["tokens"]]


def test_dynamic_ntk_prompts_that_share_prefixes_match_transformers(tiny_llama_dir, tmp_path):
    """A dynamic-NTK key is rotated for its request's length, so no request may read another's
    cached keys: a prompt extending, sharing or cutting a served one is computed afresh."""
    model_dir = tmp_path / "ntk"
    shutil.copytree(tiny_llama_dir, model_dir)
    scaling = {"rope_type": "dynamic", "factor": 2.0}
    config = json.loads((model_dir / "config.json").read_text())
    rope = {**config.get("rope_parameters", {"rope_theta": config.get("rope_theta", 10000.0)}), **scaling}
    _rewrite_config(model_dir, max_position_embeddings=64, rope_scaling=scaling, rope_parameters=rope)
    first = [1] + [(i * 37) % 900 + 3 for i in range(99)]
    prompts = [first, first + [(i * 11) % 900 + 3 for i in range(50)], first[:30] + [5] * 90, first[:40]]
    server = start_server(model_dir, tmp_path, ["--max_req_total_len", "256", "--max_total_token_num", "2048"])
    try:
        served = [_greedy_ids(server.url, server.model_name, prompt, 8) for prompt in prompts]
    finally:
        server.stop()
    assert "the prefix cache is off" in server.log()
    expected = []
    for prompt in prompts:
        # A fresh model per prompt (transformers' dynamic RoPE keeps the longest length it saw), decoding
        # with its KV cache as the server does: each generated token rotated at the length it makes.
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        generated = []
        with torch.no_grad():
            out = hf(torch.tensor([prompt]), use_cache=True)
            for _ in range(8):
                generated.append(int(out.logits[0, -1].argmax()))
                out = hf(torch.tensor([[generated[-1]]]), past_key_values=out.past_key_values, use_cache=True)
        expected.append(generated)
    assert served == expected
