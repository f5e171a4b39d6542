"""The in-place attention backend (``torch_compiled``) against the gather + SDPA reference and transformers.

The workload is ``attention_scenario_support.run_scenario`` (short chunks take the compiled kernel,
long ones the SDPA fallback).
"""

from __future__ import annotations

import pytest
import torch

from lightllm.common.basemodel.attention.selection import (
    AttentionBackendError,
    build_attention_backend,
    resolve_attention_backend,
)
from lightllm.common.basemodel.attention import torch_compiled
from lightllm.common.basemodel.attention.torch_compiled import FUSED_MAX_QUERIES, TorchCompiledAttention
from lightllm.common.basemodel.attention.torch_sdpa import TorchSdpaAttention, _SdpaMeta
from lightllm.common.basemodel.forward_batch import ForwardBatch
from lightllm.models.registry import load_model

from attention_scenario_support import (
    assert_matches_reference,
    assert_matches_transformers,
    run_scenario as _scenario,
    two_cached_requests,
)


@pytest.fixture(scope="module", params=["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
def model_dir(request):
    return str(request.getfixturevalue(request.param))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_in_place_backend_matches_reference_backend(model_dir, dtype):
    assert_matches_reference(model_dir, dtype, TorchCompiledAttention(min_fused_context=0, min_fused_requests=1))


def test_row_chunked_kernel_matches_reference(tiny_llama_dir, monkeypatch):
    # A tiny score budget splits every kernel call into chunks of two or three rows.
    monkeypatch.setattr(torch_compiled, "MAX_SCORE_ELEMENTS", 64)
    reference = load_model(str(tiny_llama_dir), dtype=torch.float32, attention=TorchSdpaAttention())
    chunked = load_model(str(tiny_llama_dir), dtype=torch.float32, attention=TorchCompiledAttention(0, 1))
    expected, _ = _scenario(reference)
    got, _ = _scenario(chunked)
    assert max((g[2] - e[2]).abs().max().item() for g, e in zip(got, expected)) < 1e-4


def test_in_place_backend_matches_transformers(model_dir):
    assert_matches_transformers(model_dir, TorchCompiledAttention(min_fused_context=0, min_fused_requests=1))


def test_backend_is_selectable_and_reads_the_cache_in_place(tiny_llama_dir):
    assert resolve_attention_backend("torch_compiled", "cpu") == "torch_compiled"
    backend = build_attention_backend("torch_compiled")
    assert isinstance(backend, TorchCompiledAttention)
    model = load_model(str(tiny_llama_dir), dtype=torch.float32, attention=backend)
    _, seqs, req_to_token = two_cached_requests(model)
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
