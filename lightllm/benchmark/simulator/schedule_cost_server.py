"""Scheduling cost per step in the server's layout: N waiting in the router, M running in the rank.

In a server, requests beyond ``--running_max_req_size`` wait in the router's
:class:`~lightllm.server.router.req_queue.normal_queue.NormalReqQueue`; the model rank's
:class:`~lightllm.server.model_rank.scheduling.step_engine.StepEngine` orders and selects
only the admitted ones.  This module builds exactly that with the simulator's own objects (a
:class:`~lightllm.benchmark.simulator.engine.Simulator`: the router queue, ``build_backend("normal")``
over a :class:`TokenCountKvView` and the cost-model executor) and times, per step:

* ``admit``: the router's ``NormalReqQueue.admit`` call (in a server it runs in the router's own
  process, beside the forward);
* ``schedule``: the engine's filter, resume, share prefixes, order, select and pause
  (``StepReport.schedule_seconds``, measured by the engine itself);
* ``step``: the engine's whole ``step()`` minus the executor's own Python time, i.e. the schedule
  plus submitting (KV reservation, token counter, the overtaking bound's charge) and taking the
  results (appending tokens, stop rules, releasing finished requests).

The KV view is the simulator's token count (``kv_view="count"``), or a model rank's own
``InferenceContext`` (``kv_view="radix"``: token slots, request rows and the radix prefix cache,
on buffers of one float per token), so the step also pays what a rank pays for its KV
bookkeeping: attaching cached prefixes, reserving slots, prefix sharing while prompts wait,
and inserting finished requests into the cache.  Its prompts are then real token ids: a quarter
start with one shared 256-token system prompt, the rest are distinct.

The state is a steady state reached by running the simulated server on a sustained overload:
the router is kept at ``waiting`` requests (topped up before every step), the running batch at
its cap ``running``; prompts and outputs are drawn so that most running requests decode and some
prefill (prompts are not multiples of the chunk size).  The KV capacity holds a full batch of
the largest requests, so admission is limited by the request cap, as in the issue's question.
Warm-up steps run first (the batch starts as ``running`` fresh prompts and needs about a prompt's
and an output's worth of steps to mix); then, for each size in ascending order, the router is
raised to it in an untimed *intake* and ``repeats`` steps are timed.  The intake is kept apart
because it is no steady state: the first admission round after the raise that has a free slot
takes in every request added at once (some 9,000 when the router goes from 1,000 to 10,000), in
the router's queue settling each newcomer's overtaking-bound base, a one-off cost a server pays
only for such a burst.  The intake steps until that round has run (a round with a full batch
decides nothing), and its admission time is reported on its own (``intake_admit_ms``).  Timings
are for reading, never for deciding a test.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch

from lightllm.benchmark.simulator.cost_executor import CostModelExecutor
from lightllm.benchmark.simulator.cost_model import load_profile
from lightllm.benchmark.simulator.engine import Simulator
from lightllm.benchmark.simulator.sim_types import SimArrival, SimServerConfig
from lightllm.common.kv_cache_mem_manager.mem_manager import KVCacheMemoryManager
from lightllm.common.req_manager import ReqManager
from lightllm.server.model_rank.kv_cache.infer_context import InferenceContext
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import available_strategy_names
from lightllm.server.model_rank.scheduling.request_state import ReqState

KV_VIEWS = ("count", "radix")
DEFAULT_WAITING = (100, 1000, 10000)
DEFAULT_RUNNING = (1000,)
PROFILE = "h100_qwen_0p8b"
BUDGET = 1024
# Mean output / mean prompt ~ 0.8 with a 1024-token prefill budget: at a full batch of 1,000
# about 800 requests decode and the rest wait for or run their prefill (a decode step finishes
# ~1,000 / 800 requests, the prefill budget admits ~1 prompt per step).
PROMPT_RANGE = (100, 1900)
OUTPUT_RANGE = (400, 1200)
# --kv-view radix: prompts are slices of one random token pool (distinct prompts), a quarter of
# them behind a shared system prompt, so the prefix cache has real work and real hits.
SYSTEM_PROMPT_LEN = 256
SHARED_PREFIX_FRACTION = 0.25
TOKEN_POOL_SIZE = 1 << 16
# A full batch frees a slot within a prompt's and an output's worth of steps, at most 3,100;
# the bound only turns a layout that never admits into an error instead of a hang.
MAX_INTAKE_STEPS = 10 * (PROMPT_RANGE[1] + OUTPUT_RANGE[1])


@dataclass
class ServerCostRow:
    """Per-step milliseconds (median and max over the timed steps) of one strategy and layout.

    ``intake_admit_ms`` is the admission round of the untimed intake that took in the requests
    raising the router to ``waiting`` (see the module docstring); the other figures are the
    timed steps after it.
    """

    strategy: str
    waiting: int
    running: int
    kv_view: str
    decoding: int
    prefilling: int
    admit_ms: float
    admit_max_ms: float
    intake_admit_ms: float
    schedule_ms: float
    schedule_max_ms: float
    step_ms: float
    step_max_ms: float
    repeats: int


class _TimedExecutor(CostModelExecutor):
    """The cost-model executor, adding up its own Python time so the step can exclude it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.spent = 0.0

    def prefill(self, chunks):  # type: ignore[no-untyped-def]
        started = time.perf_counter()
        try:
            return super().prefill(chunks)
        finally:
            self.spent += time.perf_counter() - started

    def decode(self, reqs):  # type: ignore[no-untyped-def]
        started = time.perf_counter()
        try:
            return super().decode(reqs)
        finally:
            self.spent += time.perf_counter() - started


class ServerLayout:
    """A simulated server kept at ``waiting`` router requests and a full batch of ``running``.

    ``router``, ``backend`` are the simulator's own objects; :meth:`step` runs one simulated step
    (the router topped up first) and returns ``(admit_s, schedule_s, step_s)``, where ``admit_s``
    is 0 when the router had nothing to admit from.  The latest step also leaves what the timed
    calls saw: ``waiting_at_admit`` (router requests when admission ran), ``admitted_at_admit``
    (requests it admitted), ``running_after_admit`` (the router's running set after it) and
    ``engine_requests`` (live requests the engine's step started with).
    """

    def __init__(
        self, strategy: str, running: int, waiting: int = 0, *, seed: int = 0, kv_view: str = "count"
    ) -> None:
        if running < 1:
            raise ValueError(f"running must be >= 1, got {running}")
        if kv_view not in KV_VIEWS:
            raise ValueError(f"kv_view must be one of {', '.join(KV_VIEWS)}, got {kv_view!r}")
        self.profile = load_profile(PROFILE)
        capacity = running * (PROMPT_RANGE[1] + OUTPUT_RANGE[1])
        config = SimServerConfig(
            batch_max_tokens=BUDGET,
            chunked_prefill_size=BUDGET,
            running_max_req_size=running,
            max_total_token_num=capacity,
            record_token_times=False,
        )
        self.kv_view = kv_view
        kv = _rank_kv_view(capacity, running) if kv_view == "radix" else None
        self.sim = Simulator(self.profile, strategy, config, kv=kv)
        self.executor = _TimedExecutor(self.profile)
        self.sim.executor = self.sim.backend.executor = self.executor
        self.router = self.sim.router
        self.backend = self.sim.backend
        # The simulator calls these two; the wrappers time exactly the router's and the engine's call.
        self._router_admit = self.router.admit
        self.router.admit = self._timed_admit  # type: ignore[method-assign]
        self._engine_step = self.backend.step
        self.backend.step = self._timed_step  # type: ignore[method-assign]
        self.admit_seconds: Optional[float] = None
        self.step_seconds: Optional[float] = None
        self.report: Any = None
        self.waiting_at_admit = 0
        self.admitted_at_admit = 0
        self.running_after_admit = 0
        self.engine_requests = 0
        self.running = running
        self.waiting = waiting
        self._rng = random.Random(seed)
        self._next_id = 0
        self._topped_up = 0
        self._token_pool: Optional[List[int]] = None
        if kv_view == "radix":
            pool_rng = random.Random(seed + 1)
            self._token_pool = [pool_rng.randrange(5, 32000) for _ in range(TOKEN_POOL_SIZE)]

    def top_up(self) -> None:
        """Send new requests so that the router holds ``waiting`` once the next step delivers them."""
        missing = self.waiting - len(self.router) - self._topped_up
        for _ in range(missing):
            prompt_len = self._rng.randint(*PROMPT_RANGE)
            self.sim.add_arrival(
                SimArrival(
                    request_id=self._next_id,
                    arrival_s=self.sim.clock,
                    prompt_len=prompt_len,
                    output_len=self._rng.randint(*OUTPUT_RANGE),
                    request_class="overload",
                    prompt_ids=self._prompt_ids(prompt_len),
                )
            )
            self._next_id += 1
            self._topped_up += 1

    def _prompt_ids(self, prompt_len: int) -> Optional[Tuple[int, ...]]:
        """A real prompt for the radix KV view (None for the token count, which needs none)."""
        pool = self._token_pool
        if pool is None:
            return None
        start = self._rng.randrange(SYSTEM_PROMPT_LEN, len(pool) - prompt_len)
        if self._rng.random() < SHARED_PREFIX_FRACTION and prompt_len > SYSTEM_PROMPT_LEN:
            return tuple(pool[:SYSTEM_PROMPT_LEN] + pool[start : start + prompt_len - SYSTEM_PROMPT_LEN])
        return tuple(pool[start : start + prompt_len])

    def _timed_admit(self, *args: Any, **kwargs: Any) -> Any:
        self.waiting_at_admit = len(self.router)
        started = time.perf_counter()
        admitted = self._router_admit(*args, **kwargs)
        self.admit_seconds = time.perf_counter() - started
        self.admitted_at_admit = len(admitted)
        self.running_after_admit = len(self.router.running)
        return admitted

    def _timed_step(self) -> Any:
        self.engine_requests = len(self.backend.requests)
        self.executor.spent = 0.0
        started = time.perf_counter()
        self.report = self._engine_step()
        self.step_seconds = time.perf_counter() - started - self.executor.spent
        return self.report

    def step(self) -> tuple[float, float, float]:
        """One simulated step; returns the admit, schedule and step (minus executor) seconds."""
        self.top_up()
        self.admit_seconds = self.step_seconds = None
        self.sim.step()
        self._topped_up = 0  # the step delivered them
        admit_s = self.admit_seconds or 0.0
        if self.step_seconds is None:
            return admit_s, 0.0, 0.0
        return admit_s, self.report.schedule_seconds, self.step_seconds

    def take_in(self) -> float:
        """Untimed steps until an admission round has admitted a request; returns that round's seconds.

        Run after raising ``waiting``: that round is the first admission decision since the raise,
        which takes in every request added meanwhile (see the module docstring), so the steps
        timed after it are the steady state.  Returns 0 at once when the router stays empty.
        """
        for _ in range(MAX_INTAKE_STEPS):
            admit_s, _, _ = self.step()
            if not len(self.router) or (self.admit_seconds is not None and self.admitted_at_admit):
                return admit_s
        raise RuntimeError(f"no request was admitted in {MAX_INTAKE_STEPS} steps")

    def counts(self) -> tuple[int, int]:
        """``(decoding, prefilling)``: running requests decoding, and the others (prefill or waiting for it)."""
        decoding = sum(1 for req in self.backend.requests.values() if req.state is ReqState.DECODING)
        return decoding, len(self.backend.requests) - decoding


def measure_server(
    strategy: str,
    running: int,
    waiting_sizes: Sequence[int] = DEFAULT_WAITING,
    *,
    warmup_steps: int = 2500,
    repeats: int = 30,
    seed: int = 0,
    kv_view: str = "count",
) -> List[ServerCostRow]:
    """Warm one layout up, then at each router size (ascending) run the intake and time ``repeats`` steps."""
    if repeats < 1 or warmup_steps < 0:
        raise ValueError(f"repeats must be >= 1 and warmup_steps >= 0, got {repeats} and {warmup_steps}")
    sizes = sorted(waiting_sizes)
    if not sizes or sizes[0] < 0:
        raise ValueError(f"waiting sizes must be >= 0, got {list(waiting_sizes)}")
    layout = ServerLayout(strategy, running, sizes[0], seed=seed, kv_view=kv_view)
    for _ in range(warmup_steps):
        layout.step()
    rows: List[ServerCostRow] = []
    for size in sizes:
        layout.waiting = size
        intake_admit_s = layout.take_in()
        decoding, prefilling = layout.counts()
        admit: List[float] = []
        schedule: List[float] = []
        step: List[float] = []
        for _ in range(repeats):
            admit_s, schedule_s, step_s = layout.step()
            admit.append(admit_s)
            schedule.append(schedule_s)
            step.append(step_s)
        rows.append(
            ServerCostRow(
                strategy=strategy,
                waiting=size,
                running=running,
                kv_view=kv_view,
                decoding=decoding,
                prefilling=prefilling,
                admit_ms=statistics.median(admit) * 1e3,
                admit_max_ms=max(admit) * 1e3,
                intake_admit_ms=intake_admit_s * 1e3,
                schedule_ms=statistics.median(schedule) * 1e3,
                schedule_max_ms=max(schedule) * 1e3,
                step_ms=statistics.median(step) * 1e3,
                step_max_ms=max(step) * 1e3,
                repeats=repeats,
            )
        )
    return rows


def run_server(
    waiting_sizes: Sequence[int] = DEFAULT_WAITING,
    running_sizes: Sequence[int] = DEFAULT_RUNNING,
    strategies: Optional[Sequence[str]] = None,
    *,
    warmup_steps: int = 2500,
    repeats: int = 30,
    seed: int = 0,
    kv_view: str = "count",
) -> List[ServerCostRow]:
    """Measure every strategy (all registered ones by default) at every running and waiting size."""
    names = list(strategies) if strategies else available_strategy_names()
    rows: List[ServerCostRow] = []
    for name in names:
        for running in running_sizes:
            rows.extend(
                measure_server(
                    name,
                    running,
                    waiting_sizes,
                    warmup_steps=warmup_steps,
                    repeats=repeats,
                    seed=seed,
                    kv_view=kv_view,
                )
            )
    return rows


def server_markdown_table(rows: Sequence[ServerCostRow]) -> str:
    """One line per strategy and layout: median / max ms per step of each timed part."""
    lines = [
        "| strategy | KV view | waiting (router) | running (engine) | decoding / prefilling | router admit (ms) | "
        "schedule (ms) | step minus forward (ms) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        lines.append(
            f"| {row.strategy} | {row.kv_view} | {row.waiting} | {row.running} | {row.decoding} / {row.prefilling} | "
            f"{row.admit_ms:.3f} / {row.admit_max_ms:.3f} | {row.schedule_ms:.2f} / {row.schedule_max_ms:.2f} | "
            f"{row.step_ms:.2f} / {row.step_max_ms:.2f} |"
        )
    return "\n".join(lines)


def _rank_kv_view(capacity: int, running: int) -> InferenceContext:
    """A model rank's KV view over ``capacity`` token slots of one float each (the step never reads them)."""
    max_len = PROMPT_RANGE[1] + OUTPUT_RANGE[1] + 1
    return InferenceContext(KVCacheMemoryManager(capacity, 1, 1, 1, torch.float32), ReqManager(running + 1, max_len))
