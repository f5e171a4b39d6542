"""The ragged batch a forward pass consumes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch


@dataclass
class ForwardBatch:
    """New tokens of several requests, flattened.

    Request ``i`` already has ``start_lens[i]`` tokens in the KV cache and contributes
    ``new_lens[i]`` new tokens at positions ``start_lens[i] ..``.  Their K/V are written to
    ``out_slots`` (which the caller has also recorded in the request manager's row, so attention
    can read the whole context through ``req_rows``).

    ``is_decode`` means every request contributes exactly one token, which lets attention use a
    batched path.  ``all_logits`` asks for logits at every new position instead of only the last
    one of each request (tests compare those against a reference).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_slots: torch.Tensor
    req_rows: torch.Tensor
    start_lens: List[int]
    new_lens: List[int]
    is_decode: bool = False
    all_logits: bool = False
    # Flattened token indexes whose logits the forward returns, in this order (overrides
    # ``all_logits`` and the default of each request's last new token).
    logit_index: Optional[torch.Tensor] = None
    # Per request, the shortest sequence length that length-dependent RoPE (dynamic NTK) scales
    # its tokens by: its original prompt's length (a chunk of it scales as an unchunked prefill
    # would); a token past it scales by its own position + 1, the length it made when it was
    # generated.  None: ``seq_lens``.  Never the batch's: a request's output must not depend on
    # the requests batched with it.
    rope_lengths: Optional[List[int]] = None

    @property
    def batch_size(self) -> int:
        """Number of requests."""
        return len(self.new_lens)

    @property
    def seq_lens(self) -> List[int]:
        """Context length of each request after this forward."""
        return [s + n for s, n in zip(self.start_lens, self.new_lens)]

    @property
    def max_position(self) -> int:
        """Largest position index in the batch."""
        return max(self.seq_lens) - 1

    @property
    def last_token_index(self) -> torch.Tensor:
        """Index into the flattened tokens of each request's last new token."""
        ends = torch.tensor(self.new_lens, dtype=torch.int64).cumsum(0)
        return (ends - 1).to(self.input_ids.device)

    def padded_query_index(self, queries: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Index tensors for laying the new tokens out as ``[batch_size, queries]`` (CPU, int64).

        Returns ``q_index`` ``[batch_size, queries]``: the flattened token each padded query
        takes (padding repeats its request's last token, a valid position whose output is
        dropped), and ``out_index`` ``[tokens]``: the padded query of each flattened token.
        ``queries`` must be at least the longest chunk.
        """
        new_lens = self.new_lens
        firsts = torch.tensor([0, *new_lens[:-1]], dtype=torch.int64).cumsum(0)
        lens = torch.tensor(new_lens, dtype=torch.int64)
        step = torch.arange(queries, dtype=torch.int64)
        q_index = firsts[:, None] + torch.minimum(step[None, :], lens[:, None] - 1)
        out_index = torch.cat([row * queries + torch.arange(n) for row, n in enumerate(new_lens)])
        return q_index, out_index

    @classmethod
    def build(
        cls,
        token_ids: Sequence[Sequence[int]],
        start_lens: Sequence[int],
        req_rows: Sequence[int],
        out_slots: torch.Tensor,
        device: torch.device | str = "cpu",
        all_logits: bool = False,
        rope_lengths: Optional[Sequence[int]] = None,
    ) -> "ForwardBatch":
        """Assemble a batch from each request's new token ids and cached length."""
        new_lens = [len(t) for t in token_ids]
        if any(n == 0 for n in new_lens):
            raise ValueError("every request in a forward batch needs at least one new token")
        flat: List[int] = [tok for seq in token_ids for tok in seq]
        positions: List[int] = [p for s, n in zip(start_lens, new_lens) for p in range(s, s + n)]
        return cls(
            input_ids=torch.tensor(flat, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            out_slots=out_slots.to(device),
            req_rows=torch.tensor(list(req_rows), dtype=torch.int64, device=device),
            start_lens=list(start_lens),
            new_lens=new_lens,
            is_decode=all(n == 1 for n in new_lens),
            all_logits=all_logits,
            rope_lengths=None if rope_lengths is None else list(rope_lengths),
        )
