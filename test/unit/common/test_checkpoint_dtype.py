"""The dtype ``--data_type auto`` takes from a checkpoint, compared with transformers' ``dtype="auto"``:
config.json's ``dtype`` (else ``torch_dtype``), else the weights' from their safetensors headers (a
sharded checkpoint through its index), and config.json dtypes this server does not run (float64
served in float32 with a note; anything else refused in one line naming the key and --data_type)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from lightllm.common.basemodel.model_config import ModelConfig, ModelConfigError
from lightllm.common.basemodel.checkpoint_files import CheckpointFilesError, read_weight_map
from lightllm.common.basemodel.safetensors_header import read_safetensors_header
from lightllm.models.registry import load_model

BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
            vocab_size=211, max_position_embeddings=64)


def _save(tmp_path: Path, name: str, weights: torch.dtype, config_dtype: Optional[str] = None,
          max_shard_size: Optional[str] = None) -> Path:
    """A random Llama saved by transformers in ``weights``; config.json's dtype keys replaced by
    ``config_dtype`` (both keys, as transformers 5 writes them) or removed when it is None."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**BASE)).to(weights)
    out = tmp_path / name
    model.save_pretrained(out, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    config = json.loads((out / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    if config_dtype is not None:
        config.update(dtype=config_dtype, torch_dtype=config_dtype)
    (out / "config.json").write_text(json.dumps(config))
    return out


def _transformers_auto_dtype(model_dir: Path) -> str:
    return str(AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").dtype).replace("torch.", "")


@pytest.mark.parametrize("weights", [torch.bfloat16, torch.float16, torch.float32])
def test_without_a_config_dtype_the_weights_dtype_is_taken_as_transformers_takes_it(tmp_path, weights):
    # It was float32 whatever the weights were: a bf16 checkpoint was served at twice its memory.
    model_dir = _save(tmp_path, "no_dtype", weights)
    config = ModelConfig.from_dir(model_dir)
    assert config.dtype == _transformers_auto_dtype(model_dir) == str(weights).replace("torch.", "")
    assert "safetensors headers" in config.dtype_source and config.dtype_note is None
    assert load_model(str(model_dir)).dtype == weights


def test_a_sharded_checkpoint_is_read_through_its_index(tmp_path):
    model_dir = _save(tmp_path, "sharded", torch.bfloat16, max_shard_size="20KB")
    assert len(list(model_dir.glob("*.safetensors"))) > 1 and (model_dir / "model.safetensors.index.json").is_file()
    assert ModelConfig.from_dir(model_dir).dtype == _transformers_auto_dtype(model_dir) == "bfloat16"


def test_weights_of_two_half_dtypes_are_served_in_the_one_holding_both(tmp_path):
    # vLLM's rule (common_broadcastable_dtype): neither 16-bit dtype holds the other, float32 holds both.
    model_dir = _save(tmp_path, "mixed", torch.bfloat16)
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.float16)
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    config = ModelConfig.from_dir(model_dir)
    assert config.dtype == "float32" and "bfloat16, float16" in config.dtype_source


def test_a_config_dtype_still_wins_over_the_weights(tmp_path):
    model_dir = _save(tmp_path, "config_says", torch.bfloat16, config_dtype="float32")
    config = ModelConfig.from_dir(model_dir)
    assert config.dtype == _transformers_auto_dtype(model_dir) == "float32"
    assert config.dtype_source == "config.json's dtype"
    # Without weights to read (a PD master's directory), transformers' float32 default.
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(_save(tmp_path, "bf16", torch.bfloat16) / "config.json", no_weights / "config.json")
    assert ModelConfig.from_dir(no_weights).dtype == "float32"


def test_a_float64_config_is_served_in_float32_with_a_note_naming_the_key(tmp_path):
    # It was refused ("unsupported dtype 'float64'"), naming neither config.json nor a way out.
    model_dir = _save(tmp_path, "f64", torch.float32, config_dtype="float64")
    config = ModelConfig.from_dir(model_dir)
    assert config.dtype == "float32"
    assert config.dtype_note.startswith("config.json's dtype is 'float64'") and "--data_type" in config.dtype_note
    loaded = load_model(str(model_dir))
    assert loaded.dtype == torch.float32


@pytest.mark.parametrize("value", ["int8", "bogus", "float8_e4m3fn", 16])
def test_a_config_dtype_that_cannot_be_served_is_refused_only_when_auto_asks(tmp_path, value):
    model_dir = _save(tmp_path, "bad", torch.float32)
    config = json.loads((model_dir / "config.json").read_text())
    config["torch_dtype"] = value
    (model_dir / "config.json").write_text(json.dumps(config))
    config = ModelConfig.from_dir(model_dir)  # reading it is no refusal: --data_type may choose
    with pytest.raises(ModelConfigError) as caught:
        config.dtype
    message = str(caught.value)
    assert message.startswith(f"config.json's torch_dtype is {value!r}") and "--data_type" in message
    assert "\n" not in message
    with pytest.raises(ModelConfigError, match="config.json's torch_dtype"):
        load_model(str(model_dir))
    assert load_model(str(model_dir), dtype=torch.bfloat16).dtype == torch.bfloat16


def test_a_composite_config_takes_the_root_dtype(tmp_path):
    model_dir = _save(tmp_path, "composite", torch.float32)
    text = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({"model_type": "llava", "dtype": "bfloat16",
                                                       "text_config": text}))
    assert ModelConfig.from_dir(model_dir).dtype == "bfloat16"
    # A root torch_dtype wins over text_config's dtype too (dtype is read before torch_dtype, so
    # merging both kept text_config's), as transformers' AutoConfig and vLLM read the root.
    text["dtype"] = "bfloat16"
    (model_dir / "config.json").write_text(json.dumps({"model_type": "llava", "torch_dtype": "float32",
                                                       "text_config": text}))
    assert ModelConfig.from_dir(model_dir).dtype == "float32"


def test_integer_weights_are_refused_whatever_data_type_says(tmp_path):
    model_dir = _save(tmp_path, "int8", torch.float32)
    save_file({name: tensor.to(torch.int8) for name, tensor in load_file(model_dir / "model.safetensors").items()},
              model_dir / "model.safetensors")
    problem = ModelConfig.from_dir(model_dir).dtype_problem
    # It advised a --data_type, which then failed in the model rank on the first int8 tensor.
    assert "integer or quantized weights are not supported, whatever --data_type says" in problem


def test_a_header_nested_too_deep_is_a_one_line_refusal(tmp_path):
    model_dir = _save(tmp_path, "deep", torch.float32)
    header = b"[" * 200000 + b"]" * 200000
    (model_dir / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    # json.loads raised RecursionError, a traceback out of ModelConfig.from_dir.  Now the file is
    # unreadable as any bad header is: the config takes no dtype from it, and the launcher's weight
    # check refuses the file in one line naming it.
    assert ModelConfig.from_dir(model_dir).dtype == "float32"
    with pytest.raises(CheckpointFilesError, match="nested too deep to read") as refused:
        read_safetensors_header(model_dir / "model.safetensors")
    assert "\n" not in str(refused.value) and "model.safetensors" in str(refused.value)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json", "generation_config.json"])
def test_json_files_nested_too_deep_are_one_line_refusals(tmp_path, name):
    model_dir = _save(tmp_path, "deep_json", torch.float32)
    (model_dir / name).write_text("[" * 200000 + "]" * 200000)
    # A RecursionError traceback before: only the header reader caught it.
    with pytest.raises(ValueError, match="nested too deep") as refused:
        ModelConfig.from_dir(model_dir)
        read_weight_map(model_dir)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("raw", [[1, 2], {"text_config": None, "model_type": "llava"}])
def test_a_config_that_is_not_an_object_where_one_is_needed_is_refused(tmp_path, raw):
    model_dir = _save(tmp_path, "shape", torch.float32)
    (model_dir / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelConfigError, match="must (hold|be) a JSON object"):
        ModelConfig.from_dir(model_dir)
