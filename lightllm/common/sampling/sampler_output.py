"""The result of one sampling step: chosen tokens, their log-probabilities and top alternatives."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def ranked_top(logprobs: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, ids)`` of each row's ``width`` largest entries, ties in token-id order.

    ``topk`` orders tied values as its kernel happens to visit them, which changed with the
    other rows of the batch: tokens a grammar forbids (all at -9999.0) filled a request's
    remaining top logprobs with different tokens alone and beside other requests.  A row whose
    first ``width + 1`` values hold a tie is ranked by a stable sort instead (ties are rare
    otherwise, so the sort runs on few rows).
    """
    vocab = logprobs.shape[-1]
    reach = min(width + 1, vocab)
    values, ids = logprobs.topk(reach, dim=-1)
    tied = (values[:, 1:] == values[:, :-1]).any(dim=1) if reach > 1 else None
    if tied is not None and bool(tied.any()):
        rows = tied.nonzero().squeeze(1)
        sorted_values, sorted_ids = torch.sort(logprobs[rows], dim=-1, descending=True, stable=True)
        values[rows] = sorted_values[:, :reach]
        ids[rows] = sorted_ids[:, :reach]
    return values[:, :width], ids[:, :width]


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
            top_values, top_ids = ranked_top(logprobs, width)
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
