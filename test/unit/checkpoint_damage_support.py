"""Copies of a tiny checkpoint with the damage downloads and conversions leave: split into indexed
shards, a truncated or emptied weight file, an index sending a tensor to the wrong shard, no tokenizer."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

from safetensors.torch import load_file, save_file

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def copy_checkpoint(source: Path, destination: Path) -> Path:
    """A writable copy of the read-only fixture checkpoint ``source``."""
    shutil.copytree(source, destination)
    return destination


def shard_in_two(model_dir: Path) -> List[str]:
    """Split ``model_dir``'s ``model.safetensors`` into two shards with an index; the tensor names, sorted."""
    tensors = load_file(str(model_dir / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    weight_map: Dict[str, str] = {}
    for shard, chosen in zip(SHARDS, (names[:half], names[half:])):
        save_file({name: tensors[name] for name in chosen}, str(model_dir / shard), metadata={"format": "pt"})
        weight_map.update({name: shard for name in chosen})
    (model_dir / "model.safetensors").unlink()
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return names


def misassign_first_tensor(model_dir: Path) -> str:
    """Point the index's first tensor (by name) at the other shard; the tensor's name."""
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = sorted(index["weight_map"])[0]
    index["weight_map"][name] = next(shard for shard in SHARDS if shard != index["weight_map"][name])
    index_path.write_text(json.dumps(index))
    return name


def truncate(path: Path, missing: int) -> None:
    """Cut the last ``missing`` bytes off ``path`` (``truncate -s -N``, an interrupted download)."""
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size - missing)


def remove_tokenizer(model_dir: Path) -> None:
    """Delete the checkpoint's tokenizer files."""
    for name in TOKENIZER_FILES:
        (model_dir / name).unlink(missing_ok=True)


def launcher_refusal(model_dir: Path, *flags: str) -> str:
    """The launcher's one error line for ``model_dir`` (asserting exit code 2, that line alone, nothing started)."""
    done = subprocess.run([sys.executable, "-m", "lightllm.server.api_server", "--model_dir", str(model_dir),
                           "--port", "18646", *flags], capture_output=True, text=True, timeout=120)
    lines = [line for line in done.stderr.splitlines() if " INFO " not in line]
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert "starting: model=" not in done.stderr and "Traceback" not in done.stderr
    return lines[0]
