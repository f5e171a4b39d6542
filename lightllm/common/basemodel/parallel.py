"""Tensor-parallel group and the weight-slicing rules of column/row parallel layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass
class TensorParallelGroup:
    """This rank's place in the tensor-parallel group.

    With ``world_size == 1`` every collective is a no-op, so single-process code paths need no
    initialised process group.
    """

    rank: int = 0
    world_size: int = 1
    group: Optional[Any] = None

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks in place (row-parallel layer outputs)."""
        if self.world_size > 1:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate each rank's ``tensor`` along the last dimension (vocab-parallel logits)."""
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def shard_range(total: int, rank: int, world_size: int, what: str) -> slice:
    """The slice of ``total`` items that ``rank`` holds; ``total`` must divide evenly."""
    if total % world_size != 0:
        raise ValueError(f"{what}={total} is not divisible by tensor-parallel size {world_size}")
    size = total // world_size
    return slice(rank * size, (rank + 1) * size)
