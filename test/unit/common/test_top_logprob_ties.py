"""Top logprobs rank tied values by token id, whatever else is in the batch.

A grammar that allows fewer tokens than a request's ``top_logprobs`` fills the rest with forbidden
tokens, all at -9999.0; ``topk`` ordered such ties as its kernel visited them, so which of them a
request listed changed with the other requests of its batch (an outside tester's differential fuzz:
alone or beside 1 or 3 requests the fourth entry was ``<pad>``, beside 7 others ``<|im_end|>``).
"""

from __future__ import annotations

import torch

from lightllm.common.sampling.sampler_output import SamplerOutput, ranked_top

VOCAB = 4096


def _constrained_row() -> torch.Tensor:
    row = torch.full((VOCAB,), -9999.0)
    row[[100, 7, 3000]] = torch.tensor([-0.1, -2.0, -3.0])
    return row


def test_tied_alternatives_come_in_token_id_order() -> None:
    values, ids = ranked_top(_constrained_row()[None], 6)
    assert ids.tolist() == [[100, 7, 3000, 0, 1, 2]]
    assert values[0, 3:].tolist() == [-9999.0] * 3


def test_a_row_lists_the_same_alternatives_alone_and_in_any_batch() -> None:
    generator = torch.Generator().manual_seed(0)
    alone = SamplerOutput.from_logprobs(torch.tensor([100]), _constrained_row()[None], [5]).row_top_logprobs(0)
    for size, width in ((2, 5), (8, 20), (33, 3)):
        batch = torch.randn(size, VOCAB, generator=generator).log_softmax(-1)
        batch[size // 2] = _constrained_row()
        counts = [width] * size
        counts[size // 2] = 5
        output = SamplerOutput.from_logprobs(torch.zeros(size, dtype=torch.long), batch, counts)
        assert output.row_top_logprobs(size // 2) == alone
        # Rows without ties keep topk's own ranking.
        top = batch[0].topk(counts[0])
        assert [i for i, _ in output.row_top_logprobs(0)] == top.indices.tolist()


def test_a_width_beyond_the_vocabulary_ranks_every_token() -> None:
    values, ids = ranked_top(torch.tensor([[0.0, -1.0, 0.0]]), 3)
    assert ids.tolist() == [[0, 2, 1]] and values.tolist() == [[0.0, 0.0, -1.0]]


def _reference(logprobs: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row sorted whole, ties by id (what ranked_top gives without sorting the vocabulary)."""
    values, ids = torch.sort(logprobs, dim=-1, descending=True, stable=True)
    return values[:, :width], ids[:, :width]


def test_ranked_top_equals_a_whole_stable_sort_on_rows_full_of_ties() -> None:
    generator = torch.Generator().manual_seed(1)
    for trial in range(200):
        vocab = int(torch.randint(2, 300, (1,), generator=generator))
        rows = int(torch.randint(1, 9, (1,), generator=generator))
        # Few distinct values, -inf (filtered tokens) and -9999 (forbidden ones) among them.
        levels = torch.tensor([0.0, -0.5, -1.0, -9999.0, float("-inf")])
        pick = torch.randint(0, len(levels), (rows, vocab), generator=generator)
        logprobs = levels[pick]
        if trial % 3 == 0:  # some rows without ties
            logprobs[0] = torch.randn(vocab, generator=generator)
        width = int(torch.randint(1, vocab + 3, (1,), generator=generator))
        got = ranked_top(logprobs, width)
        expected = _reference(logprobs, width)
        assert torch.equal(got[1], expected[1]), (trial, width)
        assert torch.equal(got[0], expected[0]), (trial, width)
