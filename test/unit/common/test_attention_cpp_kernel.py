"""The C++ slot-attention backend (``--attention_backend cpp``) against references.

The kernel alone against the plain-tensor definition of slot attention (scattered slots, causal
queries, every supported head_dim and group size, float32 and bfloat16 caches, one and two
threads); the backend inside the model against gather + SDPA on the mixed workload of
``attention_scenario_support`` (ragged batches, cached and shared prefixes, chunked
continuations, pause and resume) for Llama and Qwen2 in fp32 and bf16, and against transformers.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import time

import pytest
import torch

from lightllm.common.basemodel.attention import cpp_kernel_build
from lightllm.common.basemodel.attention.cpp_attention import (
    MAX_KERNEL_QUERIES,
    CppSlotAttention,
    _KernelMeta,
    _PrefillKernelMeta,
)
from lightllm.common.basemodel.attention.cpp_kernel_build import KernelBuildError, load_kernel_library
from lightllm.common.basemodel.attention.selection import (
    AttentionBackendError,
    build_attention_backend,
    cpp_compiler,
    resolve_attention_backend,
)
from lightllm.common.basemodel.attention.slot_attention_kernel import slot_attention_eager
from lightllm.common.basemodel.attention.torch_sdpa import TorchSdpaAttention, _SdpaMeta
from lightllm.common.basemodel.batch_generator import BatchGenerator
from lightllm.common.basemodel.forward_batch import ForwardBatch
from lightllm.models.registry import load_model

from cpp_kernel_build_support import cpu_flags, haswell_build
from attention_scenario_support import (
    assert_matches_reference,
    assert_matches_transformers,
    random_tokens,
    two_cached_requests,
)

pytestmark = pytest.mark.skipif(cpp_compiler() is None, reason="no C++ compiler on PATH")


@pytest.fixture(scope="module")
def library() -> ctypes.CDLL:
    return load_kernel_library(cpp_compiler())


def _kernel(library, q, k, v, slots, q_pos, threads=1) -> torch.Tensor:
    batch, queries, kv_heads, group, head_dim = q.shape
    out = torch.empty_like(q)
    code = library.lightllm_slot_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), slots.data_ptr(), 0, q_pos.data_ptr(), batch, queries,
        slots.shape[1], kv_heads, group, head_dim, 0 if k.dtype == torch.float32 else 1, head_dim ** -0.5,
        threads, out.data_ptr(),
    )
    assert code == 0
    return out


SHAPES = [(16, 1), (32, 2), (64, 4), (80, 3), (96, 8), (128, 1), (256, 2), (64, 16)]  # head_dim, group


@pytest.mark.parametrize("head_dim,group", SHAPES)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_matches_the_definition(library, head_dim, group, kv_dtype):
    _check_against_the_definition(library, head_dim, group, kv_dtype)


def _check_against_the_definition(library, head_dim, group, kv_dtype):
    gen = torch.Generator().manual_seed(head_dim * 31 + group)
    batch, queries, kv_heads, context = 3, 4, 2, 75  # 75: two full blocks of 32 and a partial one
    rows = batch * context + 20
    k = torch.randn(rows, kv_heads, head_dim, generator=gen).to(kv_dtype)
    v = torch.randn(rows, kv_heads, head_dim, generator=gen).to(kv_dtype)
    # Scattered slots, and two requests sharing a prefix (the same slots), as the radix cache does.
    slots = torch.randperm(rows, generator=gen)[: batch * context].view(batch, context).contiguous()
    slots[1, :40] = slots[0, :40]
    q = torch.randn(batch, queries, kv_heads, group, head_dim, generator=gen)
    # Causal queries at different depths: position 0 (one visible key), a block edge, the end.
    q_pos = torch.tensor([[0, 31, 32, 74], [5, 6, 7, 8], [70, 71, 72, 74]], dtype=torch.int64)
    expected = slot_attention_eager(q, k, v, slots, torch.tensor(0), q_pos)
    got = _kernel(library, q, k, v, slots, q_pos)
    assert (got - expected).abs().max().item() < 1e-5
    assert torch.equal(_kernel(library, q, k, v, slots, q_pos, threads=2), got)


@pytest.fixture(scope="module")
def eight_float_library(library) -> ctypes.CDLL:
    """The slot kernel alone, built for AVX2 + FMA without AVX-512 (-march=haswell), where it runs
    on eight-float vectors; cached like the server's build (about 27 s the first time on two cores)."""
    if library.lightllm_slot_attention_lanes() == 8:
        pytest.skip("this machine's own build runs the eight-float kernel: test_kernel_matches_the_definition checks it")
    narrow = haswell_build("cpp_slot_attention.cpp", cpp_kernel_build.declare_slot_attention)
    assert narrow.lightllm_slot_attention_lanes() == 8
    return narrow


@pytest.mark.parametrize("head_dim,group", SHAPES)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_eight_float_kernel_of_an_avx2_build_matches_the_definition(eight_float_library, head_dim, group,
                                                                        kv_dtype):
    """Without AVX-512 the kernel's vectors are eight floats (sixteen-float ones stayed on the stack
    there and ran 3-9x slower); on an AVX-512 machine only a -march=haswell build runs that code."""
    _check_against_the_definition(eight_float_library, head_dim, group, kv_dtype)


def test_kernel_refuses_shapes_it_has_no_variant_for(library):
    assert library.lightllm_slot_attention_supports(128, 4) == 1
    assert library.lightllm_slot_attention_supports(48, 1) == 0
    assert library.lightllm_slot_attention_supports(64, 9) == 0
    q = torch.zeros(1, 1, 1, 1, 48)
    cache = torch.zeros(2, 1, 48)
    index = torch.zeros(1, 1, dtype=torch.int64)
    code = library.lightllm_slot_attention(q.data_ptr(), cache.data_ptr(), cache.data_ptr(), index.data_ptr(), 0,
                                           index.data_ptr(), 1, 1, 1, 1, 1, 48, 0, 1.0, 1, q.data_ptr())
    assert code == 1


@pytest.fixture(scope="module", params=["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
def model_dir(request):
    return str(request.getfixturevalue(request.param))


def _tiled() -> CppSlotAttention:
    # The tiled prefill kernel, as the server runs it on every build.
    return CppSlotAttention(cpp_compiler(), tiled_prefill=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backend_matches_gather_and_sdpa(model_dir, dtype):
    assert_matches_reference(model_dir, dtype, _tiled())


def test_backend_matches_transformers(model_dir):
    assert_matches_transformers(model_dir, _tiled())


def test_backend_without_the_tiled_prefill_kernel_matches_gather_and_sdpa(tiny_llama_dir):
    assert_matches_reference(str(tiny_llama_dir), torch.float32, CppSlotAttention(cpp_compiler(), tiled_prefill=False))


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="reads the CPU's flags from /proc/cpuinfo")
def test_the_server_takes_the_tiled_prefill_kernel_on_every_build_with_vectors_as_wide_as_the_build(library):
    """Both kernels' vectors are 16 floats with AVX-512 and 8 otherwise; the tiled prefill kernel
    serves long chunks on either (built for AVX2 on 16-float blocks it spilled and ran 19-29x slower
    than gather + SDPA, which took those chunks there; on 8-float blocks it takes 0.57-0.81x the time)."""
    lanes = 16 if "avx512f" in cpu_flags() else 8
    assert library.lightllm_prefill_attention_lanes() == lanes
    assert library.lightllm_slot_attention_lanes() == lanes  # the decode kernel's vectors
    assert build_attention_backend("cpp").tiled_prefill


def test_backend_takes_decode_and_short_chunks_and_gives_long_ones_to_the_prefill_kernel(tiny_llama_dir):
    assert resolve_attention_backend("cpp", "cpu") == "cpp"
    assert isinstance(build_attention_backend("cpp"), CppSlotAttention)
    backend = _tiled()
    model = load_model(str(tiny_llama_dir), dtype=torch.float32, attention=backend)
    _, seqs, req_to_token = two_cached_requests(model)
    # A single request decodes through the kernel too (no padding, no size threshold).
    single = ForwardBatch.build([[5]], [30], [seqs[0].row], torch.tensor([200]))
    assert isinstance(backend.prepare(single, req_to_token), _KernelMeta)
    decode = ForwardBatch.build([[5], [5]], [30, 12], [s.row for s in seqs], torch.tensor([200, 201]))
    meta = backend.prepare(decode, req_to_token)
    assert meta.slots.shape == (2, 31) and torch.equal(meta.slots[1, :12], req_to_token[seqs[1].row, :12])
    short = ForwardBatch.build([[5] * MAX_KERNEL_QUERIES], [30], [seqs[0].row], torch.arange(200, 200 + MAX_KERNEL_QUERIES))
    assert isinstance(backend.prepare(short, req_to_token), _KernelMeta)
    long_chunk = ForwardBatch.build([[5] * (MAX_KERNEL_QUERIES + 1)], [30], [seqs[0].row], torch.arange(200, 217))
    meta = backend.prepare(long_chunk, req_to_token)
    assert isinstance(meta, _PrefillKernelMeta)
    assert meta.cached_lens.tolist() == [30] and meta.new_lens.tolist() == [MAX_KERNEL_QUERIES + 1]
    # Without the tiled kernel only the long chunk leaves the slot kernel, for gather + SDPA.
    untiled = CppSlotAttention(cpp_compiler(), tiled_prefill=False)
    assert isinstance(untiled.prepare(long_chunk, req_to_token), _SdpaMeta)
    assert isinstance(untiled.prepare(short, req_to_token), _KernelMeta)
    assert isinstance(untiled.prepare(decode, req_to_token), _KernelMeta)


def test_a_layout_without_a_kernel_variant_is_refused_when_cpp_was_asked_for_by_name() -> None:
    """--attention_backend cpp with float16 started and ran every forward on SDPA while the log said
    attention_backend=cpp (outside pass); only auto may fall back."""
    strict = build_attention_backend("cpp", strict=True)
    with pytest.raises(AttentionBackendError, match=r"^--attention_backend cpp: the kernel has no variant for "
                                                    r"head_dim 32, 2 query heads per KV head, dtype float16 on cpu; "
                                                    r"use --attention_backend auto or torch$"):
        strict.warmup(q_heads=4, kv_heads=2, head_dim=32, dtype=torch.float16, device=torch.device("cpu"))
    strict.warmup(q_heads=4, kv_heads=2, head_dim=32, dtype=torch.float32, device=torch.device("cpu"))


def test_a_layout_without_a_kernel_variant_runs_on_sdpa_and_says_so(tiny_llama_dir, caplog):
    backend = build_attention_backend("cpp")
    with caplog.at_level(logging.WARNING, logger="lightllm.attention"):
        backend.warmup(q_heads=3, kv_heads=1, head_dim=48, dtype=torch.float32, device=torch.device("cpu"))
    assert "no variant for head_dim 48" in caplog.text
    model = load_model(str(tiny_llama_dir), dtype=torch.float32, attention=TorchSdpaAttention())
    gen = BatchGenerator(model, kv_cache_size=64, max_request_num=2)
    seq = gen.start(random_tokens(model.config.vocab_size, 8, seed=3))
    gen.forward([seq], [8])
    decode = ForwardBatch.build([[5]], [8], [seq.row], torch.tensor([60]))
    assert isinstance(backend.prepare(decode, gen.req_manager.req_to_token), _SdpaMeta)


def test_backend_is_refused_where_it_cannot_run(monkeypatch, caplog):
    with pytest.raises(AttentionBackendError, match="runs on CPU only"):
        resolve_attention_backend("cpp", "cuda")
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(AttentionBackendError, match="builds its kernel with a C\\+\\+ compiler"):
        resolve_attention_backend("cpp", "cpu")
    # auto falls back without a compiler too, and says so (a slim image loses the fast kernel).
    with caplog.at_level(logging.WARNING, logger="lightllm.attention"):
        assert resolve_attention_backend("auto", "cpu") == "torch"
    assert "no C++ compiler for the cpp kernel" in caplog.text


def test_build_is_cached_per_source_compiler_and_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    compiler = cpp_compiler()
    target = cpp_kernel_build.kernel_path(compiler)
    assert target.parent == tmp_path / "lightllm" / "kernels" and not target.exists()
    cpp_kernel_build._build(compiler, target)
    assert target.exists() and [p.name for p in target.parent.iterdir()] == [target.name]  # no partial files left
    monkeypatch.setattr(cpp_kernel_build, "FLAGS", [*cpp_kernel_build.FLAGS, "-DLIGHTLLM_OTHER_FLAGS"])
    assert cpp_kernel_build.kernel_path(compiler) != target


def test_a_cached_library_is_marked_used_and_a_build_prunes_only_stale_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    compiler = cpp_compiler()
    target = cpp_kernel_build.kernel_path(compiler)
    target.parent.mkdir(parents=True)
    target.write_bytes(b"stands in for a built library: build_kernel only finds it, nothing loads it")
    month_ago = time.time() - 31 * 24 * 3600
    os.utime(target, (month_ago, month_ago))
    assert cpp_kernel_build.build_kernel(compiler) == target
    assert time.time() - target.stat().st_mtime < 60  # in use: refreshed, so never pruned
    stale = [target.parent / "cpu_kernels_0123456789abcdef0123.so",
             target.parent / "cpu_kernels_0123456789abcdef0123.abc.partial.so"]
    fresh = target.parent / "cpu_kernels_fedcba9876543210fedc.so"
    other = target.parent / "notes.txt"
    for path in (*stale, fresh, other):
        path.write_bytes(b"x")
    for path in (*stale, other):
        os.utime(path, (month_ago, month_ago))
    old_keep = target.parent / "cpu_kernels_keep.so"
    old_keep.write_bytes(b"x")
    os.utime(old_keep, (month_ago, month_ago))
    removed = cpp_kernel_build.prune_stale_kernels(target.parent, keep=old_keep)
    assert sorted(removed) == sorted(stale)
    assert all(path.exists() for path in (target, fresh, other, old_keep))


def test_a_failing_compiler_gives_a_one_line_error(tmp_path):
    false = subprocess.run(["which", "false"], capture_output=True, text=True).stdout.strip()
    with pytest.raises(KernelBuildError, match="failed to build cpp_slot_attention.cpp") as info:
        cpp_kernel_build._build(false, tmp_path / "kernel.so")
    assert "\n" not in str(info.value)
    assert not list(tmp_path.iterdir())


def test_a_kernel_that_cannot_be_built_refuses_cpp_and_makes_auto_fall_back(tmp_path, monkeypatch, caplog):
    # A "compiler" that fails: the launcher builds the kernel before it starts any rank, so the
    # failure is a one-line start-up error for cpp and a logged fallback to torch for auto.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", subprocess.run(["which", "false"], capture_output=True, text=True).stdout.strip())
    with pytest.raises(AttentionBackendError, match="--attention_backend cpp: .*failed to build") as info:
        resolve_attention_backend("cpp", "cpu")
    assert "\n" not in str(info.value)
    with caplog.at_level(logging.WARNING, logger="lightllm.attention"):
        assert resolve_attention_backend("auto", "cpu") == "torch"
    assert "cpp kernel cannot be built" in caplog.text


def test_a_first_build_says_why_the_start_waits_and_a_cached_one_says_nothing(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    # Stands in for the compiler (the real build is tested above): only the log lines matter here.
    def pretend_build(compiler, target):
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(b"x")

    monkeypatch.setattr(cpp_kernel_build, "_build", pretend_build)
    compiler = cpp_compiler()
    with caplog.at_level("INFO", logger="lightllm.cpp_kernel"):
        cpp_kernel_build.build_kernel(compiler)
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 2 and messages[0].startswith("building the C++ CPU kernels with ")
    assert "first start on this machine only" in messages[0] and messages[1].startswith("C++ CPU kernels built in ")
    caplog.clear()
    with caplog.at_level("INFO", logger="lightllm.cpp_kernel"):
        cpp_kernel_build.build_kernel(compiler)
    assert not caplog.records


def test_the_launchers_support_table_is_the_built_kernels() -> None:
    """The launcher refuses a model from a table, before anything loads; the built library decides at
    the rank. They must agree, or one refuses what the other runs."""
    from lightllm.common.basemodel.attention.cpp_kernel_support import cpp_kernel_supports

    library = load_kernel_library(cpp_compiler())
    for head_dim in range(1, 300):
        for group in range(1, 20):
            built = bool(library.lightllm_slot_attention_supports(head_dim, group))
            assert cpp_kernel_supports(head_dim, group, "float32") == built, (head_dim, group)
    assert not cpp_kernel_supports(32, 2, "float16") and cpp_kernel_supports(32, 2, "bfloat16")


def test_cpp_named_for_a_model_it_cannot_run_is_refused_before_anything_starts(tiny_llama_dir) -> None:
    from lightllm.common.basemodel.model_config import ModelConfig
    from lightllm.server.argument_error import ArgumentError
    from lightllm.server.launch.arg_parser import parse_server_args
    from lightllm.server.launch.checkpoint_checks import check_attention_backend_fits

    config = ModelConfig.from_dir(str(tiny_llama_dir))
    for backend, dtype in (("cpp", "float32"), ("auto", "float16"), ("torch", "float16")):
        check_attention_backend_fits(parse_server_args(["--model_dir", "/m", "--attention_backend", backend]),
                                     config, dtype)
    with pytest.raises(ArgumentError, match=r"^--attention_backend cpp: the kernel has no variant for head_dim "
                                            rf"{config.head_dim}, .* dtype float16 .*use --attention_backend auto"):
        check_attention_backend_fits(parse_server_args(["--model_dir", "/m", "--attention_backend", "cpp"]),
                                     config, "float16")

