"""Rotary position embeddings (RoPE) with the scaling variants Llama-family checkpoints use."""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch

from lightllm.common.basemodel.model_config import RopeConfig


class RotaryEmbedding:
    """Computes cos/sin tables and applies the half-rotation form used by Llama and Qwen2.

    The table for positions below ``max_position_embeddings`` is built once.  Dynamic NTK
    scaling changes the base with the sequence length, token by token: a token rotates with the
    base of the length its request had when transformers (with a KV cache) computed it, the
    prompt's length for a prompt token and its own position + 1 for a generated one.  So a
    request prefilled again with the tokens it generated (after a pause for KV memory, or as a PD
    continuation) gets exactly the keys it had.
    """

    def __init__(self, rope: RopeConfig, head_dim: int, max_position_embeddings: int, device: torch.device):
        self.rope = rope
        self.rot_dim = int(head_dim * rope.partial_rotary_factor)
        self.max_position_embeddings = max_position_embeddings
        # llama3 scales relative to the pretraining context; dynamic NTK from
        # max_position_embeddings, ignoring original_max_position_embeddings (as transformers does).
        self.original_max = (int(rope.original_max_position_embeddings or max_position_embeddings)
                             if rope.rope_type == "llama3" else max_position_embeddings)
        self.device = device
        self._cos, self._sin = self._table(self._inv_freq(self.original_max), max_position_embeddings)

    def _base_inv_freq(self, base: float) -> torch.Tensor:
        exponents = torch.arange(0, self.rot_dim, 2, dtype=torch.int64).to(torch.float32) / self.rot_dim
        return 1.0 / (base ** exponents)

    def _inv_freq(self, seq_len: int) -> torch.Tensor:
        rope = self.rope
        if rope.rope_type == "dynamic" and seq_len > self.original_max:
            base = rope.theta * (
                (rope.factor * seq_len / self.original_max) - (rope.factor - 1)
            ) ** (self.rot_dim / (self.rot_dim - 2))
            return self._base_inv_freq(base)
        inv_freq = self._base_inv_freq(rope.theta)
        if rope.rope_type == "linear":
            return inv_freq / rope.factor
        if rope.rope_type == "llama3":
            return self._llama3(inv_freq)
        return inv_freq

    def _llama3(self, inv_freq: torch.Tensor) -> torch.Tensor:
        rope = self.rope
        old_ctx = self.original_max
        low_wavelen = old_ctx / rope.low_freq_factor
        high_wavelen = old_ctx / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)

    def _table(self, inv_freq: torch.Tensor, length: int) -> Tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(length, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(self.device), emb.sin().to(self.device)

    @property
    def length_dependent(self) -> bool:
        """Whether a token's rotation depends on its request's length (dynamic NTK), not only its position."""
        return self.rope.length_dependent

    def cos_sin(
        self,
        positions: torch.Tensor,
        max_position: int,
        lengths: Optional[Sequence[int]] = None,
        new_lens: Optional[Sequence[int]] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows ``[T, rot_dim]`` (float32) for the given positions.

        ``max_position`` is the largest position in the batch (passed in so that no device sync
        is needed to find it).  ``lengths`` / ``new_lens``: per request, the shortest length dynamic
        NTK scales its tokens by (its original prompt's length; a token past it scales by its own
        position + 1) and its count of tokens in ``positions`` (in order); without them the batch
        is taken as one request reaching ``max_position``.
        """
        if self.length_dependent:
            if lengths is None or new_lens is None:
                lengths, new_lens = [max_position + 1], [int(positions.shape[0])]
            if max(max(lengths), max_position + 1) > self.original_max:
                return self._dynamic_cos_sin(positions, lengths, new_lens)
        if max_position >= self._cos.shape[0]:
            self._cos, self._sin = self._table(self._inv_freq(self.original_max), max(max_position + 1, 2 * self._cos.shape[0]))
        return self._cos[positions], self._sin[positions]

    def _dynamic_cos_sin(
        self, positions: torch.Tensor, lengths: Sequence[int], new_lens: Sequence[int]
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of each token with its own NTK base (computed, not looked up).

        A token's length is its request's floor or its position + 1, whichever is larger; one
        inverse-frequency row is computed per distinct length.
        """
        cpu_positions = positions.to("cpu", torch.int64)
        floors = torch.tensor(list(lengths), dtype=torch.int64).repeat_interleave(
            torch.tensor(list(new_lens), dtype=torch.int64))
        token_lengths = torch.maximum(floors, cpu_positions + 1).clamp_(min=self.original_max)
        distinct, row_of_token = torch.unique(token_lengths, return_inverse=True)
        rows = torch.stack([self._inv_freq(int(length)) for length in distinct.tolist()])
        freqs = cpu_positions.to(torch.float32)[:, None] * rows[row_of_token]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(self.device), emb.sin().to(self.device)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` of shape ``[T, heads, head_dim]`` (float32 arithmetic); returns a new tensor.

        Both halves of a cos/sin row are equal (the table repeats the frequencies), so each half
        of the output is two fused multiply-adds on half-width views: no rotated copy of ``x``,
        no negation, no concatenation.
        """
        rot = self.rot_dim
        half = rot // 2
        work = x if x.dtype == torch.float32 else x.float()
        out = torch.empty_like(work)
        x1, x2 = work[..., :half], work[..., half:rot]
        cos_h, sin_h = cos[:, None, :half], sin[:, None, :half]
        first, second = out[..., :half], out[..., half:rot]
        torch.mul(x1, cos_h, out=first)
        first.addcmul_(x2, sin_h, value=-1.0)
        torch.mul(x2, cos_h, out=second)
        second.addcmul_(x1, sin_h)
        if rot != x.shape[-1]:
            out[..., rot:] = work[..., rot:]
        return out if out.dtype == x.dtype else out.to(x.dtype)
