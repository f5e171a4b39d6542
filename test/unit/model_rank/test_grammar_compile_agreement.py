"""Every TP rank ends a constrained request alike when a grammar compile or mask fails on one rank.

A leader and a follower backend run in lockstep as the TP loop runs them: the follower applies the
leader's command list, and its sampled tokens are the leader's (the token broadcast of a TP server,
played by :class:`_TokenBus`).  A compile that raises is a server fault that may hit one rank only
(its tokenizer file unreadable for a moment); rank 0's outcome must decide for every rank, or the
ranks run different batches and their collectives hang.  No test depends on how long a compile takes.
"""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch

from lightllm.benchmark.simulator.cost_executor import CostModelExecutor
from lightllm.benchmark.simulator.cost_model import load_profile
from lightllm.common.req_manager import ReqManager
from lightllm.common.sampling import SamplingParams
from lightllm.common.sampling.sampler import Sampler
from lightllm.models.registry import load_model
from lightllm.server.core.objs.io_messages import AddRequests
from lightllm.server.core.objs.finish_status import FINISH_ERROR, FINISH_LENGTH, FINISH_STOP
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.http.structured.response_format import response_format_grammar
from lightllm.server.model_rank.execution.rank_backend import build_rank_backend
from lightllm.server.model_rank.execution.structured_output import GrammarCompileFailed, GrammarConstraints
from lightllm.server.model_rank.kv_cache.infer_context import InferenceContext
from lightllm.server.model_rank.rank_process import GrammarsReady, ModelRank
from lightllm.server.model_rank.scheduling.backend_registry import build_backend
from lightllm.server.model_rank.scheduling.kv_view import TokenCountKvView
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import build_prefill_queue_strategy
from lightllm.server.model_rank.scheduling.step_planner import StepPlanner
from lightllm.utils.tokenizer_utils import load_tokenizer

SCHEMA = {"type": "object", "properties": {"flag": {"type": "boolean"}}, "required": ["flag"],
          "additionalProperties": False}
GRAMMAR = response_format_grammar({"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}})
CONSTRAINED = SamplingParams(temperature=0, max_new_tokens=20, grammar=GRAMMAR)
FREE = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
MAX_ITERATIONS = 5_000  # a run still going after this many loop iterations is a hang


class _Panic(BaseException):
    """Stands for pyo3's ``PanicException`` (a Rust panic in llguidance): a BaseException, not an Exception."""


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype=torch.float32)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return load_tokenizer(str(tiny_llama_dir))


class _QuietInbox:
    """Rank 0's inbox with nothing in it."""

    def poll(self, timeout_ms: int) -> bool:
        return False


class _TokenBus:
    """The TP token broadcast in one process: the leader's sampled tokens are the follower's."""

    def __init__(self) -> None:
        self._sent: "deque[torch.Tensor]" = deque()

    def leader(self, tokens: torch.Tensor) -> torch.Tensor:
        self._sent.append(tokens.clone())
        return tokens

    def follower(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._sent.popleft()


def _once_failing(tokenizer: Any, error: BaseException) -> Callable[[], Any]:
    """A tokenizer loader whose first call raises ``error`` (the file unreadable for a moment)."""
    calls: List[int] = []

    def load() -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise error
        return tokenizer

    return load


def _pair(model: Any, leader_grammar: GrammarConstraints, follower_grammar: GrammarConstraints) -> Tuple[Any, ...]:
    bus = _TokenBus()
    backends = []
    for grammar, sync in ((leader_grammar, bus.leader), (follower_grammar, bus.follower)):
        context = InferenceContext(model.new_kv_cache(4096), ReqManager(16, 600), use_prefix_cache=True)
        backends.append(build_rank_backend("normal", model, context, build_prefill_queue_strategy("default"),
                                           StepPlanner(64, 32), Sampler(0), [2], 600, token_sync=sync,
                                           grammar=grammar))
    leader = ModelRank(backends[0], None, is_leader=True, inbox=_QuietInbox())
    follower = ModelRank(backends[1], None, is_leader=False)
    return leader, follower, backends[0], backends[1]


def _add(backends: Tuple[Any, Any], request_id: int, prompt: List[int], params: SamplingParams) -> None:
    for backend in backends:
        backend.add_request(request_id, RequestSpec(prompt, params))


def _lockstep(leader: ModelRank, follower: ModelRank, commands_seen: List[Any]) -> Dict[int, Tuple[int, List[int]]]:
    """Run both ranks as the TP loop does until the leader has no work; every step must agree.
    Returns each finished request's ``(status, output)``; ``commands_seen`` gets every command."""
    finished: Dict[int, Tuple[int, List[int]]] = {}
    for _ in range(MAX_ITERATIONS):
        if not leader.backend.has_work:
            assert not follower.backend.has_work
            return finished
        commands = leader.receive_commands()
        commands_seen.extend(commands)
        for rank in (leader, follower):
            rank.apply(commands)
        reports = [leader.backend.step()]
        reports.append(follower.backend.step())
        views = [([req.request_id for req in report.ordered],
                  [(req.request_id, token) for req, token, _ in report.tokens],
                  [(req.request_id, status) for req, status in report.finished]) for report in reports]
        assert views[1] == views[0]
        for req, status in reports[0].finished:
            finished[req.request_id] = (status, list(req.output_ids))
    raise AssertionError(f"still running after {MAX_ITERATIONS} iterations")


@pytest.mark.parametrize("error", [OSError("tokenizer.json went away"), _Panic("rust panicked")],
                         ids=["exception", "panic"])
def test_a_compile_that_raises_on_rank0_ends_the_request_with_a_server_error_on_every_rank(model, tokenizer, error):
    """Rank 0's outcome decides: GrammarsReady lists the request as failed and every rank finishes it
    with FINISH_ERROR (the client's 500: the server's fault, not the grammar's) in the same step, while
    the follower's own compile succeeded; a panic (a BaseException) is such a failure too, not the end
    of the rank.  The free request beside it runs on; the grammar compiles again for a later request."""
    leader, follower, *backends = _pair(model, GrammarConstraints(_once_failing(tokenizer, error)),
                                        GrammarConstraints(lambda: tokenizer))
    prompt = tokenizer("Give me JSON")["input_ids"]
    _add(backends, 1, prompt, CONSTRAINED)
    _add(backends, 2, prompt, FREE)
    commands: List[Any] = []
    finished = _lockstep(leader, follower, commands)
    assert [command for command in commands if isinstance(command, GrammarsReady)] == [GrammarsReady([], [1])]
    assert finished[1] == (FINISH_ERROR, []) and finished[2][0] == FINISH_LENGTH
    _add(backends, 3, prompt, CONSTRAINED)
    finished = _lockstep(leader, follower, [])
    assert finished[3][0] == FINISH_STOP and backends[0].executor.grammar.compiler.builds == 2


def test_a_compile_that_raises_on_a_follower_only_stops_that_rank_instead_of_running_apart(model, tokenizer):
    """Rank 0 compiled the grammar and released the request: the follower, whose own compile raised,
    cannot follow rank 0's tokens under it.  It used to finish the request alone while rank 0 ran it
    (different batches from then on: a hang in the next collective); now it stops, as a TP rank
    whose forward fails does."""
    leader, follower, *backends = _pair(model, GrammarConstraints(lambda: tokenizer),
                                        GrammarConstraints(_once_failing(tokenizer, OSError("transient read error"))))
    prompt = tokenizer("Give me JSON")["input_ids"]
    _add(backends, 1, prompt, CONSTRAINED)
    _add(backends, 2, prompt, FREE)
    commands: List[Any] = []
    with pytest.raises(GrammarCompileFailed, match="request 1: .* could not be compiled on this rank .*transient"):
        _lockstep(leader, follower, commands)
    assert [command for command in commands if isinstance(command, GrammarsReady)] == [GrammarsReady([1], [])]


@pytest.mark.parametrize("broken", ["leader", "follower"])
def test_a_mask_that_raises_on_one_rank_is_decided_by_rank0(model, tokenizer, monkeypatch, broken):
    """A mask that raises fails the batch's constrained requests; the failure travels as rank 0's
    failed-row token, so where rank 0's mask broke every rank fails them alike, and a follower whose
    mask alone broke stops (it would otherwise fail them alone while rank 0 runs them)."""
    grammars = {side: GrammarConstraints(lambda: tokenizer) for side in ("leader", "follower")}

    def raising_mask(logits: torch.Tensor, reqs: List[Any]) -> Any:
        raise ValueError("mask broke")

    monkeypatch.setattr(grammars[broken], "mask", raising_mask)
    leader, follower, *backends = _pair(model, grammars["leader"], grammars["follower"])
    prompt = tokenizer("Give me JSON")["input_ids"]
    _add(backends, 1, prompt, CONSTRAINED)
    _add(backends, 2, prompt, FREE)
    if broken == "follower":
        with pytest.raises(RuntimeError, match="request 1: the structured-output mask failed on this rank but not"):
            _lockstep(leader, follower, [])
        return
    finished = _lockstep(leader, follower, [])
    assert finished[1] == (FINISH_ERROR, []) and finished[2][0] == FINISH_LENGTH


class _UnstartableGrammars(CostModelExecutor):
    """An executor whose grammar compiles cannot start (no thread to run them, say)."""

    def start_grammar(self, req: Any) -> None:
        raise RuntimeError("can't start new thread")


def test_a_request_whose_compile_cannot_start_is_rejected_and_leaves_no_live_request():
    """The join registered the request before starting its compile: when that raised, the rank
    rejected the request but kept it live (held forever, and counted by has_work)."""
    backend = build_backend("normal")(_UnstartableGrammars(load_profile("h100_qwen_0p8b")), TokenCountKvView(600),
                                      build_prefill_queue_strategy("default"), StepPlanner(128, 128), [], 600)
    spec = RequestSpec([0] * 10, SamplingParams(max_new_tokens=4, grammar=GRAMMAR))
    records = SimpleNamespace(read_request=lambda shm_index, request_id: spec)  # the shared-memory records
    ModelRank(backend, records, is_leader=False).apply([AddRequests([(1, 0)])])
    assert backend.requests == {}
    assert [(req.request_id, status) for req, status in backend.step().finished] == [(1, FINISH_ERROR)]
    assert not backend.has_work
