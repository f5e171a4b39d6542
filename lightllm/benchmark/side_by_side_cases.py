"""The cases and engines of a ``side_by_side`` run, as its ``--cases`` and ``--engines`` give them."""

from __future__ import annotations

import dataclasses
from typing import List

ENGINES = ("ours", "vllm_default", "vllm_every_core")
WARMUP_SEED_OFFSET = 1000  # far from every case's seed, so the warm-up's prompts share no prefix


@dataclasses.dataclass(frozen=True)
class Case:
    """``prompts`` requests of ``input_len`` tokens, each generating ``output_len`` tokens.

    With ``prefix_len`` every prompt starts with the same ``prefix_len`` tokens (the client's
    ``--random-prefix-len``: a few-shot or system prompt) before its own ``input_len``.
    """

    prompts: int
    input_len: int
    output_len: int
    prefix_len: int = 0

    @property
    def label(self) -> str:
        """``PROMPTSxINPUTxOUTPUT`` (``PROMPTSxPREFIX+INPUTxOUTPUT`` with a shared prefix), as ``--cases`` writes it."""
        shared = f"{self.prefix_len}+" if self.prefix_len else ""
        return f"{self.prompts}x{shared}{self.input_len}x{self.output_len}"


def parse_cases(text: str) -> List[Case]:
    """``"64x128x64,64x1024+128x64"`` -> cases (``PREFIX+INPUT``: a shared prefix); ``ValueError`` naming a bad item."""
    cases = []
    for item in text.split(","):
        parts = item.strip().split("x")
        lengths = parts[1].split("+") if len(parts) == 3 else []
        numbers = [parts[0], *lengths, parts[2]] if len(parts) == 3 and len(lengths) <= 2 else []
        if not numbers or not all(p.isdigit() and int(p) > 0 for p in numbers):
            raise ValueError(f"case {item!r} is not PROMPTSxINPUTxOUTPUT (or PROMPTSxPREFIX+INPUTxOUTPUT, a shared "
                             "prefix) with positive integers (e.g. 64x128x64, 64x1024+128x64)")
        prefix = int(lengths[0]) if len(lengths) == 2 else 0
        cases.append(Case(int(parts[0]), int(lengths[-1]), int(parts[2]), prefix))
    if not cases:
        raise ValueError("--cases needs at least one case")
    return cases


def parse_engines(text: str) -> List[str]:
    """Comma-separated engine names, in run order; repeats allowed (a second run of ours)."""
    engines = [e.strip() for e in text.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown or not engines:
        raise ValueError(f"--engines must list names from {', '.join(ENGINES)}; got {text!r}")
    return engines
