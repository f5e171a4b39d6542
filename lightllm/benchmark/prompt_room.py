"""Whether the prompt builder can make every prompt of a workload, checked before anything starts.

A prompt of N tokens holds the special tokens the tokenizer adds (BOS) and at least one token of
content, and a shared prefix (``--shared-prefix-len``) must leave every prompt a token of its own
(:meth:`~lightllm.benchmark.prompts.PromptBuilder.build`).  Found only while the prompts were
built, a length outside these bounds ended a run with a traceback, in ``compare_strategies``
after its servers had started; this refuses it in one line naming the flags to change.
"""

from __future__ import annotations

from typing import Iterable

from lightllm.benchmark.workload_context import length_fields, scheduled_requests
from lightllm.benchmark.workloads import WorkloadConfig


def check_prompt_room(cfg: WorkloadConfig, seeds: Iterable[int], special_tokens: int,
                      shared_prefix_len: int = 0) -> None:
    """Refuse ``cfg`` when a prompt of its schedules (with ``seeds``) cannot be built.

    ``special_tokens``: how many the tokenizer adds to every prompt
    (:attr:`~lightllm.benchmark.prompts.PromptBuilder.num_special_tokens`).

    Raises:
        ValueError: one line naming the workload, the shortest prompt and the fields setting it.
    """
    shortest = min(scheduled_requests(cfg, seeds), key=lambda r: r.prompt_len, default=None)
    if shortest is None:
        return
    fields = length_fields(cfg, shortest)[0]
    room = shortest.prompt_len - special_tokens
    what = (f"a {shortest.request_class} request of {shortest.prompt_len} prompt tokens "
            f"({' + '.join(fields)})")
    if room < 1:
        raise ValueError(f"workload {cfg.name} has {what}, which leaves no room for content: the tokenizer adds "
                         f"{special_tokens} special token(s) to every prompt, so a prompt needs at least "
                         f"{special_tokens + 1} tokens: raise {', '.join(fields)}")
    if shared_prefix_len >= room:
        raise ValueError(f"shared_prefix_len {shared_prefix_len} leaves no token of its own to {what} of workload "
                         f"{cfg.name} ({special_tokens} of them special): lower shared_prefix_len below {room} or "
                         f"raise {', '.join(fields)}")
