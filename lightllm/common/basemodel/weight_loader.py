"""Loading tensors from a local Hugging Face safetensors checkpoint, optionally sharded."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
from safetensors import SafetensorError, safe_open

from lightllm.common.basemodel.checkpoint_files import INDEX_FILE, SINGLE_FILE, CheckpointFilesError, read_weight_map
from lightllm.common.basemodel.safetensors_header import FLOAT_DTYPE_NAMES
from lightllm.common.basemodel.weight_headers import read_weight_headers


class CheckpointError(CheckpointFilesError):
    """The checkpoint directory lacks a tensor, holds one of the wrong shape, or its files are inconsistent."""


# safetensors' names of the float dtypes a weight may be stored in (the launcher's planning reads the same).
_FLOAT_DTYPES = frozenset(FLOAT_DTYPE_NAMES)


class SafetensorsCheckpoint:
    """Index of tensor name -> file for one checkpoint directory.

    The files are the ones transformers reads (:mod:`checkpoint_files`): the index's, else
    ``model.safetensors``, else every ``*.safetensors`` file (a tensor in two of them is
    refused).  Tensors are read lazily and only the requested slice is materialised, so a rank
    of a tensor-parallel group never loads the other ranks' shards.
    """

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self._name_to_file: Dict[str, Path] = {}
        # The launcher's checks first (it ran them too): a shard the index names but the
        # directory lacks, a truncated file or an index sending a tensor to the wrong shard is
        # refused now, naming the file, not when its first tensor is read.
        headers = read_weight_headers(self.model_dir)
        weight_map = read_weight_map(self.model_dir)
        if weight_map is not None:
            for name, file_name in weight_map.items():
                self._name_to_file[name] = self.model_dir / file_name
        else:
            for path, header in headers.items():
                for name in header.tensors:
                    other = self._name_to_file.setdefault(name, path)
                    if other != path:
                        raise CheckpointError(
                            f"tensor {name!r} is in both {other.name} and {path.name} in {self.model_dir}, "
                            f"which has neither {INDEX_FILE} nor {SINGLE_FILE} to say which is the model's"
                        )
        self._handles: Dict[Path, object] = {}
        self._read: set[str] = set()

    def has(self, name: str) -> bool:
        """Whether the checkpoint holds tensor ``name``."""
        return name in self._name_to_file

    def _handle(self, path: Path):
        if path not in self._handles:
            if not path.is_file():
                raise CheckpointError(f"checkpoint file {path} named in the index is missing")
            try:
                self._handles[path] = safe_open(str(path), framework="pt")
            except SafetensorError as exc:
                # safetensors' message names no file (the header checks above should have caught it).
                raise CheckpointError(f"checkpoint file {path}: {exc}") from exc
        return self._handles[path]

    def get(
        self,
        name: str,
        dtype: torch.dtype,
        shard_dim: Optional[int] = None,
        shard: Optional[slice] = None,
        shape: Optional[Sequence[int]] = None,
        shape_source: str = "",
    ) -> torch.Tensor:
        """Tensor ``name`` in ``dtype``; with ``shard_dim`` only ``shard`` along that dimension.

        ``shape``: the whole tensor's shape the config implies (``shape_source`` says from which
        fields); a tensor of another shape is refused, as transformers refuses it, rather than
        sliced into a model that computes something else.
        """
        if name not in self._name_to_file:
            raise CheckpointError(f"checkpoint {self.model_dir} has no tensor {name!r}")
        path = self._name_to_file[name]
        try:
            return self._read_tensor(path, name, dtype, shard_dim, shard, shape, shape_source)
        except SafetensorError as exc:
            raise CheckpointError(f"checkpoint file {path}: reading tensor {name!r}: {exc}") from exc

    def _read_tensor(
        self,
        path: Path,
        name: str,
        dtype: torch.dtype,
        shard_dim: Optional[int],
        shard: Optional[slice],
        shape: Optional[Sequence[int]],
        shape_source: str,
    ) -> torch.Tensor:
        """:meth:`get` for a tensor of ``path`` (safetensors' own errors pass through)."""
        handle = self._handle(path)
        view = handle.get_slice(name)
        stored_dtype = view.get_dtype()
        if stored_dtype not in _FLOAT_DTYPES:
            # An FP8 or integer weight would be cast to the serving dtype as if it held the values.
            raise CheckpointError(f"checkpoint {self.model_dir}: tensor {name!r} is stored as {stored_dtype}: quantized "
                                  "or integer weights are not supported (float32, float16 or bfloat16 only)")
        stored = tuple(view.get_shape())
        if shape is not None and stored != tuple(shape):
            raise CheckpointError(
                f"checkpoint {self.model_dir}: tensor {name!r} has shape {list(stored)}, but config.json implies "
                f"{list(shape)}" + (f" ({shape_source})" if shape_source else "")
            )
        self._read.add(name)
        if shard_dim is None:
            tensor = handle.get_tensor(name)
        else:
            index = [slice(None)] * len(stored)
            index[shard_dim] = shard
            tensor = view[tuple(index)]
        return tensor.to(dtype).contiguous()

    def unread(self) -> List[str]:
        """Names of the tensors no :meth:`get` has read, sorted."""
        return sorted(set(self._name_to_file) - self._read)

    def close(self) -> None:
        """Drop open file handles."""
        self._handles.clear()
