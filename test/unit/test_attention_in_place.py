"""The in-place attention backend (``torch_compiled``) against the gather + SDPA reference and transformers.

The workload is ``attention_scenario_support.run_scenario`` (short chunks take the compiled kernel,
long ones the SDPA fallback).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightllm.common.basemodel.attention.selection import (
    AttentionBackendError,
    build_attention_backend,
    resolve_attention_backend,
)
from lightllm.common.basemodel.attention import torch_compiled
from lightllm.common.basemodel.attention.torch_compiled import FUSED_MAX_QUERIES, TorchCompiledAttention
from lightllm.common.basemodel.attention.torch_sdpa import TorchSdpaAttention, _SdpaMeta
from lightllm.common.basemodel.batch_generator import BatchGenerator
from lightllm.common.basemodel.forward_batch import ForwardBatch
from lightllm.models.registry import load_model

from attention_scenario_support import run_scenario as _scenario, random_tokens as _tokens


@pytest.fixture(scope="module", params=["tiny_llama_dir", "tiny_qwen2_dir"])
def model_dir(request):
    return str(request.getfixturevalue(request.param))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_in_place_backend_matches_reference_backend(model_dir, dtype):
    reference = load_model(model_dir, dtype=dtype, attention=TorchSdpaAttention())
    in_place = load_model(model_dir, dtype=dtype, attention=TorchCompiledAttention(min_fused_context=0, min_fused_requests=1))
    expected, tokens = _scenario(reference)
    got, got_tokens = _scenario(in_place)
    assert got_tokens == tokens and len(got) == len(expected) > 300
    # fp32: summation order only.  bf16: both round K/V and outputs to bf16 between layers.
    tolerance = 1e-4 if dtype == torch.float32 else 0.05
    worst = max((g[2] - e[2]).abs().max().item() for g, e in zip(got, expected))
    scale = max(e[2].abs().max().item() for e in expected)
    assert worst < tolerance * max(scale, 1.0), f"largest logit difference {worst} (logit scale {scale})"


def test_row_chunked_kernel_matches_reference(tiny_llama_dir, monkeypatch):
    # A tiny score budget splits every kernel call into chunks of two or three rows.
    monkeypatch.setattr(torch_compiled, "MAX_SCORE_ELEMENTS", 64)
    reference = load_model(str(tiny_llama_dir), dtype=torch.float32, attention=TorchSdpaAttention())
    chunked = load_model(str(tiny_llama_dir), dtype=torch.float32, attention=TorchCompiledAttention(0, 1))
    expected, _ = _scenario(reference)
    got, _ = _scenario(chunked)
    assert max((g[2] - e[2]).abs().max().item() for g, e in zip(got, expected)) < 1e-4


def test_in_place_backend_matches_transformers(model_dir):
    in_place = load_model(model_dir, dtype=torch.float32, attention=TorchCompiledAttention(min_fused_context=0, min_fused_requests=1))
    rows, tokens = _scenario(in_place)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = {row: ref(torch.tensor([t])).logits[0] for row, t in tokens.items()}
    worst = max((row - expected[seq][pos]).abs().max().item() for seq, pos, row in rows)
    assert worst < 1e-4, f"largest logit difference from transformers {worst}"


def test_backend_is_selectable_and_reads_the_cache_in_place(tiny_llama_dir):
    assert resolve_attention_backend("torch_compiled", "cpu") == "torch_compiled"
    backend = build_attention_backend("torch_compiled")
    assert isinstance(backend, TorchCompiledAttention)
    model = load_model(str(tiny_llama_dir), dtype=torch.float32, attention=backend)
    gen = BatchGenerator(model, kv_cache_size=256, max_request_num=4)
    seqs = [gen.start(_tokens(model.config.vocab_size, n, seed=n)) for n in (30, 12)]
    gen.forward(seqs, [30, 12])
    req_to_token = gen.req_manager.req_to_token
    decode = ForwardBatch.build([[5], [5]], [30, 12], [s.row for s in seqs], torch.tensor([200, 201]))
    # Small batches stay on the gather + SDPA path, whose per-call cost is lower.
    assert isinstance(backend.prepare(decode, req_to_token), _SdpaMeta)
    backend.min_fused_context = 0
    meta = backend.prepare(decode, req_to_token)
    # One [requests, longest context] slot table per forward, shared by every layer.
    assert meta.slots.shape == (2, 31)
    assert torch.equal(meta.slots[1, :12], req_to_token[seqs[1].row, :12])
    long_chunk = ForwardBatch.build([[5] * (FUSED_MAX_QUERIES + 1)], [30], [seqs[0].row], torch.arange(200, 217))
    assert isinstance(backend.prepare(long_chunk, req_to_token), _SdpaMeta)


def test_backend_is_refused_where_it_cannot_run(monkeypatch):
    with pytest.raises(AttentionBackendError, match="runs on CPU only"):
        resolve_attention_backend("torch_compiled", "cuda")
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(AttentionBackendError, match="needs a C\\+\\+ compiler"):
        resolve_attention_backend("torch_compiled", "cpu")


def test_decode_slots_are_recorded_in_one_write():
    from lightllm.common.req_manager import ReqManager

    manager = ReqManager(4, 8)
    manager.set_next_slots([2, 0], [5, 7], torch.tensor([11, 12]))
    assert manager.req_to_token[2, 5].item() == 11 and manager.req_to_token[0, 7].item() == 12
    with pytest.raises(ValueError, match="exceeds max_sequence_length 8"):
        manager.set_next_slots([1], [8], torch.tensor([3]))
    with pytest.raises(ValueError, match="do not match"):
        manager.set_next_slots([1, 2], [0], torch.tensor([3]))


def test_decode_benchmark_runs_both_backends(tiny_llama_dir, tmp_path, capsys):
    import json

    from lightllm.benchmark.bench_decode_attention import main

    out = tmp_path / "bench.json"
    argv = ["--model_dir", str(tiny_llama_dir), "--batches", "3", "--contexts", "9", "--steps", "1",
            "--clock", "cpu", "--min-fused-context", "0", "--json", str(out)]
    assert main(argv) == 0
    (cell,) = json.loads(out.read_text())["results"]
    assert cell["torch_ms"] > 0 and cell["torch_compiled_ms"] > 0
    assert cell["max_logit_diff"] < 1e-4  # threshold 0: the kernel serves this batch and agrees with SDPA
    assert "| 3 | 9 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--model_dir", str(tiny_llama_dir), "--backends", "triton"])
