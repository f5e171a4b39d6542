"""The kernel benchmarks size their generators to the longest sequence they compute, so a
context their own flag check accepts runs on a checkpoint whose window is exactly that long
(the library refuses a max_sequence_length beyond a sliding window)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from lightllm.benchmark import bench_decode_attention, bench_linear_backends
from lightllm.benchmark.simulator import fit_cost_profile
from lightllm.common.basemodel.attention.selection import build_attention_backend
from lightllm.models.registry import load_model

WINDOW = 160


@pytest.fixture(scope="module")
def windowed_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = MistralConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=48, vocab_size=1000, max_position_embeddings=512, sliding_window=WINDOW)
    out = tmp_path_factory.mktemp("windowed") / "mistral"
    MistralForCausalLM(config).save_pretrained(out)
    return out


def test_bench_decode_attention_runs_a_context_that_fills_the_window(windowed_dir: Path) -> None:
    steps = 2
    context = WINDOW - bench_decode_attention.decode_tokens_added(1, steps)
    assert bench_decode_attention.context_refusal(str(windowed_dir), "--contexts", context,
                                                  bench_decode_attention.decode_tokens_added(1, steps)) is None
    model = load_model(str(windowed_dir), dtype=torch.float32)
    cell = bench_decode_attention.measure_cell(model, {"torch": build_attention_backend("torch", strict=True)},
                                               batch=2, context=context, steps=steps, seed=0)
    assert cell["torch_ms"] >= 0


def test_bench_linear_backends_runs_a_context_and_prefill_that_fill_the_window(windowed_dir: Path) -> None:
    rows = bench_linear_backends.run(str(windowed_dir), threads=[1], rows=1, context=WINDOW - 1, prefill=WINDOW,
                                     repeats=1)
    assert rows and all(row["decode_ms"] >= 0 and row["prefill_ms"] >= 0 for row in rows)


def test_fit_cost_profile_refuses_a_window_shorter_than_its_sequences(windowed_dir: Path, capsys) -> None:
    with pytest.raises(SystemExit) as raised:
        fit_cost_profile.main(["--model-dir", str(windowed_dir), "--out", str(windowed_dir / "p.json")])
    assert raised.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"has a sliding window of {WINDOW} tokens; the measured sequences reach 2112" in err[0]
