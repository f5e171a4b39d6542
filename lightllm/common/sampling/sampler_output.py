"""The result of one sampling step: chosen tokens, their log-probabilities and top alternatives."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplerOutput:
    """Result of one sampling step.

    ``logprobs`` are log-softmax values of the distribution ``--logprobs_mode`` names (by
    default the penalised, temperature-scaled one, before min-p / top-k / top-p).  ``top_logprob_ids`` / ``top_logprobs`` have width
    ``max(top_logprobs_counts)``; row ``i`` asked for ``top_logprobs_counts[i]`` of them.
    """

    next_token_ids: torch.Tensor  # long[B]
    logprobs: torch.Tensor  # float32[B]
    top_logprob_ids: torch.Tensor | None  # long[B, N]
    top_logprobs: torch.Tensor | None  # float32[B, N]
    top_logprobs_counts: list[int]
    # Host copies of the two top tensors, made on the first row_top_logprobs call.
    _host_top: tuple[list[list[int]], list[list[float]]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    @classmethod
    def from_logprobs(
        cls, next_token_ids: torch.Tensor, logprobs: torch.Tensor, top_logprobs_counts: list[int]
    ) -> "SamplerOutput":
        """Pick each row's chosen log-probability and, if any row asked, the top alternatives.

        Args:
            next_token_ids: the chosen token of each row.
            logprobs: ``float32[B, V]`` log-probabilities of every token.
            top_logprobs_counts: how many alternatives each row asked for (0: none).
        """
        chosen = logprobs.gather(1, next_token_ids[:, None]).squeeze(1)
        width = max(top_logprobs_counts)
        top_values: torch.Tensor | None = None
        top_ids: torch.Tensor | None = None
        if width > 0:
            top_values, top_ids = logprobs.topk(width, dim=-1)
        return cls(
            next_token_ids=next_token_ids,
            logprobs=chosen,
            top_logprob_ids=top_ids,
            top_logprobs=top_values,
            top_logprobs_counts=list(top_logprobs_counts),
        )

    def row_top_logprobs(self, row: int) -> list[tuple[int, float]]:
        """The ``(token_id, logprob)`` pairs row ``row`` requested, most likely first."""
        count = self.top_logprobs_counts[row]
        if count == 0 or self.top_logprob_ids is None or self.top_logprobs is None:
            return []
        if self._host_top is None:
            # Callers walk every row: one device-to-host copy for the batch, not two per row.
            self._host_top = (self.top_logprob_ids.tolist(), self.top_logprobs.tolist())
        ids, values = self._host_top
        return list(zip(ids[row][:count], values[row][:count]))
