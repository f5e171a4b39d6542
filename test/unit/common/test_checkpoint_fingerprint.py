"""The weights digest PD nodes compare: equal for the same weights however they are stored, different
for other weights of the same shapes, and read without torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lightllm.common.basemodel.checkpoint_fingerprint import checkpoint_fingerprint

SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
             vocab_size=211, max_position_embeddings=64)


def _save(path, seed: int, **save_kwargs):
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE))
    model.save_pretrained(path, **save_kwargs)
    return model


def test_same_weights_same_digest_other_weights_other_digest(tmp_path):
    model = _save(tmp_path / "a", seed=0)
    model.save_pretrained(tmp_path / "resharded", max_shard_size="40KB")  # other files, same tensors
    assert len(list((tmp_path / "resharded").glob("*.safetensors"))) > 1
    _save(tmp_path / "b", seed=1)  # same names and shapes, other weights
    digest = checkpoint_fingerprint(tmp_path / "a")
    assert len(digest) == 16 and int(digest, 16) >= 0
    assert checkpoint_fingerprint(tmp_path / "resharded") == digest
    assert checkpoint_fingerprint(tmp_path / "b") != digest
    # Config files are not weights: a copy whose config.json differs in an unused field keeps it.
    config = tmp_path / "a" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "transformers_version": "0.0"}))
    assert checkpoint_fingerprint(tmp_path / "a") == digest


def test_one_changed_tensor_changes_the_digest(tmp_path):
    model = _save(tmp_path / "a", seed=0)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(1.01)  # a fine-tune touching one matrix
    model.save_pretrained(tmp_path / "tuned")
    assert checkpoint_fingerprint(tmp_path / "tuned") != checkpoint_fingerprint(tmp_path / "a")


def test_no_checkpoint_is_a_value_error_and_torch_is_not_imported(tmp_path, tiny_llama_dir):
    with pytest.raises(ValueError, match="no \\*.safetensors files"):
        checkpoint_fingerprint(tmp_path)
    code = ("import sys; from lightllm.common.basemodel.checkpoint_fingerprint import checkpoint_fingerprint; "
            f"checkpoint_fingerprint({str(tiny_llama_dir)!r}); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
