"""The Triton attention backend: how it is chosen, and the real tiny models running on it.

On CPU the kernels run in Triton's interpreter (see conftest); the model test compares the
Triton backend (attention, fused residual-add RMSNorm, in-place rotary) with the torch backend,
the reference, on ragged prefill, a chunked continuation and decode steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import List

import pytest
import torch

from lightllm.common.basemodel.attention.selection import (
    AttentionBackendError,
    build_attention_backend,
    resolve_attention_backend,
)
from lightllm.common.basemodel.attention.torch_sdpa import TorchSdpaAttention
from lightllm.common.basemodel.batch_generator import BatchGenerator
from lightllm.common.basemodel.layer_ops import TritonLayerOps
from lightllm.models.registry import load_model
from lightllm.server.launch.arg_parser import make_argument_parser


def test_auto_takes_triton_on_cuda_and_cpp_or_torch_on_cpu(monkeypatch):
    assert resolve_attention_backend("auto", "cuda") == "triton"
    assert resolve_attention_backend("auto", "cpu") == "cpp"  # this machine has a C++ compiler
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("CXX", raising=False)
    assert resolve_attention_backend("auto", "cpu") == "torch"
    monkeypatch.undo()
    assert resolve_attention_backend("torch", "cuda") == "torch"
    assert resolve_attention_backend("torch", "cpu") == "torch"
    assert resolve_attention_backend("triton", "cuda") == "triton"


def test_triton_on_cpu_is_refused_outside_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # Triton reads this knob on every access
    with pytest.raises(AttentionBackendError, match="needs a CUDA device") as err:
        resolve_attention_backend("triton", "cpu")
    assert "\n" not in str(err.value)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_attention_backend("triton", "cpu") == "triton"


def test_missing_triton_falls_back_for_auto_and_is_refused_when_asked_for(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    assert resolve_attention_backend("auto", "cuda") == "torch"
    with pytest.raises(AttentionBackendError, match="needs the triton package"):
        resolve_attention_backend("triton", "cuda")


def test_unknown_backend_names_are_refused():
    with pytest.raises(AttentionBackendError, match="must be one of auto, torch, torch_compiled, cpp, triton"):
        resolve_attention_backend("flash", "cuda")
    with pytest.raises(AttentionBackendError):
        build_attention_backend("auto")  # only resolved names can be built


def test_cli_flag_choices_and_removed_graph_flag(capsys):
    parser = make_argument_parser()
    assert parser.parse_args(["--model_dir", "m"]).attention_backend == "auto"
    assert parser.parse_args(["--model_dir", "m", "--attention_backend", "triton"]).attention_backend == "triton"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model_dir", "m", "--attention_backend", "flash"])
    # CUDA-graph capture is not implemented, so the flag that claimed it is gone.
    with pytest.raises(SystemExit):
        parser.parse_args(["--model_dir", "m", "--graph_max_batch_size", "8"])
    capsys.readouterr()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_server_refuses_triton_on_cpu_with_one_line(tiny_llama_dir):
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run(
        [sys.executable, "-m", "lightllm.server.api_server", "--model_dir", str(tiny_llama_dir),
         "--device", "cpu", "--attention_backend", "triton"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: --attention_backend triton needs a CUDA device"), proc.stderr
    assert "Traceback" not in proc.stderr
    # Refused by the launcher before any child process (it was the rank's refusal, seconds in).
    assert "child" not in proc.stderr and "shared memory" not in proc.stderr, proc.stderr


def _run(model, prompts: List[List[int]]) -> List[torch.Tensor]:
    """Ragged first chunks, a continuation over the cached prefix, then two decode steps."""
    gen = BatchGenerator(model, kv_cache_size=256, max_request_num=6)
    seqs = [gen.start(p) for p in prompts]
    outputs = [gen.forward(seqs, [1, 9, 20], all_logits=True)]
    outputs.append(gen.forward(seqs[1:], [8, 13], all_logits=True))
    for step in range(2):
        for i, seq in enumerate(seqs):
            seq.token_ids.append(11 + 7 * i + step)  # fixed, so both backends decode the same tokens
        outputs.append(gen.forward(seqs, [1] * len(seqs)))
    for seq in seqs:
        gen.release(seq)
    assert gen.kv_cache.available == 256
    return outputs


@pytest.mark.parametrize("arch_dir", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
def test_triton_backend_in_the_model_matches_torch_backend(request, device, arch_dir):
    model_dir = str(request.getfixturevalue(arch_dir))
    reference = load_model(model_dir, dtype=torch.float32, device=device, attention=TorchSdpaAttention())
    triton_model = load_model(model_dir, dtype=torch.float32, device=device, attention=build_attention_backend("triton"))
    assert isinstance(triton_model.layer_ops, TritonLayerOps)  # norm and rotary go through Triton too
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, reference.config.vocab_size, (n,), generator=gen).tolist() for n in (1, 17, 33)]
    expected = _run(reference, [list(p) for p in prompts])
    got = _run(triton_model, [list(p) for p in prompts])
    assert len(got) == len(expected) == 4
    for step, (a, b) in enumerate(zip(got, expected)):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() < 1e-4, f"forward {step} differs by {(a - b).abs().max().item()}"


def test_backend_benchmark_runs_and_reports_agreement(tiny_llama_dir, device, tmp_path, capsys):
    from lightllm.benchmark.bench_attention_backends import main

    out = tmp_path / "bench.json"
    argv = ["--model_dir", str(tiny_llama_dir), "--device", device.type, "--dtype", "float32", "--batch", "2",
            "--context", "9", "--decode-steps", "2", "--repeats", "1", "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert [r["backend"] for r in report["results"]] == ["torch", "triton"]
    assert all(r["decode_tokens_per_s"] > 0 for r in report["results"])
    assert report["max_logit_diff"] < 1e-4
    assert "| triton |" in capsys.readouterr().out
    zero_batch = list(argv[:-2])
    zero_batch[zero_batch.index("--batch") + 1] = "0"
    assert main(zero_batch) == 2
