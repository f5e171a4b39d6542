"""``python -m lightllm.server.pd.kv_transfer.bench`` refuses bad flags in the project's one-line
style (``error: ...``, exit 2), as every other tool does; it printed argparse's usage block, the
error under the prog name ``bench.py``, and a traceback for a config.json without the KV shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightllm.server.pd.kv_transfer import bench


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
    ({"num_attention_heads": 2}, "config.json gives no KV geometry (no 'num_hidden_layers' key)"),
    ({"num_attention_heads": 2, "num_hidden_layers": 1, "hidden_size": 8, "torch_dtype": "Tensor"},
     "dtype 'Tensor' is not a torch dtype"),
    ("not json", "config.json gives no KV geometry"),
])
def test_a_config_without_the_kv_geometry_is_one_line(config, message, tmp_path, capsys):
    assert message in _refusal(["--model_dir", _checkpoint(tmp_path, config)], capsys)


@pytest.mark.parametrize("extra, message", [
    (["--tokens", "0"], "--tokens, --repeat and --page_sizes must be positive"),
    (["--page_sizes", "64", "64"], "--page_sizes names a page size twice"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--tokens", "8", "--tokens", "16"], "--tokens is given twice; give it once"),
])
def test_bad_flags_are_one_line(extra, message, tmp_path, capsys):
    model_dir = _checkpoint(tmp_path, {"num_attention_heads": 2, "num_hidden_layers": 1, "hidden_size": 8})
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
