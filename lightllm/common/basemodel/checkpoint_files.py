"""Which ``*.safetensors`` files of a checkpoint directory hold its weights, read without torch.

The same files as transformers reads, so that a directory with other files beside the model's
(Mistral's ``consolidated.safetensors`` next to ``model.safetensors``, an adapter, a leftover
shard) loads the model transformers loads:

1. ``model.safetensors.index.json``: the files its ``weight_map`` names;
2. else ``model.safetensors``: that file alone;
3. else every ``*.safetensors`` file in the directory (a single differently named file, or
   shards without an index, which transformers does not load); a tensor found in two of them
   is refused, since either copy could be the one meant.

The weight loader, the KV budget (the weights' size), the PD checkpoint fingerprint and the
launcher's start-up check all use this, so they agree on what the model is, and a directory
without those files (PyTorch ``*.bin`` weights only, a shard the index names but that is
missing) is refused before any process starts.  Only file names are read here, never tensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointFilesError(ValueError):
    """The checkpoint directory has no weights, or its files contradict each other."""


def read_weight_map(model_dir: str | Path) -> Dict[str, str] | None:
    """The index's tensor name -> file name map, or None when the directory has no index."""
    index_path = Path(model_dir) / INDEX_FILE
    if not index_path.is_file():
        return None
    try:
        weight_map = json.loads(index_path.read_text()).get("weight_map")
    except (ValueError, AttributeError) as exc:
        raise CheckpointFilesError(f"{index_path} is not a safetensors index ({exc})") from None
    except RecursionError:
        raise CheckpointFilesError(f"{index_path} is not a safetensors index (JSON nested too deep to read)") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointFilesError(f"{index_path} has no weight_map of tensor names to file names")
    return weight_map


# Weight files of other formats, named when a directory has no safetensors (transformers would
# load these; this server reads safetensors only).
OTHER_WEIGHT_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.msgpack", "*.h5")
# How many missing or foreign files an error names before it counts the rest.
_NAMED_FILES = 3


def _names(paths: List[Path]) -> str:
    """The first few file names, then how many more."""
    names = [p.name for p in paths[:_NAMED_FILES]]
    if len(paths) > _NAMED_FILES:
        names.append(f"{len(paths) - _NAMED_FILES} more")
    return ", ".join(names)


def weight_files(model_dir: str | Path) -> List[Path]:
    """The files holding the model's tensors, sorted (see the module docstring for the rule).

    Raises :class:`CheckpointFilesError` when there are none, or when the index names a file
    the directory lacks (every reader would fail on it, some only after the server started).
    """
    directory = Path(model_dir)
    weight_map = read_weight_map(directory)
    if weight_map is not None:
        files = sorted({directory / name for name in weight_map.values()})
        if not files:
            raise CheckpointFilesError(f"{directory / INDEX_FILE} names no weight files (its weight_map is empty)")
        missing = [path for path in files if not path.is_file()]
        if missing:
            raise CheckpointFilesError(
                f"{directory / INDEX_FILE} names {len(missing)} file(s) missing from {directory}: {_names(missing)}"
            )
        return files
    single = directory / SINGLE_FILE
    if single.is_file():
        return [single]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        others = sorted(path for pattern in OTHER_WEIGHT_PATTERNS for path in directory.glob(pattern))
        if others:
            raise CheckpointFilesError(
                f"no *.safetensors files in {directory}: only safetensors checkpoints are supported, and it holds "
                f"{_names(others)} (convert the weights to safetensors)"
            )
        raise CheckpointFilesError(f"no *.safetensors files in {directory}")
    return files
