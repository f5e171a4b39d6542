"""config.json values are read as transformers reads them, and a wrong one is refused naming its key.

Python's int()/float()/bool() and ``or default`` had turned wrong values into right-looking ones
(2.7 layers -> 2, "false" -> true, an rms_norm_eps of 0.0 -> the default 1e-6) or let them through
to a traceback in the launcher (a negative max_position_embeddings) or an error in a child
process that named no key (num_attention_heads 0: "integer modulo by zero").
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lightllm.common.basemodel.model_config import ModelConfig
from lightllm.common.basemodel.model_config_error import ModelConfigError

BASE = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, vocab_size=211, max_position_embeddings=256, rms_norm_eps=1e-6)


def _config(**changes: object) -> ModelConfig:
    return ModelConfig.from_dict({**BASE, **changes})


@pytest.mark.parametrize("key, value, message", [
    ("num_attention_heads", 0, r"num_attention_heads must be a positive integer, got 0"),
    ("hidden_size", "abc", r"hidden_size must be a positive integer, got 'abc'"),
    ("num_hidden_layers", 2.7, r"num_hidden_layers must be a positive integer, got 2\.7"),
    ("num_hidden_layers", 2.0, r"num_hidden_layers must be a positive integer, got 2\.0"),
    ("num_hidden_layers", True, r"num_hidden_layers must be a positive integer, got True"),
    ("vocab_size", 0, r"vocab_size must be a positive integer, got 0"),
    ("intermediate_size", -96, r"intermediate_size must be a positive integer, got -96"),
    ("max_position_embeddings", -5, r"max_position_embeddings must be a positive integer, got -5"),
    ("max_position_embeddings", 0, r"max_position_embeddings must be a positive integer, got 0"),
    ("max_position_embeddings", None, r"max_position_embeddings must be a positive integer, got None"),
    ("num_key_value_heads", 0, r"num_key_value_heads must be a positive integer, got 0"),
    ("head_dim", 0, r"head_dim must be a positive integer, got 0"),
    ("rms_norm_eps", 0, r"rms_norm_eps must be a number of at least 0 written with a decimal point"),
    ("rms_norm_eps", -1e-6, r"rms_norm_eps must be a number of at least 0, got -1e-06"),
    ("rms_norm_eps", "1e-6", r"rms_norm_eps must be a number of at least 0, got '1e-6'"),
    ("tie_word_embeddings", "false", r"tie_word_embeddings must be true or false, got 'false'"),
    ("tie_word_embeddings", None, r"tie_word_embeddings must be true or false, got None"),
    ("attention_bias", 1, r"attention_bias must be true or false, got 1"),
    ("rope_theta", "500000", r"rope_theta must be a positive number, got '500000'"),
    ("rope_theta", 0, r"rope_theta must be a positive number, got 0"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": "5e5"}, r"rope_parameters\.rope_theta must be a positive number"),
    ("partial_rotary_factor", "half", r"partial_rotary_factor must be a number in \(0, 1\], got 'half'"),
])
def test_a_wrong_value_is_refused_naming_its_key(key, value, message):
    with pytest.raises(ModelConfigError, match=r"config\.json: " + message):
        _config(**{key: value})


@pytest.mark.parametrize("changes", [
    dict(model_type="qwen2", use_sliding_window="yes", sliding_window=16),
    dict(model_type="qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1.5),
])
def test_qwen_sliding_window_keys_are_typed(changes):
    with pytest.raises(ModelConfigError, match=r"config\.json: (use_sliding_window|max_window_layers) must be"):
        _config(**changes)


def test_values_transformers_takes_are_still_taken():
    config = _config(num_key_value_heads=None, head_dim=None, tie_word_embeddings=True, rope_theta=500000,
                     partial_rotary_factor=None)
    assert (config.num_key_value_heads, config.head_dim, config.tie_word_embeddings) == (4, 16, True)
    assert config.rope.theta == 500000.0
    missing = {key: value for key, value in BASE.items() if key != "max_position_embeddings"}
    assert ModelConfig.from_dict(missing).max_position_embeddings == 2048  # LlamaConfig's default
    assert "max_position_embeddings" in ModelConfig.from_dict(missing).defaulted


def test_an_rms_norm_eps_of_zero_is_used_as_written_as_transformers_uses_it():
    assert _config(rms_norm_eps=0.0).rms_norm_eps == 0.0
    reference = LlamaConfig(**{key: value for key, value in BASE.items() if key != "model_type"} | {"rms_norm_eps": 0.0})
    assert reference.rms_norm_eps == 0.0
    # transformers computes with it: the norm of small hidden states differs from eps 1e-6's.
    torch.manual_seed(0)
    model = LlamaForCausalLM(reference).eval()
    hidden = torch.full((1, 1, 64), 1e-4)
    norm = model.model.norm
    assert norm.variance_epsilon == 0.0
    assert torch.allclose(norm(hidden), torch.ones_like(hidden) * norm.weight, atol=1e-4)
