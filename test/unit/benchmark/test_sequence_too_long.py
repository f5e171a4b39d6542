"""The benchmark tools' context check uses the context the checkpoint declares, RoPE scaling included."""

from __future__ import annotations

import json

from lightllm.benchmark.cli_args import sequence_too_long

LLAMA = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, vocab_size=211, max_position_embeddings=32)


def _model_dir(tmp_path, **extra):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, **extra}))
    return str(tmp_path)


def test_a_linear_rope_factor_stretches_the_context_it_checks(tmp_path):
    model_dir = _model_dir(tmp_path, rope_scaling={"type": "linear", "factor": 2.0})
    assert sequence_too_long(model_dir, {"--prompt-len": 40, "--new-tokens": 20}) is None
    assert sequence_too_long(model_dir, {"--prompt-len": 40, "--new-tokens": 20}, exact_attention=False) is None
    problem = sequence_too_long(model_dir, {"--prompt-len": 60, "--new-tokens": 5})
    assert problem == (f"--prompt-len 60 plus --new-tokens 5 is 65 tokens, more than the model's context of 64 "
                       f"(max_position_embeddings x its linear rope factor in {model_dir}/config.json)")


def test_an_unscaled_checkpoint_names_max_position_embeddings(tmp_path):
    model_dir = _model_dir(tmp_path)
    problem = sequence_too_long(model_dir, {"--prompt-len": 30, "--new-tokens": 3})
    assert problem.endswith(f"context of 32 (max_position_embeddings in {model_dir}/config.json)")
