"""Run scenarios through simulated servers: single node or a 1P1D prefill/decode pair."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from lightllm.benchmark.metrics import RequestRecord, summarize
from lightllm.benchmark.simulator.cost_model import CostProfile
from lightllm.benchmark.simulator.engine import Simulator
from lightllm.benchmark.simulator.scenarios import MODES, SEED_RUNNING_MAX_REQ_SIZE, ScenarioSpec
from lightllm.benchmark.simulator.sim_types import SimArrival, SimServerConfig
from lightllm.benchmark.workloads import LONG, SHORT, ScheduledRequest
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import (
    PrefillQueueStrategy,
    available_strategy_names,
)
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound import OvertakeBoundSpec

# The decode node of a 1P1D pair keeps its own settings while the prefill node's strategy varies,
# as in the seed report's PD runs.
DECODE_NODE_STRATEGY = "default"


@dataclasses.dataclass(frozen=True)
class CaseKey:
    """One cell of the comparison matrix."""

    scenario: str
    mode: str
    budget: int
    strategy: str


@dataclasses.dataclass
class CaseResult:
    """Metrics of one simulated case (latencies in ms, throughput in output tokens/s)."""

    key: CaseKey
    metrics: Dict[str, Optional[float]]
    summary: Dict[str, Any]
    steps: int
    records: List[RequestRecord] = dataclasses.field(repr=False, default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        """JSON form without the per-request records."""
        return {**dataclasses.asdict(self.key), "metrics": self.metrics, "steps": self.steps, "summary": self.summary}


def check_choice(value: str, choices: Sequence[str], param: str) -> str:
    """Return ``value`` if it is one of ``choices``; otherwise raise a ValueError naming ``param``."""
    if value not in choices:
        raise ValueError(f"{param} must be one of {', '.join(choices)}; got {value!r}")
    return value


def check_fits_kv(profile: CostProfile, workload: Sequence[ScheduledRequest], what: str = "workload") -> None:
    """Refuse a workload with a request the profile's KV cache can never hold (ValueError naming it).

    By its end a request holds its prompt and its output in KV (a 1P1D decode node reserves both
    at once).  One that needs more than the whole cache is admitted alone once nothing else runs,
    and then can never move: the simulation would stall only after everything before it ran.
    """
    worst = max(workload, key=lambda r: r.prompt_len + r.output_len, default=None)
    if worst is not None and worst.prompt_len + worst.output_len > profile.max_total_token_num:
        raise ValueError(
            f"the profile's KV cache holds {profile.max_total_token_num} tokens, but a request of "
            f"{what} needs {worst.prompt_len + worst.output_len}: its {worst.prompt_len}-token prompt plus "
            f"{worst.output_len} output tokens"
        )


def budget_refusal(profile: CostProfile, profile_flag: str, budget: int, running_max_req_size: Optional[int] = None,
                   mixed_normal_node: bool = False, budget_name: str = "--budget") -> Optional[str]:
    """Why the server would refuse this simulated node's sizing (None when it would not), in the
    simulator's flags: the launch's rules (``lightllm/server/launch/sizing.py``) on
    ``--batch_max_tokens``, which ``--budget`` stands for.

    * ``--budget`` above the KV cache (the profile's ``max_total_token_num``; with mixed batches on
      a normal node, above the larger of the cache and ``running_max_req_size``, whose decode rows
      take budget tokens): no step can hold more prompt tokens than the cache, and the budget
      would promise a step the server never runs;
    * on a normal node with mixed batches (``mixed_normal_node``), ``--budget`` below
      ``running_max_req_size``: every decoding request takes one token of the step's budget, so
      a waiting prompt could get no token until decodes finish.

    ``budget_name`` is how the message names the budget (a tool that takes it in another flag).
    """
    kv_tokens = profile.max_total_token_num
    rows = running_max_req_size if mixed_normal_node and running_max_req_size is not None else 0
    largest = max(kv_tokens, rows)
    if budget > largest:
        return (f"{budget_name} ({budget}) exceeds the KV cache of --profile {profile_flag} ({kv_tokens} tokens): no step "
                f"can hold more prompt tokens than the cache, and the server refuses such a --batch_max_tokens; give "
                f"at most {largest}")
    if mixed_normal_node and running_max_req_size is not None and budget < running_max_req_size:
        return (f"with --mixed-batches each decoding request takes one token of a step's --budget, so --budget "
                f"({budget}) must be >= --running-max-req-size ({running_max_req_size}) or a prompt would wait for "
                "decodes to finish (the server refuses the same of --batch_max_tokens); lower "
                "--running-max-req-size, raise --budget, or drop --mixed-batches")
    return None


def server_config(mode: str, budget: int, running_max_req_size: int, **extra: Any) -> SimServerConfig:
    """Config of the node that runs the strategy: ``batch_max_tokens = chunked_prefill_size = budget``."""
    check_choice(mode, MODES, "mode")
    return SimServerConfig(
        batch_max_tokens=budget,
        chunked_prefill_size=budget,
        running_max_req_size=running_max_req_size,
        run_mode="prefill" if mode == "1p1d" else "normal",
        **extra,
    )


def simulate_single_node(
    profile: CostProfile,
    workload: Sequence[ScheduledRequest],
    strategy: Union[str, PrefillQueueStrategy],
    config: SimServerConfig,
) -> tuple[List[RequestRecord], int]:
    """Run ``workload`` through one simulated server; return its records and step count."""
    sim = Simulator(profile, strategy, config)
    sim.add_workload(workload)
    result = sim.run()
    return result.records, result.steps


def simulate_1p1d(
    profile: CostProfile,
    workload: Sequence[ScheduledRequest],
    strategy: Union[str, PrefillQueueStrategy],
    budget: int,
    running_max_req_size: int = SEED_RUNNING_MAX_REQ_SIZE,
    record_token_times: bool = True,
    overtake_bound: OvertakeBoundSpec = OvertakeBoundSpec(),
) -> tuple[List[RequestRecord], int]:
    """A prefill node running ``strategy`` feeding a decode node; return merged records and steps.

    The prefill node (run mode ``prefill``) hands each request over the moment its first token is
    published; the decode node receives it then, with the prompt's KV in place.  KV transfer
    time is not modelled (assumed zero) and the decode node never pushes back on the prefill
    node, so the two nodes are simulated one after the other.
    """
    prefill_cfg = server_config(
        "1p1d",
        budget,
        running_max_req_size,
        record_token_times=record_token_times,
        overtake_bound=overtake_bound,
    )
    prefill_records, prefill_steps = simulate_single_node(profile, workload, strategy, prefill_cfg)
    decode_cfg = SimServerConfig(
        batch_max_tokens=budget,
        chunked_prefill_size=budget,
        running_max_req_size=running_max_req_size,
        run_mode="decode",
        record_token_times=record_token_times,
    )
    decode = Simulator(profile, DECODE_NODE_STRATEGY, decode_cfg)
    handed_over = [r for r in prefill_records if r.requested_output_tokens > 1]
    for record in sorted(handed_over, key=lambda r: (r.first_token_time, r.index)):
        decode.add_arrival(
            SimArrival(
                request_id=record.index,
                arrival_s=record.first_token_time,
                prompt_len=record.prompt_tokens,
                output_len=record.requested_output_tokens,
                request_class=record.request_class,
            )
        )
    decode_result = decode.run()
    by_id = {r.index: r for r in decode_result.records}
    merged = [_merge_pd_record(p, by_id.get(p.index)) for p in prefill_records]
    return merged, prefill_steps + decode_result.steps


def simulate_workload(
    profile: CostProfile,
    workload: Sequence[ScheduledRequest],
    strategy: Union[str, PrefillQueueStrategy],
    mode: str,
    budget: int,
    running_max_req_size: int = SEED_RUNNING_MAX_REQ_SIZE,
    record_token_times: bool = True,
    overtake_bound: OvertakeBoundSpec = OvertakeBoundSpec(),
    mixed_batches: bool = False,
) -> tuple[List[RequestRecord], int]:
    """Run ``workload`` on the node kind ``mode`` (a 1P1D pair or one node); return records and steps.

    ``overtake_bound`` is the strategy node's overtaking bound; ``mixed_batches`` runs a normal
    node's decode rows inside its prefill forward (a prefill node never decodes, a decode node
    never prefills, so a 1P1D pair is the same either way).

    Raises:
        ValueError: a request of ``workload`` needs more KV than the profile has (see :func:`check_fits_kv`).
    """
    check_fits_kv(profile, workload)
    if mode == "1p1d":
        return simulate_1p1d(
            profile,
            workload,
            strategy,
            budget,
            running_max_req_size,
            record_token_times=record_token_times,
            overtake_bound=overtake_bound,
        )
    config = server_config(
        mode,
        budget,
        running_max_req_size,
        record_token_times=record_token_times,
        overtake_bound=overtake_bound,
        mixed_batches=mixed_batches,
    )
    return simulate_single_node(profile, workload, strategy, config)


def _merge_pd_record(prefill: RequestRecord, decode: Optional[RequestRecord]) -> RequestRecord:
    if decode is None:
        return prefill
    # The decode node's first stamp is the hand-over itself, i.e. the prefill node's first token.
    return dataclasses.replace(
        prefill,
        token_times=prefill.token_times[:1] + decode.token_times[1:],
        end_time=decode.end_time,
        output_tokens=decode.output_tokens,
    )


def case_metrics(records: Sequence[RequestRecord]) -> tuple[Dict[str, Optional[float]], Dict[str, Any]]:
    """The report's headline numbers, computed by the benchmark's own metrics code."""
    summary = summarize(records)
    classes = summary["classes"]

    def stat(cls: str, metric: str, key: str) -> Optional[float]:
        group = classes.get(cls)
        return group[metric][key] if group else None

    metrics = {
        "short_ttft_p50_ms": stat(SHORT, "ttft_ms", "p50"),
        "short_ttft_p95_ms": stat(SHORT, "ttft_ms", "p95"),
        "long_ttft_p95_ms": stat(LONG, "ttft_ms", "p95"),
        "long_e2e_p95_ms": stat(LONG, "e2e_ms", "p95"),
        # The seed reported these two for short requests as ranges (TPOT +6-21%, E2E +0.4-2.3%).
        "short_tpot_p50_ms": stat(SHORT, "tpot_ms", "p50"),
        "short_e2e_p95_ms": stat(SHORT, "e2e_ms", "p95"),
        "output_tok_s": summary["overall"]["output_throughput"],
        "duration_s": summary["duration_s"],
    }
    return metrics, summary


def simulate_case(
    profile: CostProfile,
    scenario: ScenarioSpec,
    mode: str,
    budget: int,
    strategy: str,
    seed: int = 0,
    running_max_req_size: int = SEED_RUNNING_MAX_REQ_SIZE,
    keep_records: bool = False,
    overtake_bound: OvertakeBoundSpec = OvertakeBoundSpec(),
    mixed_batches: bool = False,
) -> CaseResult:
    """Simulate one scenario on one node kind with one prefill budget and strategy.

    ``overtake_bound`` is the strategy node's overtaking bound.
    """
    check_choice(strategy, available_strategy_names(), "strategy")
    check_choice(mode, MODES, "mode")
    workload = scenario.build(seed)
    records, steps = simulate_workload(
        profile,
        workload,
        strategy,
        mode,
        budget,
        running_max_req_size,
        overtake_bound=overtake_bound,
        mixed_batches=mixed_batches,
    )
    metrics, summary = case_metrics(records)
    return CaseResult(
        key=CaseKey(scenario.name, mode, budget, strategy),
        metrics=metrics,
        summary=summary,
        steps=steps,
        records=list(records) if keep_records else [],
    )


def run_matrix(
    profile: CostProfile,
    scenarios: Sequence[ScenarioSpec],
    modes: Sequence[str],
    budgets: Sequence[int],
    strategies: Sequence[str],
    seed: int = 0,
    running_max_req_size: int = SEED_RUNNING_MAX_REQ_SIZE,
    progress: Optional[Callable[[CaseKey], None]] = None,
    overtake_bound: OvertakeBoundSpec = OvertakeBoundSpec(),
    mixed_batches: bool = False,
) -> List[CaseResult]:
    """Every scenario x mode x budget x strategy, in that nesting order."""
    for strategy in strategies:
        check_choice(strategy, available_strategy_names(), "strategies")
    for mode in modes:
        check_choice(mode, MODES, "modes")
    results: List[CaseResult] = []
    for scenario in scenarios:
        for mode in modes:
            for budget in budgets:
                for strategy in strategies:
                    if progress is not None:
                        progress(CaseKey(scenario.name, mode, budget, strategy))
                    results.append(
                        simulate_case(
                            profile,
                            scenario,
                            mode,
                            budget,
                            strategy,
                            seed,
                            running_max_req_size,
                            overtake_bound=overtake_bound,
                            mixed_batches=mixed_batches,
                        )
                    )
    return results
