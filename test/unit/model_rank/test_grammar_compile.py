"""Grammar compiles on a model rank: cached per grammar, on a thread, and a constrained request held
out of the steps until rank 0 marks its grammar ready, in process with the tiny model and llguidance.

A test that must see a compile not yet finished occupies the one compile thread with a job that
waits for an event (``_busy``): nothing depends on how long a compile takes.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

import jsonschema
import pytest
import torch

from lightllm.benchmark.simulator.cost_executor import CostModelExecutor
from lightllm.benchmark.simulator.cost_model import load_profile
from lightllm.common.req_manager import ReqManager
from lightllm.common.sampling import SamplingParams
from lightllm.common.sampling.sampler import Sampler
from lightllm.models.registry import load_model
from lightllm.server.core.objs.finish_status import FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.http.structured.response_format import response_format_grammar
from lightllm.server.http.structured.structured_params import structured_grammar
from lightllm.server.model_rank.execution.grammar_compiler import GrammarCompiler
from lightllm.server.model_rank.execution.rank_backend import build_rank_backend
from lightllm.server.model_rank.execution.structured_output import GrammarConstraints
from lightllm.server.model_rank.kv_cache.infer_context import InferenceContext
from lightllm.server.model_rank.rank_process import IDLE_POLL_MS, GrammarsReady, ModelRank
from lightllm.server.model_rank.scheduling.backend_registry import build_backend
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.kv_view import TokenCountKvView
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import build_prefill_queue_strategy
from lightllm.server.model_rank.scheduling.request_state import ReqState
from lightllm.server.model_rank.scheduling.step_planner import StepPlan, StepPlanner
from lightllm.server.model_rank.scheduling.step_report import StepReport
from lightllm.utils.daemon_workers import DaemonWorkers
from lightllm.utils.tokenizer_utils import load_tokenizer

from grammar_test_support import run_releasing_grammars

SCHEMA = {"type": "object", "properties": {"flag": {"type": "boolean"}, "pick": {"enum": ["a", "b"]}},
          "required": ["flag", "pick"], "additionalProperties": False}
GRAMMAR = response_format_grammar({"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}})
FREE = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
WAIT_SECONDS = 60  # a compile that has not ended by then is a hang


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype=torch.float32)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return load_tokenizer(str(tiny_llama_dir))


def _backend(model: Any, grammar: GrammarConstraints) -> Any:
    context = InferenceContext(model.new_kv_cache(4096), ReqManager(16, 600), use_prefix_cache=True)
    return build_rank_backend("normal", model, context, build_prefill_queue_strategy("default"), StepPlanner(64, 32),
                              Sampler(0), [2], 600, grammar=grammar)


def _constrained(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_new_tokens=40, grammar=GRAMMAR)


def _assert_valid(tokenizer: Any, output: list) -> None:
    jsonschema.validate(json.loads(tokenizer.decode(output, skip_special_tokens=True)), SCHEMA)


@contextmanager
def _busy(workers: DaemonWorkers) -> Iterator[None]:
    """The compile thread runs a job that waits until the block ends: compiles queue behind it."""
    gate = threading.Event()
    workers.submit(gate.wait)
    try:
        yield
    finally:
        gate.set()


def _wait_compiled(backend: Any, request_id: int) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while request_id not in backend.grammars_compiled()[0]:
        assert time.monotonic() < deadline, f"request {request_id}'s grammar never compiled"
        time.sleep(0.01)


# --- the compile cache ----------------------------------------------------------------------------
def test_the_requests_of_one_grammar_share_one_compile_and_each_gets_its_own_matcher(model, tokenizer):
    """n choices of a request are n requests of one grammar: compiled once; each advances its own copy
    (with one matcher shared, four rows consuming their tokens into it would break the JSON)."""
    constraints = GrammarConstraints(lambda: tokenizer)
    backend = _backend(model, constraints)
    prompt = tokenizer("Give me JSON")["input_ids"]
    for request_id in range(1, 5):
        backend.add_request(request_id, RequestSpec(prompt, _constrained(seed=request_id)))
    outputs, statuses = run_releasing_grammars(backend)
    assert constraints.compiler.builds == 1
    assert len({tuple(output) for output in outputs.values()}) > 1  # the seeds took different paths
    for request_id in range(1, 5):
        assert statuses[request_id] == FINISH_STOP
        _assert_valid(tokenizer, outputs[request_id])
    # A later request with the same schema (the same tool set or response format) compiles nothing.
    backend.add_request(5, RequestSpec(prompt, _constrained(seed=5)))
    outputs, statuses = run_releasing_grammars(backend)
    assert statuses[5] == FINISH_STOP and constraints.compiler.builds == 1


def test_distinct_grammars_compile_apart_and_the_least_recently_used_is_evicted_first(tokenizer):
    compiler = GrammarConstraints(lambda: tokenizer, cache_size=2).compiler
    a, b, c = (structured_grammar({"regex": pattern}, {}, None) for pattern in ("a+", "b+", "c+"))
    first_a, first_b = compiler.compile(a), compiler.compile(b)
    assert first_a is not first_b and compiler.builds == 2
    assert compiler.compile(a) is first_a and compiler.builds == 2  # a is now the most recently used
    compiler.compile(c)
    assert compiler.builds == 3 and len(compiler) == 2 and a in compiler and b not in compiler
    again_b = compiler.compile(b)  # evicted: compiled again, and a (least recent now) goes
    assert again_b is not first_b and compiler.builds == 4 and b in compiler and a not in compiler
    for future in (first_a, again_b):
        assert not future.result(timeout=WAIT_SECONDS).is_error()
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        GrammarConstraints(lambda: tokenizer, cache_size=0)


def test_a_compile_is_cancelled_only_once_no_request_waits_for_it_and_only_before_it_runs():
    """Two requests of a grammar wait for one compile: the first leaving cancels nothing; the last
    leaving cancels it while it is queued (the thread never runs it), not once it has started."""
    workers = DaemonWorkers(1, "test-grammar")
    built, started, finish = [], threading.Event(), threading.Event()

    def build(grammar: str) -> str:
        built.append(grammar)
        if grammar == "slow":
            started.set()
            finish.wait(WAIT_SECONDS)
        return grammar.upper()

    compiler = GrammarCompiler(build, workers=workers)
    with _busy(workers):
        queued = compiler.acquire("queued")
        assert compiler.acquire("queued") is queued
        compiler.release("queued", queued)
        assert not queued.cancelled() and "queued" in compiler
        compiler.release("queued", queued)
        assert queued.cancelled() and "queued" not in compiler and compiler.cancelled == 1
        slow = compiler.acquire("slow")
    assert started.wait(WAIT_SECONDS)
    compiler.release("slow", slow)  # running: it goes on, and its template stays cached
    finish.set()
    assert slow.result(WAIT_SECONDS) == "SLOW" and compiler.cancelled == 1
    assert compiler.acquire("slow") is slow
    again = compiler.acquire("queued")  # cancelled earlier: compiled anew, cleanly
    assert again is not queued and again.result(WAIT_SECONDS) == "QUEUED"
    assert built == ["slow", "queued"] and compiler.builds == 3


def test_tensor_parallel_ranks_keep_every_compile_they_took_in():
    """Under TP whether a compile has started is each rank's own timing: one rank cancelling a compile
    another had cached left the next request of that grammar compiling in the lagging rank's step
    while every rank waited.  With cancel_abandoned off, a compile nobody waits for still runs and
    stays cached."""
    workers = DaemonWorkers(1, "test-grammar-tp")
    compiler = GrammarCompiler(lambda grammar: grammar.upper(), workers=workers, cancel_abandoned=False)
    with _busy(workers):
        queued = compiler.acquire("queued")
        compiler.release("queued", queued)
        assert not queued.cancelled() and "queued" in compiler
    assert queued.result(WAIT_SECONDS) == "QUEUED" and compiler.cancelled == 0
    assert compiler.acquire("queued") is queued and compiler.builds == 1


# --- the hold -------------------------------------------------------------------------------------
def test_a_constrained_request_waits_for_grammars_ready_while_a_free_one_runs(model, tokenizer):
    workers = DaemonWorkers(1, "test-grammar")
    backend = _backend(model, GrammarConstraints(lambda: tokenizer, workers=workers))
    prompt = tokenizer("Give me JSON")["input_ids"]
    with _busy(workers):
        backend.add_request(1, RequestSpec(prompt, FREE))
        backend.add_request(2, RequestSpec(prompt, _constrained(seed=1)))
        free_tokens = []
        while 1 in backend.requests:  # the free request runs to its end meanwhile
            assert backend.grammars_compiled() == ([], [])
            report = backend.step()
            assert 2 not in {req.request_id for req in report.ordered}
            free_tokens += [token for req, token, _ in report.tokens if req.request_id == 1]
        assert len(free_tokens) == FREE.max_new_tokens
        assert backend.requests[2].output_ids == [] and backend.requests[2].cur_kv_len == 0
    _wait_compiled(backend, 2)
    # Compiled on this rank, but rank 0's command releases it, not the compile: still held.
    for _ in range(3):
        assert not backend.step().ordered
    backend.grammars_ready([2])
    outputs, statuses = run_releasing_grammars(backend)
    assert statuses[2] == FINISH_STOP
    _assert_valid(tokenizer, outputs[2])


def test_an_abort_releases_a_held_request_and_cancels_the_compile_no_one_waits_for(model, tokenizer):
    """Compiles of requests that left (clients gone) must not hold up the one compile thread: a queued
    compile whose last waiter leaves is cancelled and uncached, and the grammar compiles anew later."""
    workers = DaemonWorkers(1, "test-grammar")
    constraints = GrammarConstraints(lambda: tokenizer, workers=workers)
    backend = _backend(model, constraints)
    prompt = tokenizer("Give me JSON")["input_ids"]
    abandoned = [structured_grammar({"regex": f"{letter}+"}, {}, None) for letter in "wxyz"]
    with _busy(workers):
        backend.add_request(1, RequestSpec(prompt, _constrained(seed=1)))
        backend.add_request(2, RequestSpec(prompt, _constrained(seed=2)))  # the same grammar: one compile
        for request_id, grammar in enumerate(abandoned, start=3):
            backend.add_request(request_id, RequestSpec(prompt, SamplingParams(max_new_tokens=4, grammar=grammar)))
        assert not backend.step().did_work
        backend.abort(1)
        backend.step()
        assert constraints.compiler.cancelled == 0 and GRAMMAR in constraints.compiler  # request 2 still waits
        for request_id in range(2, 7):
            backend.abort(request_id)
        report = backend.step()
        assert sorted((req.request_id, status) for req, status in report.finished) == \
            [(request_id, FINISH_ABORT) for request_id in range(2, 7)]
        assert not backend.has_work and constraints.compiled([2]) == ([2], [])  # nothing of it is left waiting
        assert constraints.compiler.cancelled == 5 and len(constraints.compiler) == 0
        # A request arriving now is the next in line: none of the five compiles will run before it.
        backend.add_request(7, RequestSpec(prompt, _constrained(seed=7)))
    outputs, statuses = run_releasing_grammars(backend)
    assert statuses[7] == FINISH_STOP and constraints.compiler.builds == 6
    _assert_valid(tokenizer, outputs[7])


def test_a_compile_that_raises_ends_its_request_alone_with_a_server_error_then_compiles_again(model, tokenizer, caplog):
    loads = []

    def tokenizer_once_unreadable() -> Any:
        loads.append(1)
        if len(loads) == 1:
            raise OSError("tokenizer.json went away")
        return tokenizer

    constraints = GrammarConstraints(tokenizer_once_unreadable)
    backend = _backend(model, constraints)
    prompt = tokenizer("Give me JSON")["input_ids"]
    backend.add_request(1, RequestSpec(prompt, FREE))
    backend.add_request(2, RequestSpec(prompt, _constrained(seed=1)))
    with caplog.at_level("WARNING", logger="lightllm.structured_output"):
        outputs, statuses = run_releasing_grammars(backend)
    assert statuses[1] == FINISH_LENGTH and len(outputs[1]) == FREE.max_new_tokens
    # The server's fault, not the grammar's (llguidance reports a bad grammar without raising):
    # FINISH_ERROR, the client's 500 generation_failed, not FINISH_GRAMMAR_FAILED's 400.
    assert statuses[2] == FINISH_ERROR and outputs[2] == []
    assert "request 2: its structured-output grammar could not be compiled on this rank (tokenizer.json went away)" \
        in caplog.text
    # A failed compile is not cached: the next request of the grammar compiles it again, and runs.
    backend.add_request(3, RequestSpec(prompt, _constrained(seed=3)))
    outputs, statuses = run_releasing_grammars(backend)
    assert statuses[3] == FINISH_STOP and constraints.compiler.builds == 2
    _assert_valid(tokenizer, outputs[3])


def test_a_paused_request_rejoins_while_only_a_held_one_is_left():
    """A held request runs nothing: beside it alone a paused request rejoins as soon as the cache
    holds it, as with nothing running, instead of waiting for a departure until the held one has run."""
    backend = build_backend("normal")(CostModelExecutor(load_profile("h100_qwen_0p8b")), TokenCountKvView(600),
                                      build_prefill_queue_strategy("default"), StepPlanner(128, 128), [], 600)
    paused = InferReq(1, [0] * 100, max_new_tokens=50)
    backend.join(paused)
    backend.step()
    assert paused.state is ReqState.DECODING
    backend.pause_starved(StepPlan(kv_starved_decode=[paused]), StepReport())
    assert paused.state is ReqState.PAUSED
    held = InferReq(2, [0] * 10, sampling=SamplingParams(max_new_tokens=4, grammar=GRAMMAR))
    backend.join(held)
    assert held.grammar_held
    assert backend.resume_paused() == [paused]


def test_the_mask_does_without_llguidance_torch(model, tokenizer, monkeypatch):
    """Importing llguidance.torch imports torch.compile's machinery (4 s measured), which the first
    constrained request of a rank paid in its step; the mask fills numpy bitmasks instead."""
    monkeypatch.setitem(sys.modules, "llguidance.torch", None)  # importing it now fails
    backend = _backend(model, GrammarConstraints(lambda: tokenizer))
    backend.add_request(1, RequestSpec(tokenizer("Give me JSON")["input_ids"], _constrained(seed=1)))
    outputs, statuses = run_releasing_grammars(backend)
    assert statuses[1] == FINISH_STOP
    _assert_valid(tokenizer, outputs[1])


# --- the rank loop --------------------------------------------------------------------------------
class _QuietInbox:
    """Rank 0's inbox with nothing in it; remembers each wait it was asked for."""

    def __init__(self) -> None:
        self.waits: list = []

    def poll(self, timeout_ms: int) -> bool:
        self.waits.append(timeout_ms)
        return False


def test_rank0_polls_while_a_grammar_compiles_then_sends_grammars_ready_at_once(model, tokenizer):
    """With only a held request live, rank 0 waits IDLE_POLL_MS per iteration (no spinning) and
    notices the finished compile; then it waits 0 and its command list releases the request (TP = 1)."""
    workers = DaemonWorkers(1, "test-grammar")
    backend = _backend(model, GrammarConstraints(lambda: tokenizer, workers=workers))
    inbox = _QuietInbox()
    rank = ModelRank(backend, None, is_leader=True, inbox=inbox)
    with _busy(workers):
        backend.add_request(1, RequestSpec(tokenizer("Give me JSON")["input_ids"], _constrained(seed=1)))
        for _ in range(2):
            assert rank.receive_commands() == []
            assert inbox.waits[-1] == IDLE_POLL_MS
            assert not backend.step().did_work
    _wait_compiled(backend, 1)
    commands = rank.receive_commands()
    assert inbox.waits[-1] == 0 and commands == [GrammarsReady([1])]
    rank.apply(commands)
    assert backend.step().did_work and backend.grammars_compiled() == ([], [])


def test_every_rank_releases_a_request_when_rank0_says_so_though_its_own_compile_still_runs(model, tokenizer):
    """A follower's own compile does not decide: it applies rank 0's GrammarsReady like rank 0 and
    plans the same steps; taking the matcher, it waits for its own compile (started at the same intake)."""
    follower_workers = DaemonWorkers(1, "test-grammar-follower")
    leader_backend = _backend(model, GrammarConstraints(lambda: tokenizer))
    follower_backend = _backend(model, GrammarConstraints(lambda: tokenizer, workers=follower_workers))
    leader = ModelRank(leader_backend, None, is_leader=True, inbox=_QuietInbox())
    follower = ModelRank(follower_backend, None, is_leader=False)
    prompt = tokenizer("Give me JSON")["input_ids"]
    gate = threading.Event()
    follower_workers.submit(gate.wait)  # the follower's compile queues behind this
    for backend in (leader_backend, follower_backend):
        backend.add_request(1, RequestSpec(prompt, _constrained(seed=4)))
        backend.add_request(2, RequestSpec(prompt, FREE))
    outputs = {}
    try:
        for _ in range(2000):
            if not leader_backend.has_work:
                break
            commands = leader.receive_commands()
            if any(isinstance(command, GrammarsReady) for command in commands):
                assert follower_backend.grammars_compiled() == ([], [])  # the follower's compile has not run
                # Opened while the follower may be waiting for it in its step (or before): either way.
                threading.Timer(0.05, gate.set).start()
            for rank in (leader, follower):
                rank.apply(commands)
            reports = [backend.step() for backend in (leader_backend, follower_backend)]
            assert [[req.request_id for req in report.ordered] for report in reports] == \
                [[req.request_id for req in reports[0].ordered]] * 2
            assert [[(req.request_id, token) for req, token, _ in report.tokens] for report in reports] == \
                [[(req.request_id, token) for req, token, _ in reports[0].tokens]] * 2
            for req, _ in reports[0].finished:
                outputs[req.request_id] = list(req.output_ids)
            if not reports[0].did_work:
                time.sleep(0.001)
    finally:
        gate.set()
    assert not follower_backend.has_work and sorted(outputs) == [1, 2]
    _assert_valid(tokenizer, outputs[1])


def test_a_request_whose_join_fails_gives_its_compile_back():
    """The compile starts first in join; when attaching the request's KV then fails (the request is
    rejected), the compile loses that waiter, so it can still be cancelled and leaves no entry."""
    from lightllm.common.sampling import SamplingParams
    from lightllm.server.model_rank.scheduling.kv_view import TokenCountKvView
    from lightllm.server.model_rank.scheduling.prefill_queue_strategy import build_prefill_queue_strategy
    from lightllm.server.model_rank.scheduling.step_engine import StepEngine
    from lightllm.server.model_rank.scheduling.step_planner import StepPlanner
    from prefill_queue_test_support import NoForward, make_req

    class GrammarNoForward(NoForward):
        def __init__(self) -> None:
            self.started: list = []
            self.forgotten: list = []

        def start_grammar(self, req) -> None:
            self.started.append(req.request_id)

        def forget(self, req) -> None:
            self.forgotten.append(req.request_id)

    class FullRows(TokenCountKvView):
        def attach(self, req) -> None:
            raise RuntimeError("all request rows are in use")

    executor = GrammarNoForward()
    engine = StepEngine(executor, FullRows(1 << 10), build_prefill_queue_strategy("default"),
                        StepPlanner(batch_max_tokens=8), eos_token_ids=[], max_req_total_len=1 << 10)
    req = make_req(1, 4)
    req.sampling = SamplingParams(max_new_tokens=2, grammar='start: "a"')
    with pytest.raises(RuntimeError, match="request rows"):
        engine.join(req)
    assert executor.started == [1] and executor.forgotten == [1] and not engine.requests
