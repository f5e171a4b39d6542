"""``python -m lightllm.server.pd.kv_transfer.bench`` refuses bad flags in the project's one-line
style (``error: ...``, exit 2), as every other tool does; it printed argparse's usage block, the
error under the prog name ``bench.py``, and a traceback for a config.json without the KV shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lightllm.server.pd.kv_transfer import bench


# The smallest config.json the server reads (two heads of 4 sharing one KV head).
_LLAMA = {"model_type": "llama", "vocab_size": 4, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
          "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}


def _refusal(argv, capsys) -> str:
    with pytest.raises(SystemExit) as refused:
        bench.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert refused.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def _checkpoint(tmp_path: Path, config: object) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config) if not isinstance(config, str) else config)
    return str(tmp_path)


def test_a_directory_without_config_json_is_one_line(tmp_path, capsys):
    assert f"--model_dir {tmp_path} has no config.json" in _refusal(["--model_dir", str(tmp_path)], capsys)


@pytest.mark.parametrize("config, message", [
    ({"num_attention_heads": 2}, "no KV geometry (config.json lacks required key 'hidden_size')"),
    ({**_LLAMA, "torch_dtype": "Tensor"}, "give --data_type float32, bfloat16 or float16"),
    ("not json", "config.json is not valid JSON"),
])
def test_a_config_without_the_kv_geometry_is_one_line(config, message, tmp_path, capsys):
    assert message in _refusal(["--model_dir", _checkpoint(tmp_path, config)], capsys)


@pytest.mark.parametrize("config_dtype, weights_dtype, moved", [
    (None, torch.bfloat16, torch.bfloat16),  # config.json names none: the weights' (it read float32)
    ("float16", torch.float16, torch.float32),  # as a CPU server serves it under --data_type auto
    ("bfloat16", torch.float32, torch.bfloat16),  # config.json's wins over the weights'
])
def test_the_kv_dtype_is_the_one_a_cpu_server_keeps(config_dtype, weights_dtype, moved, tmp_path):
    config = _LLAMA if config_dtype is None else {**_LLAMA, "torch_dtype": config_dtype}
    model_dir = _checkpoint(tmp_path, config)
    save_file({"lm_head.weight": torch.zeros(4, 8, dtype=weights_dtype)}, str(tmp_path / "model.safetensors"))
    geometry = bench._geometry(Path(model_dir))
    assert geometry == {"num_layers": 1, "kv_heads": 1, "head_dim": 4, "dtype": moved}
    assert bench._geometry(Path(model_dir), "fp16")["dtype"] == torch.float16  # an explicit one wins


def test_an_explicit_data_type_serves_a_config_whose_dtype_auto_cannot(tmp_path):
    model_dir = _checkpoint(tmp_path, {**_LLAMA, "torch_dtype": "int8"})
    assert bench._geometry(Path(model_dir), "bfloat16")["dtype"] == torch.bfloat16


@pytest.mark.parametrize("extra, message", [
    (["--tokens", "0"], "--tokens, --repeat and --page_sizes must be positive"),
    (["--page_sizes", "64", "64"], "--page_sizes names a page size twice"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--tokens", "8", "--tokens", "16"], "--tokens is given twice; give it once"),
])
def test_bad_flags_are_one_line(extra, message, tmp_path, capsys):
    model_dir = _checkpoint(tmp_path, _LLAMA)
    assert message in _refusal(["--model_dir", model_dir, *extra], capsys)


def test_the_module_names_itself_as_it_is_run(tmp_path):
    result = subprocess.run([sys.executable, "-m", "lightllm.server.pd.kv_transfer.bench", "--model_dir",
                             str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: --model_dir {tmp_path} has no config.json (--help lists the flags)"]
    help_text = subprocess.run([sys.executable, "-m", "lightllm.server.pd.kv_transfer.bench", "--help"],
                               capture_output=True, text=True, timeout=120).stdout
    assert help_text.startswith("usage: python -m lightllm.server.pd.kv_transfer.bench")
