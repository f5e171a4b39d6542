"""The result of one sampling step: chosen tokens, their log-probabilities and top alternatives."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def ranked_top(logprobs: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, ids)`` of each row's ``width`` largest entries, ties in token-id order.

    ``topk`` orders tied values as its kernel happens to visit them, which changed with the
    other rows of the batch: tokens a grammar forbids (all at -9999.0) filled a request's
    remaining top logprobs with different tokens alone and beside other requests.  Ties are
    common (forbidden or filtered tokens, bf16 logits), so they are resolved without sorting the
    vocabulary: a tie at the cut-off takes the lowest ids of that value (one O(V) ``topk`` on the
    tied rows), then the ``width`` kept entries are ordered by value, then id.
    """
    vocab = logprobs.shape[-1]
    reach = min(width + 1, vocab)
    values, ids = logprobs.topk(reach, dim=-1)
    if reach < 2:
        return values[:, :width], ids[:, :width]
    tied = (values[:, 1:] == values[:, :-1]).any(dim=1)
    if bool(tied.any()):
        rows = tied.nonzero().squeeze(1)
        kept_values, kept_ids = values[rows, :width], ids[rows, :width]
        if reach > width:
            cut = kept_values[:, -1]
            at_cut = (cut == values[rows, width]).nonzero().squeeze(1)
            if at_cut.numel():
                # The whole batch, with NaN (equal to nothing) as the cut of the other rows:
                # cheaper than copying the tied rows out of it.
                batch_cut = torch.full((logprobs.shape[0],), float("nan"), dtype=logprobs.dtype, device=logprobs.device)
                batch_cut[rows[at_cut]] = cut[at_cut]
                lowest = _lowest_ids_of(logprobs, batch_cut, width)[rows[at_cut]]
                kept_values[at_cut], kept_ids[at_cut] = _fill_at_cut(
                    kept_values[at_cut], kept_ids[at_cut], cut[at_cut], lowest)
        by_id = kept_ids.argsort(dim=1, stable=True)
        kept_values, kept_ids = kept_values.gather(1, by_id), kept_ids.gather(1, by_id)
        by_value = kept_values.argsort(dim=1, descending=True, stable=True)
        values[rows, :width] = kept_values.gather(1, by_value)
        ids[rows, :width] = kept_ids.gather(1, by_value)
    return values[:, :width], ids[:, :width]


def _lowest_ids_of(logprobs: torch.Tensor, value: torch.Tensor, count: int) -> torch.Tensor:
    """``[B, count]`` the lowest ids of each row whose logprob is ``value[row]``, lowest first."""
    vocab = logprobs.shape[-1]
    # The lowest tied id gets the largest key (float32 holds every id of a vocabulary below 2^24).
    rank = torch.arange(vocab, 0, -1, dtype=torch.float32, device=logprobs.device)
    keys = torch.where(logprobs == value[:, None], rank, torch.zeros((), dtype=torch.float32, device=logprobs.device))
    return keys.topk(count, dim=-1).indices


def _fill_at_cut(
    kept_values: torch.Tensor, kept_ids: torch.Tensor, cut: torch.Tensor, lowest: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept entries whose value is ``cut`` replaced by ``lowest``, the lowest ids of that value."""
    width = kept_values.shape[-1]
    above = (kept_values > cut[:, None]).sum(dim=1)  # entries above the cut stay
    place = torch.arange(width, device=kept_values.device)[None, :]
    fill = place >= above[:, None]
    source = (place - above[:, None]).clamp(min=0)
    ids = torch.where(fill, lowest.gather(1, source), kept_ids)
    values = torch.where(fill, cut[:, None].expand(-1, width), kept_values)
    return values, ids


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
