"""Loading tensors from a local Hugging Face safetensors checkpoint, optionally sharded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional

import torch
from safetensors import safe_open


class CheckpointError(ValueError):
    """The checkpoint directory lacks a tensor or its files are inconsistent."""


class SafetensorsCheckpoint:
    """Index of tensor name -> file for one checkpoint directory.

    Reads ``model.safetensors.index.json`` when present, else scans every ``*.safetensors``
    file.  Tensors are read lazily and only the requested slice is materialised, so a rank of
    a tensor-parallel group never loads the other ranks' shards.
    """

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self._name_to_file: Dict[str, Path] = {}
        index_path = self.model_dir / "model.safetensors.index.json"
        if index_path.is_file():
            weight_map = json.loads(index_path.read_text()).get("weight_map", {})
            for name, file_name in weight_map.items():
                self._name_to_file[name] = self.model_dir / file_name
        else:
            files: List[Path] = sorted(self.model_dir.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"no *.safetensors files in {self.model_dir}")
            for path in files:
                with safe_open(str(path), framework="pt") as handle:
                    for name in handle.keys():
                        self._name_to_file[name] = path
        self._handles: Dict[Path, object] = {}
        self._read: set[str] = set()

    def has(self, name: str) -> bool:
        """Whether the checkpoint holds tensor ``name``."""
        return name in self._name_to_file

    def _handle(self, path: Path):
        if path not in self._handles:
            if not path.is_file():
                raise CheckpointError(f"checkpoint file {path} named in the index is missing")
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path]

    def get(
        self,
        name: str,
        dtype: torch.dtype,
        shard_dim: Optional[int] = None,
        shard: Optional[slice] = None,
    ) -> torch.Tensor:
        """Tensor ``name`` in ``dtype``; with ``shard_dim`` only ``shard`` along that dimension."""
        if name not in self._name_to_file:
            raise CheckpointError(f"checkpoint {self.model_dir} has no tensor {name!r}")
        handle = self._handle(self._name_to_file[name])
        self._read.add(name)
        if shard_dim is None:
            tensor = handle.get_tensor(name)
        else:
            view = handle.get_slice(name)
            index = [slice(None)] * len(view.get_shape())
            index[shard_dim] = shard
            tensor = view[tuple(index)]
        return tensor.to(dtype).contiguous()

    def unread(self) -> List[str]:
        """Names of the tensors no :meth:`get` has read, sorted."""
        return sorted(set(self._name_to_file) - self._read)

    def close(self) -> None:
        """Drop open file handles."""
        self._handles.clear()
