"""Soak runs: hours of simulated sustained traffic, to see how long any request can wait.

The seed report's finite scenarios cannot show whether a strategy starves a request under
never-ending load.  A soak run sends a Poisson stream for a simulated duration of hours at a
rate below the server's estimated capacity, drains it, and reports per strategy the longest
and the 99th-percentile wait from arrival to first token.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Dict, List, Optional

from lightllm.benchmark.metrics import percentile
from lightllm.benchmark.simulator.cost_model import CostProfile
from lightllm.benchmark.simulator.runner import check_choice, simulate_workload
from lightllm.benchmark.simulator.scenarios import MODES, SEED_RUNNING_MAX_REQ_SIZE
from lightllm.benchmark.workloads import LONG, ScheduledRequest, WorkloadConfig, build_workload
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound import OvertakeBoundSpec


# Most requests one strategy's soak run may send (rate x duration).  The documented runs send
# 45,000 to 91,000 (one or two simulated hours at the H100 profile's 12.6 req/s), 17-21 s of
# wall time per 45,000 on a quiet 2-core machine; a million is some 22 simulated hours at that
# rate and several minutes per strategy.  Beyond it a run is a typo (``--soak-rate 1e12``) that would generate
# requests until memory runs out.
MAX_SOAK_REQUESTS = 1_000_000


@dataclasses.dataclass(frozen=True)
class SoakConfig:
    """Traffic and server settings of a soak run.

    ``request_rate`` of ``None`` picks ``load`` times the estimated capacity (see
    :func:`estimate_capacity_rate`).
    """

    hours: float
    load: float = 0.7
    request_rate: Optional[float] = None
    long_len: int = 8192
    short_len: int = 128
    long_fraction: float = 0.25
    output_len: int = 128
    budget: int = 1024
    mode: str = "normal"
    seed: int = 0
    running_max_req_size: int = SEED_RUNNING_MAX_REQ_SIZE
    overtake_bound: OvertakeBoundSpec = OvertakeBoundSpec()
    mixed_batches: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.overtake_bound, OvertakeBoundSpec):
            raise ValueError(f"overtake_bound must be an OvertakeBoundSpec, got {self.overtake_bound!r}")
        if not self.hours > 0:
            raise ValueError(f"hours must be > 0, got {self.hours!r}")
        if not 0 < self.load < 1:
            raise ValueError(f"load must be within (0, 1), got {self.load!r}")
        check_choice(self.mode, MODES, "mode")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"request_rate must be None or > 0, got {self.request_rate!r}")
        # Checked here rather than left to the workload generator and the cost model, whose
        # refusals would name their own internals (a chunk size, a KV sum).
        for name in ("long_len", "short_len", "output_len", "budget"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not 0 <= self.long_fraction <= 1:
            raise ValueError(f"long_fraction must be within [0, 1], got {self.long_fraction!r}")

    def mean_prompt_len(self) -> float:
        """Expected prompt length of one request."""
        return self.long_fraction * self.long_len + (1 - self.long_fraction) * self.short_len


def _prefill_steps(prompt_len: int, budget: int) -> int:
    """Steps one prompt holds the prefill head for: the planner gives the head at most ``budget``
    tokens a step (the soak's chunk size equals its budget)."""
    return -(-prompt_len // budget)


def capacity_bounds(profile: CostProfile, cfg: SoakConfig) -> Dict[str, float]:
    """The most prompt tokens a step can start prefilling, at steady state, under each limit of the
    simulated server.

    A request the router admits keeps its running place (and its projected KV, prompt plus
    output allowance) from admission until it leaves: ``_prefill_steps`` steps of prefill and then
    ``output_len`` decode steps on a normal node; a PD prefill node hands it off after its first
    token (its router counts one new token).  By Little's law, starting ``X`` requests per step
    (``X x mean_prompt`` tokens) keeps ``X x residency`` of them running, so:

    * ``prefill``: the tokens fit the ``budget`` (with mixed batches the decode rows ride in the
      same budget, one token each);
    * ``running``: ``X x mean residency`` fits ``running_max_req_size`` (``--running-max-req-size``);
    * ``kv``: the residency-weighted projected KV of the running set fits the profile's KV cache,
      which the router's admission sums.
    """
    mean_prompt = cfg.mean_prompt_len()
    pd_prefill = cfg.mode == "1p1d"
    new_tokens = 1 if pd_prefill else cfg.output_len
    decode_steps = 0 if pd_prefill else cfg.output_len
    classes = [(cfg.long_fraction, cfg.long_len), (1 - cfg.long_fraction, cfg.short_len)]
    residency = sum(share * (_prefill_steps(n, cfg.budget) + decode_steps) for share, n in classes)
    kv_held = sum(share * (n + new_tokens) * (_prefill_steps(n, cfg.budget) + decode_steps) for share, n in classes)
    decode_rows = cfg.output_len if cfg.mixed_batches and not pd_prefill else 0
    return {
        # Written as budget x a share, so that without decode rows it is the budget exactly.
        "prefill": cfg.budget * (mean_prompt / (mean_prompt + decode_rows)),
        "running": cfg.running_max_req_size / residency * mean_prompt,
        "kv": profile.max_total_token_num / kv_held * mean_prompt,
    }


def estimate_capacity_rate(profile: CostProfile, cfg: SoakConfig) -> float:
    """Requests per second the simulated server can sustain (a steady-state estimate).

    ``T``, the prompt tokens started per step, is the smallest of :func:`capacity_bounds` (so the
    prefill budget, the running-request cap and the KV cache all hold); the rate is
    ``T / mean_prompt`` requests over the time of a step that prefills ``T`` tokens (priced at the
    middle of a long prompt; its fixed cost paid in the share of steps that have a prefill, at most
    all) and decodes ``T x output_len / mean_prompt`` requests (Little's law; at most the running
    cap).  A PD prefill node has no decode forward; with mixed batches the decode rows are
    one-token rows of the prefill forward.  When the prefill budget binds, every step prefills a
    full ``budget``: the estimate of the documented default stream, unchanged since only the
    budget was counted.
    """
    mean_prompt = cfg.mean_prompt_len()
    tokens = min(capacity_bounds(profile, cfg).values())
    prefill_tokens = max(1, round(tokens))
    mean_prefill_steps = (cfg.long_fraction * _prefill_steps(cfg.long_len, cfg.budget)
                          + (1 - cfg.long_fraction) * _prefill_steps(cfg.short_len, cfg.budget))
    prefill_share = min(1.0, tokens / mean_prompt * mean_prefill_steps)
    # A step without a prefill chunk skips the prefill forward's launch cost (and, with mixed
    # batches, runs its decode rows as a decode forward instead).
    step_s = (profile.prefill_seconds([(prefill_tokens, prefill_tokens + cfg.long_len // 2)])
              - (1 - prefill_share) * profile.prefill_fixed_s)
    if cfg.mode != "1p1d":
        decoding = min(cfg.running_max_req_size, max(1, round(tokens * cfg.output_len / mean_prompt)))
        context = int(mean_prompt + cfg.output_len / 2)
        decode_s = profile.decode_seconds(decoding, decoding * context)
        if cfg.mixed_batches:
            rows_s = profile.prefill_seconds([(1, context)] * decoding) - profile.prefill_fixed_s
            step_s += prefill_share * rows_s + (1 - prefill_share) * decode_s
        else:
            step_s += decode_s
    return tokens / step_s / mean_prompt


def soak_request_rate(profile: CostProfile, cfg: SoakConfig) -> float:
    """The soak stream's rate in req/s: ``cfg.request_rate``, or ``cfg.load`` times the estimated capacity."""
    return cfg.request_rate or cfg.load * estimate_capacity_rate(profile, cfg)


def expected_soak_requests(profile: CostProfile, cfg: SoakConfig) -> float:
    """About how many requests one strategy's soak run sends: its rate times its duration."""
    return soak_request_rate(profile, cfg) * cfg.hours * 3600.0


def soak_size_problem(profile: CostProfile, cfg: SoakConfig, hours_name: str = "hours",
                      rate_source: Optional[str] = None,
                      advice: str = "shorten hours or lower the rate") -> Optional[str]:
    """Why the soak run is too large to simulate (None when it is not): more than
    :data:`MAX_SOAK_REQUESTS` requests.  By default the message names the fields (``hours``,
    ``request_rate``, ``load``); the command line passes its flags' words instead."""
    expected = expected_soak_requests(profile, cfg)
    if expected <= MAX_SOAK_REQUESTS:
        return None
    if rate_source is None:
        rate_source = "request_rate" if cfg.request_rate else f"load {cfg.load:g} x the estimated capacity"
    rate = soak_request_rate(profile, cfg)
    return (f"{hours_name} {cfg.hours:g} at {rate:.4g} req/s ({rate_source}) is about {expected:,.0f} requests "
            f"per strategy, more than the {MAX_SOAK_REQUESTS:,} a soak run simulates; {advice}")


def soak_workload(profile: CostProfile, cfg: SoakConfig, hours_name: str = "hours",
                  rate_source: Optional[str] = None,
                  advice: str = "lengthen hours or raise the rate") -> List[ScheduledRequest]:
    """The soak stream of ``cfg`` (the same arrivals for every strategy).

    Raises:
        ValueError: the stream draws no request within the soak duration.  By default the
            message names the fields (``hours``, ``request_rate``, ``load``); the command line
            passes its flags' words instead (the workload generator's own message names
            ``duration_s``, which no caller set).
    """
    rate = soak_request_rate(profile, cfg)
    workload_cfg = WorkloadConfig(
        name="sustained",
        long_len=cfg.long_len,
        short_len=cfg.short_len,
        output_len=cfg.output_len,
        long_fraction=cfg.long_fraction,
        request_rate=rate,
        duration_s=cfg.hours * 3600.0,
        seed=cfg.seed,
    )
    try:
        return build_workload(workload_cfg)
    except ValueError as exc:
        if "is empty" not in str(exc):
            raise
        if rate_source is None:
            rate_source = "request_rate" if cfg.request_rate else f"load {cfg.load:g} x the estimated capacity"
        raise ValueError(f"{hours_name} {cfg.hours:g} at {rate:.4g} req/s ({rate_source}) draws no request "
                         f"(seed {cfg.seed}): the soak stream would be empty; {advice}") from None


@dataclasses.dataclass
class SoakResult:
    """Wait statistics of one strategy's soak run (seconds)."""

    strategy: str
    requests: int
    simulated_s: float
    wall_s: float
    request_rate: float
    max_wait_s: float
    p99_wait_s: float
    p50_wait_s: float
    max_long_wait_s: Optional[float]
    max_short_wait_s: Optional[float]

    def to_dict(self) -> Dict[str, Any]:
        """JSON form."""
        return dataclasses.asdict(self)


def run_soak(profile: CostProfile, strategy: str, cfg: SoakConfig) -> SoakResult:
    """Simulate ``cfg.hours`` of sustained traffic with ``strategy`` and report the waits.

    Raises:
        ValueError: the run would send more than :data:`MAX_SOAK_REQUESTS` requests.
    """
    problem = soak_size_problem(profile, cfg)
    if problem is not None:
        raise ValueError(problem)
    rate = soak_request_rate(profile, cfg)
    workload = soak_workload(profile, cfg)
    started = time.perf_counter()
    records, _ = simulate_workload(
        profile,
        workload,
        strategy,
        cfg.mode,
        cfg.budget,
        cfg.running_max_req_size,
        record_token_times=False,
        overtake_bound=cfg.overtake_bound,
        mixed_batches=cfg.mixed_batches,
    )
    wall = time.perf_counter() - started
    waits = [r.first_token_time - r.send_time for r in records]
    long_waits = [w for w, r in zip(waits, records) if r.request_class == LONG]
    short_waits = [w for w, r in zip(waits, records) if r.request_class != LONG]
    return SoakResult(
        strategy=strategy,
        requests=len(records),
        simulated_s=max(r.end_time for r in records),
        wall_s=wall,
        request_rate=rate,
        max_wait_s=max(waits),
        p99_wait_s=percentile(waits, 99),
        p50_wait_s=percentile(waits, 50),
        max_long_wait_s=max(long_waits) if long_waits else None,
        max_short_wait_s=max(short_waits) if short_waits else None,
    )


def run_soaks(profile: CostProfile, strategies: List[str], cfg: SoakConfig,
              on_start: Optional[Callable[[str], None]] = None) -> List[SoakResult]:
    """One soak run per strategy, all on the same arrival schedule; ``on_start(strategy)`` before each."""
    results = []
    for strategy in strategies:
        if on_start is not None:
            on_start(strategy)
        results.append(run_soak(profile, strategy, cfg))
    return results
