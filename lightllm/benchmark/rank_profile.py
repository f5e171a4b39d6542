"""Where a model rank's time goes, from a py-spy profile of it: the step's phases and, inside the
forward, the kind of work.

Record the rank while a benchmark runs (py-spy samples without stopping the process, so the run
keeps its speed; native frames are left out, which charges a kernel's time to the Python line
that called it), then read the profile::

    py-spy record --pid $(pgrep -x model_rank0) --nonblocking --rate 200 --format raw -o rank.raw --duration 20
    python -m lightllm.benchmark.rank_profile rank.raw

py-spy's ``raw`` format is one line per distinct stack: frames outermost first, separated by
``;``, each ``function (file:line)``, then a space and the number of samples. Without
``--idle`` py-spy keeps only samples of a running thread, so every sample is busy time; a
sleeping rank (between bursts) adds nothing.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple

from lightllm.benchmark.cli_args import OneLineErrorParser
from lightllm.benchmark.markdown_table import md_table

STEP = "StepEngine.step"
EXECUTE = "StepEngine.execute"
FORWARD = "DecoderOnlyTransformer.forward"
# A stack whose innermost frame is one of these (and that is not inside a step) is a rank waiting
# for work; py-spy records it only with --native or --idle.
IDLE_LEAVES = re.compile(r"^(clock_nanosleep|epoll_wait|poll|select|nanosleep|pthread_cond_\w*wait)\b")

# Inside the forward, the first rule whose pattern matches any frame's function wins.
FORWARD_RULES: Tuple[Tuple[str, re.Pattern], ...] = (
    ("forward: projections", re.compile(r"^(OneDnnLinear|TorchLinear)\.")),
    ("forward: attention metadata", re.compile(r"Attention\w*\.prepare$")),
    ("forward: attention", re.compile(r"Attention\w*\.(forward|_prefill|_decode)$")),
    ("forward: norms, activations, rotary", re.compile(r"^(\w*LayerOps\.|RotaryEmbedding\.)")),
    ("forward: KV cache writes", re.compile(r"^KVCacheMemoryManager\.write$")),
    ("forward: embedding", re.compile(r"^embedding$")),
)
# The executor's sampling call and what it calls (logits processors, the draw, log-probabilities).
SAMPLING = re.compile(r"^(Sampler\.|\w+\._sample$|sample_rows$)")
BETWEEN_STEP_RULES: Tuple[Tuple[str, re.Pattern], ...] = (
    ("between steps: publishing", re.compile(r"^(StepPublisher\.|ShmReqBuffer\.publish)")),
    ("between steps: admission", re.compile(r"^(ModelRank\.(screen|apply|_admit|receive_commands)|ShmReqBuffer\.read_request)")),
)


def function_name(frame: str) -> str:
    """``OneDnnLinear.unpadded (lightllm/common/...py:94)`` -> ``OneDnnLinear.unpadded``."""
    return frame.split(" (", 1)[0].strip()


def first_match(names: Sequence[str], rules: Iterable[Tuple[str, re.Pattern]]) -> Optional[str]:
    """The label of the first rule whose pattern matches one of ``names``, or None."""
    for label, pattern in rules:
        if any(pattern.search(name) for name in names):
            return label
    return None


def classify(frames: Sequence[str]) -> Optional[str]:
    """The phase one stack belongs to, or None for an idle rank."""
    names = [function_name(frame) for frame in frames]
    if STEP not in names:
        if names and IDLE_LEAVES.match(names[-1]):
            return None
        return first_match(names, BETWEEN_STEP_RULES) or "between steps: other"
    below = names[names.index(STEP) + 1:]
    phase = below[0] if below else STEP
    if phase != EXECUTE:
        return f"step: {phase.split('.')[-1]}"
    if FORWARD in below:
        return first_match(below, FORWARD_RULES) or "forward: other"
    if any(SAMPLING.search(name) for name in below):
        return "step: sampling"
    return "step: execute, outside the forward (batch set-up, KV slots, results)"


@dataclass
class RankProfile:
    """Busy samples per phase, and the idle ones left out."""

    phases: Counter
    idle: int

    @property
    def busy(self) -> int:
        """Samples of every phase together (the idle ones left out)."""
        return sum(self.phases.values())

    def rows(self) -> List[Tuple[str, int, float]]:
        """(phase, samples, share of busy samples), largest first."""
        busy = self.busy or 1
        return [(phase, count, count / busy) for phase, count in self.phases.most_common()]


def read_profile(lines: Iterable[str]) -> RankProfile:
    """Fold py-spy ``raw`` lines into a :class:`RankProfile`; raises ValueError on a malformed line."""
    phases: Counter = Counter()
    idle = 0
    for number, line in enumerate(lines, 1):
        line = line.rstrip("\n")
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            raise ValueError(f"line {number} is not 'frame;frame;... COUNT' (py-spy --format raw): {line[:80]!r}")
        phase = classify(stack.split(";"))
        if phase is None:
            idle += int(count)
        else:
            phases[phase] += int(count)
    return RankProfile(phases, idle)


def markdown(profile: RankProfile) -> str:
    """The profile as a table, largest phase first."""
    rows = [(phase, str(count), f"{share:.1%}") for phase, count, share in profile.rows()]
    return "\n".join([f"busy samples: {profile.busy} (idle, left out: {profile.idle})", ""]
                     + md_table(("phase", "samples", "share of busy"), rows))


def build_parser() -> argparse.ArgumentParser:
    """The command line: one py-spy raw file."""
    parser = OneLineErrorParser(
        prog="python -m lightllm.benchmark.rank_profile",
        description="Where a model rank's busy time goes, from a py-spy raw profile of it.",
    )
    parser.add_argument("raw", help="py-spy record --format raw output of the model rank (model_rank0)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print the profile of the py-spy raw file named in ``argv`` as a Markdown table; returns the exit code.

    An unreadable or malformed file, or one without a busy sample, exits with a one-line message.
    """
    args = build_parser().parse_args(argv)
    try:
        with open(args.raw) as raw:
            profile = read_profile(raw)
    except (OSError, ValueError) as error:
        raise SystemExit(f"rank_profile: {args.raw}: {error}") from None
    if profile.busy == 0:
        raise SystemExit(f"rank_profile: {args.raw} has no busy samples of a model rank")
    print(markdown(profile))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
