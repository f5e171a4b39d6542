"""A key config.json leaves out takes the value transformers' config class of its architecture gives it.

The table (lightllm/common/basemodel/architecture_defaults.py) is compared field by field with the
installed transformers, the reader with transformers' reading of the same config minus each key,
and checkpoints that lack a key are served as transformers serves them (or refused naming the default).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Callable, Dict

import pytest
import torch
from transformers import (AutoConfig, AutoModelForCausalLM, MistralConfig, MistralForCausalLM, PreTrainedConfig,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from lightllm.common.basemodel.architecture_defaults import (ARCHITECTURE_DEFAULTS, LLAMA_DEFAULTS,
                                                             ArchitectureDefaults, architecture_defaults)
from lightllm.common.basemodel.batch_generator import BatchGenerator
from lightllm.common.basemodel.model_config import ModelConfig, ModelConfigError
from lightllm.common.basemodel.weight_loader import CheckpointError
from lightllm.models.model_types import SUPPORTED_MODEL_TYPES
from lightllm.models.registry import load_model

# num_attention_heads and hidden_size that no default equals, so a derived value shows as derived.
PROBE_HEADS, PROBE_HIDDEN = 12, 120


def _theta(config: PreTrainedConfig) -> float:
    """The RoPE base of a default config: 5.x keeps it in rope_parameters, 4.x as rope_theta."""
    parameters = getattr(config, "rope_parameters", None) or {}
    return parameters.get("rope_theta", getattr(config, "rope_theta", None))


# Field of ArchitectureDefaults -> its value in transformers: read from the config class built with
# only PROBE_HEADS / PROBE_HIDDEN (a derived value then equals the table's None resolved the same way).
TRANSFORMERS_VALUE: Dict[str, Callable[[str], Any]] = {
    "max_position_embeddings": lambda t: _probe(t).max_position_embeddings,
    "num_key_value_heads": lambda t: _probe(t).num_key_value_heads,
    # Qwen2's config has no head_dim field; its model reads getattr(config, "head_dim", hidden // heads).
    "head_dim": lambda t: getattr(_probe(t), "head_dim", PROBE_HIDDEN // PROBE_HEADS),
    # Qwen2 / Qwen3 drop the window unless use_sliding_window; Llama has no window field.
    "sliding_window": lambda t: getattr(_probe(t, use_sliding_window=True), "sliding_window", None),
    "max_window_layers": lambda t: getattr(_probe(t), "max_window_layers", None),
    "use_sliding_window": lambda t: getattr(_probe(t), "use_sliding_window", False),
    "rms_norm_eps": lambda t: _probe(t).rms_norm_eps,
    "rope_theta": lambda t: _theta(_probe(t)),
    "hidden_act": lambda t: _probe(t).hidden_act,
    "tie_word_embeddings": lambda t: _probe(t).tie_word_embeddings,
    # Mistral and Qwen2 have no such field (no biases, or always q/k/v biases).
    "attention_bias": lambda t: getattr(_probe(t), "attention_bias", False),
}


def _probe(model_type: str, **extra: Any) -> PreTrainedConfig:
    config_class = type(AutoConfig.for_model(model_type))
    return config_class(num_attention_heads=PROBE_HEADS, hidden_size=PROBE_HIDDEN, **extra)


def _resolved(defaults: ArchitectureDefaults, name: str) -> Any:
    """The table's value with its None-means-derived fields resolved for the probe's shape."""
    value = getattr(defaults, name)
    if value is None and name == "num_key_value_heads":
        return PROBE_HEADS
    if value is None and name == "head_dim":
        return PROBE_HIDDEN // PROBE_HEADS
    return value


def test_the_table_covers_exactly_the_served_architectures_and_every_field_is_compared():
    assert set(ARCHITECTURE_DEFAULTS) == set(SUPPORTED_MODEL_TYPES)
    assert all(defaults.model_type == model_type for model_type, defaults in ARCHITECTURE_DEFAULTS.items())
    fields = {f.name for f in dataclasses.fields(ArchitectureDefaults)} - {"model_type"}
    assert set(TRANSFORMERS_VALUE) == fields


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
@pytest.mark.parametrize("name", sorted(TRANSFORMERS_VALUE))
def test_each_default_is_the_installed_transformers_default(model_type: str, name: str):
    """A transformers release that changes a default fails here, naming the architecture and key."""
    expected = TRANSFORMERS_VALUE[name](model_type)
    assert _resolved(ARCHITECTURE_DEFAULTS[model_type], name) == expected, (model_type, name)


def test_an_unserved_type_is_read_with_llama_s_defaults_and_then_refused():
    assert architecture_defaults("gpt2") is LLAMA_DEFAULTS


# A complete config whose every defaultable key differs from all four defaults; each case drops one.
# 30 layers with use_sliding_window and a window of 100, so a missing max_window_layers (28) slides.
COMPLETE = dict(hidden_size=256, num_hidden_layers=30, num_attention_heads=32, num_key_value_heads=4, head_dim=16,
                intermediate_size=96, vocab_size=211, max_position_embeddings=1000, rms_norm_eps=1e-5,
                rope_theta=5000.0, hidden_act="silu", tie_word_embeddings=True, attention_bias=True,
                sliding_window=100, max_window_layers=40, use_sliding_window=True)
# Keys the reader fills in when missing (hidden_act has one supported value, so no case shows it).
DROPPED = ["max_position_embeddings", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
           "tie_word_embeddings", "attention_bias", "sliding_window", "max_window_layers", "use_sliding_window"]


def _window(config: PreTrainedConfig, model_type: str) -> Any:
    """The window transformers attends with on some layer, None when no layer slides."""
    if model_type in ("qwen2", "qwen3"):
        return config.sliding_window if "sliding_attention" in config.layer_types else None
    return getattr(config, "sliding_window", None)


OURS_VS_TRANSFORMERS: Dict[str, Callable[[ModelConfig, PreTrainedConfig, str], tuple]] = {
    "max_position_embeddings": lambda ours, tf, _: (ours.max_position_embeddings, tf.max_position_embeddings),
    "num_key_value_heads": lambda ours, tf, _: (ours.num_key_value_heads, tf.num_key_value_heads),
    "head_dim": lambda ours, tf, _: (ours.head_dim, getattr(tf, "head_dim", tf.hidden_size // tf.num_attention_heads)),
    "rms_norm_eps": lambda ours, tf, _: (ours.rms_norm_eps, tf.rms_norm_eps),
    "rope_theta": lambda ours, tf, _: (ours.rope.theta, tf.rope_parameters["rope_theta"]),
    "tie_word_embeddings": lambda ours, tf, _: (ours.tie_word_embeddings, tf.tie_word_embeddings),
    "attention_bias": lambda ours, tf, _: (ours.attention_bias, getattr(tf, "attention_bias", False)),
    "sliding_window": lambda ours, tf, model_type: (ours.sliding_window, _window(tf, model_type)),
    "max_window_layers": lambda ours, tf, model_type: (ours.sliding_window, _window(tf, model_type)),
    "use_sliding_window": lambda ours, tf, model_type: (ours.sliding_window, _window(tf, model_type)),
}


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
@pytest.mark.parametrize("key", DROPPED)
def test_the_reader_gives_a_missing_key_transformers_value(model_type: str, key: str):
    raw = {k: v for k, v in {**COMPLETE, "model_type": model_type}.items() if k != key}
    ours = ModelConfig.from_dict(raw)
    theirs = AutoConfig.for_model(**raw)
    got, expected = OURS_VS_TRANSFORMERS[key](ours, theirs, model_type)
    assert got == expected, (model_type, key)


def test_a_config_without_context_or_kv_heads_gets_each_architecture_s_values():
    """Each architecture's max context and KV heads when config.json lacks both keys."""
    shape = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=32, intermediate_size=96, vocab_size=211)
    read = {model_type: ModelConfig.from_dict({**shape, "model_type": model_type})
            for model_type in SUPPORTED_MODEL_TYPES}
    assert {t: c.max_position_embeddings for t, c in read.items()} == {
        "llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768}
    assert {t: c.num_key_value_heads for t, c in read.items()} == {"llama": 32, "mistral": 8, "qwen2": 32, "qwen3": 32}
    # Mistral's default window bounds its context, as transformers' attention does.
    assert {t: c.context_limit for t, c in read.items()} == {"llama": 2048, "mistral": 4096, "qwen2": 32768,
                                                              "qwen3": 32768}
    # Qwen2 dynamic NTK without max_position_embeddings rescales past 32768, not past 2048.
    dynamic = ModelConfig.from_dict({**shape, "model_type": "qwen2", "rope_scaling": {"type": "dynamic", "factor": 2}})
    assert dynamic.max_position_embeddings == 32768 and dynamic.rope_context == 65536
    assert dynamic.defaulted == {"num_key_value_heads": "not in config.json; transformers' default for qwen2 is 32",
                                 "max_position_embeddings": "not in config.json; transformers' default for qwen2 is 32768"}


def test_a_defaulted_context_is_said_at_start(caplog):
    """A trimmed checkpoint's context went from 2048 to 32768 with the per-architecture defaults; the
    KV cache and shared memory are sized from it, so the start says where the number came from."""
    import types

    from lightllm.server.launch.checkpoint_reading import log_checkpoint_limits

    shape = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=32, intermediate_size=96, vocab_size=211)
    config = ModelConfig.from_dict({**shape, "model_type": "qwen2"})
    args = types.SimpleNamespace(max_req_total_len=None, disable_dynamic_prompt_cache=False)
    with caplog.at_level("WARNING", logger="lightllm.server.launch.checkpoint_reading"):
        log_checkpoint_limits(args, config, types.SimpleNamespace(max_req_total_len=32768))
    assert ("requests are limited to 32768 tokens (max_position_embeddings not in config.json; transformers' "
            "default for qwen2 is 32768)") in caplog.text
    caplog.clear()
    given = ModelConfig.from_dict({**shape, "model_type": "qwen2", "max_position_embeddings": 4096})
    with caplog.at_level("WARNING", logger="lightllm.server.launch.checkpoint_reading"):
        log_checkpoint_limits(args, given, types.SimpleNamespace(max_req_total_len=4096))
    assert "max_position_embeddings" not in caplog.text


def test_a_default_that_contradicts_the_heads_is_refused_naming_the_default():
    raw = dict(model_type="qwen2", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
               vocab_size=211)
    with pytest.raises(ModelConfigError, match=re.escape(
            "num_attention_heads=4 is not a multiple of num_key_value_heads=32 "
            "(not in config.json; transformers' default for qwen2 is 32)")):
        ModelConfig.from_dict(raw)
    # Present, the same values are refused without the note.
    with pytest.raises(ModelConfigError, match=r"num_key_value_heads=3$"):
        ModelConfig.from_dict({**raw, "num_key_value_heads": 3})


def _save(model: torch.nn.Module, model_dir: Path, drop: str) -> Path:
    """Save ``model`` with random weights, then remove ``drop`` from its config.json."""
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            torch.nn.init.normal_(param, std=0.15)
        for layer in model.model.layers:  # sharp attention, so a rotation off by a base change shows
            layer.self_attn.q_proj.weight.mul_(6.0)
            layer.self_attn.k_proj.weight.mul_(6.0)
    model.save_pretrained(model_dir)
    config_path = model_dir / "config.json"
    raw = json.loads(config_path.read_text())
    raw.pop(drop, None)
    config_path.write_text(json.dumps(raw))
    return model_dir


def _logits_match_transformers(model_dir: Path, prompt: list, tolerance: float) -> None:
    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    ours = load_model(str(model_dir), dtype=torch.float32)
    gen = BatchGenerator(ours, len(prompt) + 16, max_sequence_length=len(prompt) + 16)
    got = gen.forward([gen.start(prompt)], [len(prompt)], all_logits=True)
    assert (got - expected).abs().max().item() < tolerance


SMALL = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=96, vocab_size=211)


def test_a_mistral_checkpoint_without_num_key_value_heads_loads_with_transformers_default_of_8(tmp_path):
    config = MistralConfig(**SMALL, num_attention_heads=16, num_key_value_heads=8, head_dim=16, sliding_window=None)
    model_dir = _save(MistralForCausalLM(config), tmp_path / "mistral", drop="num_key_value_heads")
    assert ModelConfig.from_dir(model_dir).num_key_value_heads == 8
    _logits_match_transformers(model_dir, [(i * 37) % 200 + 3 for i in range(23)], 1e-4)


def test_a_shape_that_contradicts_a_default_is_refused_naming_the_default(tmp_path):
    config = MistralConfig(**SMALL, num_attention_heads=16, num_key_value_heads=4, head_dim=16, sliding_window=None)
    model_dir = _save(MistralForCausalLM(config), tmp_path / "mistral_kv4", drop="num_key_value_heads")
    with pytest.raises(CheckpointError, match=re.escape(
            "(num_key_value_heads (not in config.json; transformers' default for mistral is 8) x head_dim, "
            "hidden_size)")):
        load_model(str(model_dir), dtype=torch.float32)
    config = Qwen3Config(**SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=24)
    model_dir = _save(Qwen3ForCausalLM(config), tmp_path / "qwen3_head_dim", drop="head_dim")
    with pytest.raises(CheckpointError, match=re.escape(
            "(num_attention_heads x head_dim (not in config.json; transformers' default for qwen3 is 128), "
            "hidden_size)")):
        load_model(str(model_dir), dtype=torch.float32)


def test_qwen2_dynamic_ntk_without_max_position_embeddings_matches_transformers_past_2048_tokens(tmp_path):
    """Rescaled from token 2049 on before the per-architecture defaults, only past 32768 in transformers."""
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    config = Qwen2Config(**SMALL, num_attention_heads=4, num_key_value_heads=2, rope_parameters=rope)
    model_dir = _save(Qwen2ForCausalLM(config), tmp_path / "qwen2_dynamic", drop="max_position_embeddings")
    assert "max_position_embeddings" not in json.loads((model_dir / "config.json").read_text())
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 200, (2100,), generator=generator).tolist()
    _logits_match_transformers(model_dir, prompt, 1e-4)
