"""Scheduling simulator: the server's real scheduling code driven in virtual time.

The router's admission queue and the mode backend (the step engine with its classifier,
prefill-queue strategy, step planner and processed-prefill-token counter) are the server's own
objects; only the model forwards are replaced by a step-cost model (:class:`CostProfile`, run by
:class:`CostModelExecutor`) and the KV cache by a token count.  See ``docs/EN/simulator.md``.

Run ``python -m lightllm.benchmark.simulator --help`` for the command line.
"""

from lightllm.benchmark.simulator.cost_model import CostProfile, available_profiles, load_profile
from lightllm.benchmark.simulator.engine import Simulator
from lightllm.benchmark.simulator.runner import CaseKey, CaseResult, run_matrix, simulate_1p1d, simulate_case
from lightllm.benchmark.simulator.scenarios import SCENARIOS, ScenarioSpec, resolve_scenarios
from lightllm.benchmark.simulator.sim_types import SimArrival, SimResult, SimServerConfig, StepTrace
from lightllm.benchmark.simulator.soak import SoakConfig, SoakResult, run_soak, run_soaks

__all__ = [
    "SCENARIOS",
    "CaseKey",
    "CaseResult",
    "CostProfile",
    "ScenarioSpec",
    "SimArrival",
    "SimResult",
    "SimServerConfig",
    "Simulator",
    "SoakConfig",
    "SoakResult",
    "StepTrace",
    "available_profiles",
    "load_profile",
    "resolve_scenarios",
    "run_matrix",
    "run_soak",
    "run_soaks",
    "simulate_1p1d",
    "simulate_case",
]
