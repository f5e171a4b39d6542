"""Prompt-token logprobs computed in the prefill forward, for the requests that ask for them.

The forward normally returns logits at each chunk's last position only.  For a request with
``prompt_logprobs`` set, :func:`prefill_logit_rows` asks for the logits at every chunk position
that predicts a prompt token not yet covered, and :func:`prompt_logprob_entries` turns those
rows into ``(position, logprob, top)`` entries.  Other requests in the same batch keep the
single last-position row, so they pay nothing.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from lightllm.common.basemodel.forward_batch import ForwardBatch
from lightllm.common.sampling.sampler_output import ranked_top
from lightllm.server.model_rank.scheduling.infer_req import InferReq

# (position, logprob, top alternatives, rank of the prompt token in the full distribution)
PromptLogprobEntry = Tuple[int, float, List[Tuple[int, float]], int]
# ``(request, first logits row, positions)`` of a chunk whose prompt logprobs this forward computes.
PromptLogitRows = Tuple[InferReq, int, List[int]]


def prefill_logit_rows(batch: ForwardBatch, chunks: Sequence) -> Tuple[List[int], List[PromptLogitRows]]:
    """Set ``batch.logit_index`` when some chunk's request needs prompt logprobs.

    Returns the logits row of each chunk's last position and, for each chunk that computes
    prompt logprobs in this forward, its request, first row and positions.
    """
    if not any(chunk.req.wants_prompt_logprobs for chunk in chunks):
        return list(range(len(chunks))), []
    index: List[int] = []
    last_rows: List[int] = []
    prompt_rows: List[PromptLogitRows] = []
    offset = 0
    for chunk in chunks:
        req = chunk.req
        if req.wants_prompt_logprobs:
            # Logits at position p predict the prompt token at p + 1.
            positions = [p for p in range(chunk.start, chunk.end) if req.prompt_logprob_next <= p + 1 < req.input_len]
            if positions:
                prompt_rows.append((req, len(index), positions))
                index.extend(offset + p - chunk.start for p in positions)
        last_rows.append(len(index))
        index.append(offset + chunk.end - chunk.start - 1)
        offset += chunk.end - chunk.start
    batch.logit_index = torch.tensor(index, dtype=torch.int64, device=batch.input_ids.device)
    return last_rows, prompt_rows


def collect_prompt_logprobs(
    logits: torch.Tensor, prompt_rows: List[PromptLogitRows]
) -> List[Tuple[InferReq, List[PromptLogprobEntry]]]:
    """``(request, entries)`` for each chunk of ``prompt_rows``, from the forward's ``logits``."""
    return [
        (req, prompt_logprob_entries(req, logits[first_row : first_row + len(positions)], positions))
        for req, first_row, positions in prompt_rows
    ]


def prompt_logprob_entries(req: InferReq, logits: torch.Tensor, positions: List[int]) -> List[PromptLogprobEntry]:
    """``(position, logprob, top, rank)`` of the prompt tokens after ``positions``; advances the request.

    ``rank`` is vLLM's: 1 + the number of vocabulary entries with a strictly greater logprob.

    Log-softmax of the raw logits (no penalties or temperature), as vLLM reports prompt
    logprobs.  ``req.prompt_logprob_next`` moves past them, so a request prefilled again after a
    pause does not report them twice.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor([req.prompt_ids[p + 1] for p in positions], dtype=torch.long, device=logits.device)
    chosen_column = logprobs.gather(1, targets[:, None])
    ranks = ((logprobs > chosen_column).sum(dim=-1) + 1).tolist()
    chosen = chosen_column.squeeze(1).tolist()
    count = min(int(req.sampling.prompt_logprobs), logprobs.shape[1])
    if count > 0:
        values, ids = ranked_top(logprobs, count)
        tops = [list(zip(row_ids, row_values)) for row_ids, row_values in zip(ids.tolist(), values.tolist())]
    else:
        tops = [[] for _ in positions]
    req.prompt_logprob_next = positions[-1] + 2
    return [(p + 1, value, top, rank) for p, value, top, rank in zip(positions, chosen, tops, ranks)]
