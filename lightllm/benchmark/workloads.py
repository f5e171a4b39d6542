"""Deterministic arrival schedules for the serving benchmark.

A workload is a list of :class:`ScheduledRequest` tuples sorted by scheduled send
time. Generators are pure functions of their arguments (including the seed), so two
servers measured with the same arguments receive exactly the same schedule.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import numpy as np

LONG = "long"
SHORT = "short"
REQUEST_CLASSES: tuple[str, ...] = (SHORT, LONG)


class ScheduledRequest(NamedTuple):
    """One request of a workload: when to send it, its class and its token lengths.

    ``prefix_group`` >= 0 names a shared token stream: the first ``prefix_len`` prompt tokens
    (after the tokenizer's special tokens) are that stream's first tokens, identical for every
    request of the group, so a prefix cache can reuse them; the rest is unique.  ``-1``: the
    whole prompt is unique.
    """

    scheduled_time_s: float
    request_class: str
    prompt_len: int
    output_len: int
    prefix_group: int = -1
    prefix_len: int = 0


@dataclasses.dataclass
class WorkloadConfig:
    """All knobs of the workload generators; each generator reads the ones it needs.

    Times given in milliseconds mirror the CLI flags; ``*_output_len`` overrides of
    ``None`` fall back to ``output_len``.
    """

    name: str = "long_first"
    long_len: int = 16384
    short_len: int = 128
    output_len: int = 128
    long_output_len: int | None = None
    short_output_len: int | None = None
    seed: int = 0
    # long_first
    long_count: int = 48
    short_count: int = 48
    long_spread_ms: float = 47.0
    short_start_ms: float = 60.0
    short_spread_ms: float = 47.0
    # interleaved
    request_rate: float = 500.0
    long_every: int = 4
    num_requests: int = 192
    # sustained
    duration_s: float = 8.0
    long_fraction: float = 0.25
    burstiness: float = 1.0
    initial_long_count: int = 0
    stream_start_ms: float = 0.0
    # shared_prefix
    prefix_groups: int = 4
    prefix_tokens: int = 1024
    chat_turns: int = 4

    def output_len_for(self, request_class: str) -> int:
        """Return the output length of a request class, honouring per-class overrides."""
        override = self.long_output_len if request_class == LONG else self.short_output_len
        return self.output_len if override is None else override


# What each WorkloadConfig knob means, for the --help of the commands that expose them as flags.
FIELD_HELP: dict[str, str] = {
    "name": "workload generator",
    "seed": "seed of the workload's arrivals and prompts",
    "long_len": "prompt tokens of a long request",
    "short_len": "prompt tokens of a short request (shared_prefix: the tokens after the shared prefix)",
    "output_len": "output tokens of every request, unless a per-class length is given",
    "long_output_len": "output tokens of a long request (default: --output-len)",
    "short_output_len": "output tokens of a short request (default: --output-len)",
    "long_count": "long_first: long requests in the first burst",
    "short_count": "long_first: short requests in the second burst",
    "long_spread_ms": "long_first: ms over which the long requests arrive; sustained: ms over which the "
    "--initial-long-count long requests arrive",
    "short_start_ms": "long_first: ms at which the short requests start arriving",
    "short_spread_ms": "long_first: ms over which the short requests arrive",
    "request_rate": "interleaved, sustained, shared_prefix: requests per second (> 0)",
    "long_every": "interleaved: the first of every N requests is long",
    "num_requests": "interleaved: requests in all",
    "duration_s": "sustained, shared_prefix: seconds of arrivals",
    "long_fraction": "sustained, shared_prefix: share of long (cold) requests, within [0, 1]",
    "burstiness": "sustained: shape of the gamma-distributed gaps (1: Poisson; below 1 burstier)",
    "initial_long_count": "sustained: long requests sent before the stream starts",
    "stream_start_ms": "sustained: ms at which the stream starts",
    "prefix_groups": "shared_prefix: few-shot templates",
    "prefix_tokens": "shared_prefix: tokens of a template or of a chat's first turn",
    "chat_turns": "shared_prefix: turns before a chat closes",
}


def _require_positive_int(name: str, value: int, allow_zero: bool = False) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound}, got {value}")


def _require_non_negative(name: str, value: float) -> None:
    if not np.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def _require_positive(name: str, value: float) -> None:
    if not np.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def _spread(count: int, start_s: float, spread_s: float) -> list[float]:
    """Place ``count`` points uniformly from ``start_s`` to ``start_s + spread_s`` inclusive."""
    if count == 1:
        return [start_s]
    step = spread_s / (count - 1)
    return [start_s + i * step for i in range(count)]


def _check_lengths(cfg: WorkloadConfig) -> None:
    _require_positive_int("long_len", cfg.long_len)
    _require_positive_int("short_len", cfg.short_len)
    for cls in REQUEST_CLASSES:
        # Named after the knob the length came from: a class without its own length uses
        # output_len, and the refusal must name the flag the user typed (--output-len).
        override = cfg.long_output_len if cls == LONG else cfg.short_output_len
        _require_positive_int("output_len" if override is None else f"{cls}_output_len", cfg.output_len_for(cls))


def _make(cfg: WorkloadConfig, time_s: float, request_class: str) -> ScheduledRequest:
    prompt_len = cfg.long_len if request_class == LONG else cfg.short_len
    return ScheduledRequest(time_s, request_class, prompt_len, cfg.output_len_for(request_class))


def long_first(cfg: WorkloadConfig) -> list[ScheduledRequest]:
    """A burst of long requests followed by a burst of short ones.

    ``long_count`` long requests are spread uniformly over ``[0, long_spread_ms]``, then
    ``short_count`` short requests over ``[short_start_ms, short_start_ms +
    short_spread_ms]`` (defaults: 48 long at 0-47 ms, 48 short at 60-107 ms).
    """
    _check_lengths(cfg)
    _require_positive_int("long_count", cfg.long_count, allow_zero=True)
    _require_positive_int("short_count", cfg.short_count, allow_zero=True)
    if cfg.long_count + cfg.short_count == 0:
        raise ValueError("long_count + short_count must be > 0")
    _require_non_negative("long_spread_ms", cfg.long_spread_ms)
    _require_non_negative("short_start_ms", cfg.short_start_ms)
    _require_non_negative("short_spread_ms", cfg.short_spread_ms)
    longs = [_make(cfg, t, LONG) for t in _spread(cfg.long_count, 0.0, cfg.long_spread_ms / 1e3)]
    shorts = [
        _make(cfg, t, SHORT)
        for t in _spread(cfg.short_count, cfg.short_start_ms / 1e3, cfg.short_spread_ms / 1e3)
    ]
    # A stable sort keeps long requests ahead of short ones scheduled at the same instant.
    return sorted(longs + shorts, key=lambda r: r.scheduled_time_s)


def interleaved(cfg: WorkloadConfig) -> list[ScheduledRequest]:
    """``num_requests`` requests at a fixed ``request_rate``; the first of every ``long_every`` is long.

    With the defaults (192 requests at 500 req/s, one long in four) the schedule spans
    0-382 ms.
    """
    _check_lengths(cfg)
    _require_positive_int("num_requests", cfg.num_requests)
    _require_positive_int("long_every", cfg.long_every)
    _require_positive("request_rate", cfg.request_rate)
    return [
        _make(cfg, i / cfg.request_rate, LONG if i % cfg.long_every == 0 else SHORT)
        for i in range(cfg.num_requests)
    ]


def sustained(cfg: WorkloadConfig) -> list[ScheduledRequest]:
    """Open-loop stream with gamma-distributed gaps for ``duration_s`` seconds.

    Gaps have mean ``1 / request_rate`` and shape ``burstiness`` (1.0 gives a Poisson
    process; below 1 is burstier, above 1 more regular). Each request is long with
    probability ``long_fraction``. The stream starts at ``stream_start_ms``; optionally
    ``initial_long_count`` long requests are sent first, spread over ``long_spread_ms``.
    """
    _check_lengths(cfg)
    _require_positive("request_rate", cfg.request_rate)
    _require_positive("duration_s", cfg.duration_s)
    _require_positive("burstiness", cfg.burstiness)
    _require_non_negative("stream_start_ms", cfg.stream_start_ms)
    _require_non_negative("long_spread_ms", cfg.long_spread_ms)
    _require_positive_int("initial_long_count", cfg.initial_long_count, allow_zero=True)
    if not 0.0 <= cfg.long_fraction <= 1.0:
        raise ValueError(f"long_fraction must be within [0, 1], got {cfg.long_fraction!r}")
    rng = np.random.default_rng(cfg.seed)
    scale = 1.0 / (cfg.request_rate * cfg.burstiness)
    start_s = cfg.stream_start_ms / 1e3
    requests: list[ScheduledRequest] = []
    if cfg.initial_long_count:
        spread_s = cfg.long_spread_ms / 1e3
        requests = [_make(cfg, t, LONG) for t in _spread(cfg.initial_long_count, 0.0, spread_s)]
    elapsed = 0.0
    while True:
        elapsed += float(rng.gamma(cfg.burstiness, scale))
        if elapsed >= cfg.duration_s:
            break
        cls = LONG if rng.random() < cfg.long_fraction else SHORT
        requests.append(_make(cfg, start_s + elapsed, cls))
    if not requests:
        raise ValueError(
            "sustained workload is empty: increase request_rate or duration_s "
            f"(request_rate={cfg.request_rate}, duration_s={cfg.duration_s})"
        )
    return sorted(requests, key=lambda r: r.scheduled_time_s)


def shared_prefix(cfg: WorkloadConfig) -> list[ScheduledRequest]:
    """Few-shot prompts and multi-turn chats whose prompts share prefixes, plus cold prompts.

    Poisson arrivals at ``request_rate`` for ``duration_s`` seconds.  Each request is, with
    probability ``long_fraction``, a cold prompt of ``long_len`` unique tokens (class ``long``);
    otherwise, with equal odds, a few-shot prompt or the next turn of a chat (class ``short``:
    most of its prompt can come from the prefix cache):

    * few-shot: one of ``prefix_groups`` templates of ``prefix_tokens`` tokens, then
      ``short_len`` unique tokens;
    * chat: a chat's turn ``k`` (from 0) is the first ``prefix_tokens + k * short_len`` tokens of
      the chat's own stream, so each turn extends the previous prompt.  A request continues a
      random open chat with probability 3/4 (or starts one); a chat closes after
      ``chat_turns`` turns.  A chat's first turn has nothing cached and is class ``long``.
    """
    _check_lengths(cfg)
    _require_positive("request_rate", cfg.request_rate)
    _require_positive("duration_s", cfg.duration_s)
    _require_positive_int("prefix_groups", cfg.prefix_groups)
    _require_positive_int("prefix_tokens", cfg.prefix_tokens)
    _require_positive_int("chat_turns", cfg.chat_turns)
    if not 0.0 <= cfg.long_fraction <= 1.0:
        raise ValueError(f"long_fraction must be within [0, 1], got {cfg.long_fraction!r}")
    rng = np.random.default_rng(cfg.seed)
    requests: list[ScheduledRequest] = []
    open_chats: list[list[int]] = []  # [group, next turn]
    next_chat_group = cfg.prefix_groups  # few-shot templates use groups 0 .. prefix_groups - 1
    elapsed = 0.0
    while True:
        elapsed += float(rng.exponential(1.0 / cfg.request_rate))
        if elapsed >= cfg.duration_s:
            break
        draw = rng.random()
        if draw < cfg.long_fraction:
            requests.append(_make(cfg, elapsed, LONG))
        elif rng.random() < 0.5:
            group = int(rng.integers(cfg.prefix_groups))
            length = cfg.prefix_tokens + cfg.short_len
            requests.append(
                ScheduledRequest(elapsed, SHORT, length, cfg.output_len_for(SHORT), group, cfg.prefix_tokens)
            )
        else:
            if open_chats and rng.random() < 0.75:
                chat = open_chats[int(rng.integers(len(open_chats)))]
            else:
                chat = [next_chat_group, 0]
                next_chat_group += 1
                open_chats.append(chat)
            group, turn = chat
            length = cfg.prefix_tokens + turn * cfg.short_len
            cls = LONG if turn == 0 else SHORT
            requests.append(ScheduledRequest(elapsed, cls, length, cfg.output_len_for(cls), group, length))
            chat[1] += 1
            if chat[1] >= cfg.chat_turns:
                open_chats.remove(chat)
    if not requests:
        raise ValueError(
            "shared_prefix workload is empty: increase request_rate or duration_s "
            f"(request_rate={cfg.request_rate}, duration_s={cfg.duration_s})"
        )
    return requests


WORKLOADS: dict[str, Callable[[WorkloadConfig], list[ScheduledRequest]]] = {
    "long_first": long_first,
    "interleaved": interleaved,
    "sustained": sustained,
    "shared_prefix": shared_prefix,
}


# The generators whose schedule (arrival times, classes, lengths) is drawn from the seed; the
# others place every request at a fixed time, so for them the seed changes only the prompts'
# text, which a tool that builds no prompts (the scheduling simulator) never reads.
SCHEDULE_FROM_SEED: frozenset[str] = frozenset({"sustained", "shared_prefix"})

# The knobs every generator reads: the lengths, and the seed (which also seeds the prompts).
COMMON_KNOBS: frozenset[str] = frozenset(
    {"long_len", "short_len", "output_len", "long_output_len", "short_output_len", "seed"}
)
# The knobs each generator reads besides COMMON_KNOBS; a command line refuses the others when
# typed, since the run would ignore them (a test checks that changing one changes nothing).
WORKLOAD_KNOBS: dict[str, frozenset[str]] = {
    "long_first": frozenset({"long_count", "short_count", "long_spread_ms", "short_start_ms", "short_spread_ms"}),
    "interleaved": frozenset({"request_rate", "long_every", "num_requests"}),
    "sustained": frozenset({"request_rate", "duration_s", "long_fraction", "burstiness", "initial_long_count",
                            "stream_start_ms", "long_spread_ms"}),
    "shared_prefix": frozenset({"request_rate", "duration_s", "long_fraction", "prefix_groups", "prefix_tokens",
                                "chat_turns"}),
}


def workloads_using(knob: str) -> list[str]:
    """The workloads whose generator reads ``knob`` (a :class:`WorkloadConfig` field), sorted."""
    return sorted(name for name in WORKLOADS if knob in COMMON_KNOBS or knob in WORKLOAD_KNOBS[name])


def build_workload(cfg: WorkloadConfig) -> list[ScheduledRequest]:
    """Generate the schedule named by ``cfg.name``."""
    try:
        generator = WORKLOADS[cfg.name]
    except KeyError:
        raise ValueError(
            f"workload name must be one of {sorted(WORKLOADS)}, got {cfg.name!r}"
        ) from None
    # Checked for every workload, not only those that draw their schedule from it: the seed also
    # seeds every workload's prompts, and one rule for all keeps a seed valid for every workload.
    _require_positive_int("seed", cfg.seed, allow_zero=True)
    return generator(cfg)
