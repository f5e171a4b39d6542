"""The dtype a start serves in: an explicit ``--data_type`` always wins over config.json; ``auto``
takes config.json's dtype, else the weights' (safetensors headers), keeps the CPU rule (float16 in
float32), serves a float64 config in float32 with a warning naming the key, and refuses a dtype it
cannot serve in one line naming config.json, the key, the value and ``--data_type``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoint_damage_support import launcher_refusal
from lightllm.common.basemodel.model_config import ModelConfig, ModelConfigError
from lightllm.server.launch.arg_parser import make_argument_parser
from lightllm.server.launch.sizing import plan_sizing


def _checkpoint(tiny_llama_dir: Path, tmp_path: Path, name: str, weights: Optional[torch.dtype] = None,
                **dtype_keys: object) -> Path:
    """A copy of the tiny checkpoint with its weights stored in ``weights`` and config.json's dtype
    keys replaced by ``dtype_keys`` (none: the keys removed)."""
    model_dir = tmp_path / name
    shutil.copytree(tiny_llama_dir, model_dir)
    if weights is not None:
        path = model_dir / "model.safetensors"
        save_file({key: t.to(weights) for key, t in load_file(path).items()}, str(path), metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    config.update(dtype_keys)
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


def _dtype(model_dir: Path, *flags: str, device: str = "cpu") -> str:
    args = make_argument_parser().parse_args(["--model_dir", str(model_dir), "--max_total_token_num", "4096", *flags])
    return plan_sizing(args, ModelConfig.from_dir(model_dir), device).dtype_name


def test_auto_takes_the_weights_dtype_when_config_json_names_none(tiny_llama_dir, tmp_path, caplog):
    # A bf16 checkpoint without a dtype in config.json was served in float32.
    bf16 = _checkpoint(tiny_llama_dir, tmp_path, "bf16", torch.bfloat16)
    with caplog.at_level("INFO", logger="lightllm.sizing"):
        assert _dtype(bf16) == "bfloat16"
    assert "--data_type auto takes bfloat16 from the weights' dtype (safetensors headers; config.json names none)" in caplog.text
    fp16 = _checkpoint(tiny_llama_dir, tmp_path, "fp16", torch.float16)
    assert _dtype(fp16) == "float32"  # the CPU rule, as for a config.json naming float16
    assert _dtype(fp16, device="cuda") == "float16"
    assert _dtype(fp16, "--data_type", "bf16") == "bfloat16"


def test_a_float64_config_is_served_in_float32_with_a_warning_and_an_explicit_flag_wins(tiny_llama_dir, tmp_path,
                                                                                      caplog):
    # Both were refused: "unsupported dtype 'float64'; expected one of [...]", naming no file.
    model_dir = _checkpoint(tiny_llama_dir, tmp_path, "f64", torch_dtype="float64")
    with caplog.at_level("WARNING", logger="lightllm.sizing"):
        assert _dtype(model_dir) == "float32"
    assert ("config.json's torch_dtype is 'float64', which this server does not run: --data_type auto serves it in "
            "float32") in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="lightllm.sizing"):
        assert _dtype(model_dir, "--data_type", "float32") == "float32"
        assert _dtype(model_dir, "--data_type", "bfloat16") == "bfloat16"
    assert not caplog.records


def test_a_config_dtype_that_cannot_be_served_needs_the_flag(tiny_llama_dir, tmp_path):
    model_dir = _checkpoint(tiny_llama_dir, tmp_path, "int8", dtype="int8")
    with pytest.raises(ModelConfigError, match="config.json's dtype is 'int8'"):
        _dtype(model_dir)
    assert _dtype(model_dir, "--data_type", "float32") == "float32"
    assert launcher_refusal(model_dir) == (
        "error: config.json's dtype is 'int8', a dtype this server cannot serve (it runs float32, bfloat16 and "
        "float16): give --data_type float32, bfloat16 or float16")
