"""How many prompt plus output tokens one sequence may hold, and where that number comes from.

The benchmark tools refuse a sequence longer than this before anything loads or starts: the
runtime refused an overlong sequence only in its first forward, a server answers every such
request with HTTP 400, and transformers computed past the positions the model was trained on.
The checkpoint's numbers are read the way the runtime and the server read them
(:class:`ModelConfig`), never re-derived here.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

from lightllm.common.basemodel.model_config import ModelConfig


@dataclasses.dataclass(frozen=True)
class ContextLimit:
    """The most prompt plus output tokens of one sequence: ``tokens``, read from ``source``.

    ``name`` says whose limit it is in a refusal ("the model's context", "the servers' context").
    """

    tokens: int
    source: str
    name: str = "the model's context"

    @classmethod
    def of_checkpoint(cls, config: ModelConfig, model_dir: str, *, exact_attention: bool = True) -> "ContextLimit":
        """The context the checkpoint in ``model_dir`` declares (``config`` is its config).

        ``max_position_embeddings``, times the factor of ``linear`` and ``dynamic`` RoPE scaling;
        with ``exact_attention`` also a shorter sliding window (our runtime attends to the whole
        sequence, which matches a sliding-window model only within its window).
        """
        tokens = config.context_limit if exact_attention else config.rope_context
        window = exact_attention and config.sliding_window is not None
        scaled = config.rope_context != config.max_position_embeddings
        source = ("max_position_embeddings" + (f" x its {config.rope.rope_type} rope factor" if scaled else "")
                  + (", or its sliding window," if window else ""))
        return cls(tokens, f"{source} in {model_dir}/config.json")

    @classmethod
    def of_server(cls, config: ModelConfig, model_dir: str, max_req_total_len: Optional[int], where: str
                  ) -> "ContextLimit":
        """The limit of a server started on ``model_dir`` whose flags in ``where`` hold ``max_req_total_len``.

        The server's rule (``resolve_max_req_total_len`` in ``lightllm.server.launch.sizing``, which
        nothing outside the launcher may import): the flag when given, else the checkpoint's
        context capped by a sliding window (:attr:`ModelConfig.context_limit`).  A flag the server
        refuses (beyond a sliding window) is its own one-line refusal at its start.
        """
        if max_req_total_len is None:
            return dataclasses.replace(cls.of_checkpoint(config, model_dir), name="the servers' context")
        return cls(max_req_total_len, f"--max_req_total_len {max_req_total_len} in {where}", "the servers' context")

    def refusal(self, lengths: Mapping[str, int]) -> Optional[str]:
        """Why a sequence of ``sum(lengths)`` tokens does not fit (None when it does).

        ``lengths`` maps each flag to its tokens (``{"--prompt-len": 128, "--new-tokens": 64}``), so
        the refusal names what the user typed.
        """
        total = sum(lengths.values())
        if total <= self.tokens:
            return None
        given = " plus ".join(f"{flag} {value}" for flag, value in lengths.items())
        return f"{given} is {total} tokens, more than {self.name} of {self.tokens} ({self.source})"
