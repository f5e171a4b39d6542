"""Reading a checkpoint's RoPE config: the keys each supported type requires (as transformers
requires them) and the context it declares (as vLLM derives its default ``max_model_len``)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from lightllm.common.basemodel.model_config import ModelConfig, ModelConfigError
from lightllm.common.basemodel.rope_config import REQUIRED_ROPE_KEYS, SUPPORTED_ROPE_TYPES

BASE = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, vocab_size=211, max_position_embeddings=64)

# A complete config of each supported type; each case below drops or spoils one key.
COMPLETE = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 500000.0},
}
MISSING = [(rope_type, key) for rope_type in SUPPORTED_ROPE_TYPES for key in REQUIRED_ROPE_KEYS[rope_type]]


def _spellings(rope: dict) -> list[tuple[str, dict]]:
    """The 5.x spelling (``rope_parameters`` + ``rope_type``) and the 4.x one (``rope_scaling`` + ``type``)."""
    legacy = {("type" if key == "rope_type" else key): value for key, value in rope.items() if key != "rope_theta"}
    return [("rope_parameters", {**BASE, "rope_parameters": rope}),
            ("rope_scaling", {**BASE, "rope_theta": rope.get("rope_theta", 10000.0), "rope_scaling": legacy})]


def test_every_supported_type_has_its_required_keys_listed():
    assert set(REQUIRED_ROPE_KEYS) == set(SUPPORTED_ROPE_TYPES) == set(COMPLETE)
    for rope_type, rope in COMPLETE.items():
        for _, raw in _spellings(rope):
            assert ModelConfig.from_dict(raw).rope.rope_type == rope_type
            LlamaConfig(**raw)  # transformers accepts the complete configs


@pytest.mark.parametrize("rope_type, key", MISSING)
def test_a_missing_required_rope_key_is_refused_naming_it_where_transformers_raises_a_key_error(rope_type, key):
    for source, raw in _spellings({k: v for k, v in COMPLETE[rope_type].items() if k != key}):
        with pytest.raises(ModelConfigError) as refused:
            ModelConfig.from_dict(raw)
        message = str(refused.value)
        assert message.startswith(f"config.json: {source}.{key} is missing; rope type {rope_type!r} requires")
        assert "\n" not in message
        # The same config fails in transformers (a bare KeyError when the config is built), which is
        # where the detokenization process used to fail after the whole server had started.
        with pytest.raises(KeyError, match=key):
            LlamaConfig(**raw)


def test_the_tester_s_linear_config_without_a_factor_is_refused():
    raw = {**BASE, "rope_theta": 10000.0, "rope_scaling": {"type": "linear"}}
    with pytest.raises(ModelConfigError, match=r"^config.json: rope_scaling.factor is missing"):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("key, value", [("factor", None), ("factor", "2"), ("factor", True), ("factor", 0),
                                        ("low_freq_factor", None), ("high_freq_factor", "4"),
                                        ("original_max_position_embeddings", None),
                                        ("original_max_position_embeddings", 16.5)])
def test_a_rope_value_that_is_no_usable_number_is_refused_naming_the_key(key, value):
    raw = {**BASE, "rope_parameters": {**COMPLETE["llama3"], key: value}}
    with pytest.raises(ModelConfigError, match=rf"^config.json: rope_parameters.{key} must be"):
        ModelConfig.from_dict(raw)


def test_llama3_without_original_max_position_embeddings_uses_max_position_embeddings_as_transformers():
    rope = {k: v for k, v in COMPLETE["llama3"].items() if k != "original_max_position_embeddings"}
    cfg = ModelConfig.from_dict({**BASE, "rope_parameters": rope})
    assert cfg.rope.original_max_position_embeddings is None  # the rotary falls back to max_position_embeddings
    assert LlamaConfig(**{**BASE, "rope_parameters": rope}).rope_parameters["original_max_position_embeddings"] == 64


@pytest.mark.parametrize("rope_type, max_positions, factor, context", [
    ("linear", 64, 4.0, 256),
    ("dynamic", 32, 2.0, 64),
    ("dynamic", 33, 2.5, 82),  # truncated, as vLLM's int()
    ("llama3", 64, 8.0, 64),  # llama3's max_position_embeddings is already the extended context
    ("default", 64, None, 64),
])
def test_the_context_is_the_one_vllm_derives(rope_type, max_positions, factor, context):
    rope = dict(COMPLETE[rope_type])
    if factor is not None:
        rope["factor"] = factor
    for _, raw in _spellings(rope):
        cfg = ModelConfig.from_dict({**raw, "max_position_embeddings": max_positions})
        assert cfg.rope_context == cfg.context_limit == context


def test_a_sliding_window_still_bounds_a_scaled_context():
    raw = {**BASE, "rope_parameters": COMPLETE["linear"], "sliding_window": 100}
    cfg = ModelConfig.from_dict(raw)
    assert (cfg.rope_context, cfg.context_limit) == (128, 100)


@pytest.mark.parametrize("nested", [None, 32, 16])
def test_llama3_takes_a_top_level_original_max_position_embeddings_first_as_transformers(nested):
    """transformers' standardize_rope_params gives a top-level value priority for llama3 (Phi3-style
    configs); the server used only the rope dict's and computed other frequencies (an outside
    tester's checkpoint: logprobs 6.6 apart from transformers)."""
    rope = {k: v for k, v in COMPLETE["llama3"].items() if k != "original_max_position_embeddings"}
    if nested is not None:
        rope["original_max_position_embeddings"] = nested
    raw = {**BASE, "rope_parameters": rope, "original_max_position_embeddings": 16}
    assert ModelConfig.from_dict(raw).rope.original_max_position_embeddings == 16
    # transformers applies the top-level value when it computes the frequencies (the config it
    # builds may still show the rope dict's): they equal those of a rope dict saying 16.
    spelled_out = {**BASE, "rope_parameters": {**rope, "original_max_position_embeddings": 16}}
    compute = ROPE_INIT_FUNCTIONS["llama3"]
    assert torch.equal(compute(LlamaConfig(**raw), "cpu")[0], compute(LlamaConfig(**spelled_out), "cpu")[0])


def test_a_top_level_original_max_position_embeddings_is_refused_naming_it_when_unusable():
    raw = {**BASE, "rope_parameters": COMPLETE["llama3"], "original_max_position_embeddings": None}
    with pytest.raises(ModelConfigError, match=r"^config.json: original_max_position_embeddings must be a positive "):
        ModelConfig.from_dict(raw)


def test_a_top_level_original_max_position_embeddings_changes_nothing_for_dynamic():
    """Only llama3 (and the types refused here) read it in transformers; dynamic keeps max_position_embeddings."""
    raw = {**BASE, "rope_parameters": COMPLETE["dynamic"], "original_max_position_embeddings": 16}
    assert ModelConfig.from_dict(raw).rope.original_max_position_embeddings is None
