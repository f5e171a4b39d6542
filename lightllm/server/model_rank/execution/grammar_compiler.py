"""A model rank's compiled grammars: each distinct grammar compiled once, on a thread of its own.

Building an ``llguidance.LLMatcher`` compiles its grammar against the tokenizer: well under a
millisecond for most JSON schemas, 0.9 to 1.4 s for the costliest schema the HTTP process lets
through (an integer ``multipleOf`` near the limit of ``lightllm/server/http/structured/schema_cost.py``).
Built in the step, as matchers once were, that cost was paid once per request (each of ``n``
choices is a request of its own) while every other request waited for the step: an ``n=16``
request of ``multipleOf: 99991`` held a plain request sent during it for 20 s.

:class:`GrammarCompiler` keeps one *template* matcher per grammar text, which nothing ever
advances; each request gets ``template.deep_copy()`` (about 10 us: the copies share the compiled
grammar, so 16 of them take no more memory than one).  A compile runs on a daemon thread and its
template comes back in a ``Future``: llguidance releases the GIL while it builds, so a compile
overlaps the rank's forwards instead of stopping them, and the request it is for waits for it
(``StepEngine``'s grammar hold) while the others run.

The requests waiting for a compile are counted (:meth:`GrammarCompiler.acquire` and
:meth:`~GrammarCompiler.release`): a compile that no live request needs any more (its clients left)
and that has not started is cancelled and dropped from the cache, so the one compile thread does
not spend seconds on it while the compiles of requests still there queue behind.  Only with one
rank: whether a compile has started depends on each rank's own thread, so under tensor
parallelism one rank could cancel a compile another had started and cached; a request of that
grammar coming back would then be released by rank 0 (cached there) and compiled by the other
rank inside its step, with every rank waiting for it.  TP ranks therefore compile every grammar
they took in, in the same order.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import CancelledError, Future
from typing import Any, Callable, Dict, Optional

from lightllm.utils.daemon_workers import DaemonWorkers

# Distinct grammars kept compiled per rank.  A server sees few distinct grammars at a time (an
# application's response format or tool set, sent again with every request), so 32 keep every
# repeated one compiled; the bound is for memory: a typical schema's template takes well under a
# megabyte, the costliest schema the HTTP process accepts 15 to 35 MB (measured with llguidance
# 1.9), so 32 of those stay around a gigabyte of host memory.  A request keeps its own template
# alive while it runs, so evicting one never affects a running request.
GRAMMAR_CACHE_SIZE = 32
# One compile thread per rank: a compile is CPU work that releases the GIL, so one thread already
# takes it off the loop; more would take more cores from the rank's own forward and sampling
# threads on a host whose CPUs serve them (and the HTTP process's validation compiles).  Compiles
# run in arrival order, so grammars become ready in the order their requests came; the price is
# that a new grammar queued behind a costly one waits for it too (only its own request waits), and
# that compiles nobody waits for any more must be cancelled (GrammarCompiler.release).
COMPILE_THREADS = 1


def compile_error(future: Future) -> Optional[BaseException]:
    """The exception a finished compile raised, or None; waits for a compile still running.

    Read without re-raising it: a pyo3 ``PanicException`` (a ``BaseException``, as llguidance's Rust
    panics surface) is a failed compile like any other, and must not escape the rank's loop from
    wherever the future happens to be read.  A cancelled compile counts as failed (no request that
    reads it should have let it be cancelled).
    """
    if future.cancelled():
        return CancelledError()
    return future.exception()


class GrammarCompiler:
    """Grammar text -> compiled template matcher, LRU-bounded; compiles on a daemon thread.

    Args:
        build: compiles one grammar text into a template matcher (runs on the compile thread).
        capacity: distinct grammars kept (least recently asked for evicted first).
        workers: the thread(s) that compile; default: a pool of :data:`COMPILE_THREADS` of its own.

    :meth:`compile`, :meth:`acquire` and :meth:`release` are called from the rank's loop only, so
    the cache needs no lock; the futures it hands out are thread-safe (``Future.cancel`` and the
    compile thread's start of a job exclude each other).
    """

    def __init__(self, build: Callable[[str], Any], capacity: int = GRAMMAR_CACHE_SIZE,
                 workers: Optional[DaemonWorkers] = None, cancel_abandoned: bool = True) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._build = build
        self.capacity = capacity
        self._workers = workers if workers is not None else DaemonWorkers(COMPILE_THREADS, "lightllm-grammar")
        self._cache: "OrderedDict[str, Future]" = OrderedDict()
        # Live requests waiting for each compile (acquire .. release), by future: an evicted grammar
        # compiled again gets a new future, whose waiters must not be mixed with the old one's.
        self._waiters: Dict[Future, int] = {}
        # False under tensor parallelism (see the module docstring): every rank keeps every compile.
        self.cancel_abandoned = cancel_abandoned
        # Compiles started (cache misses) and cancelled before they ran, for tests and diagnostics.
        self.builds = 0
        self.cancelled = 0

    def compile(self, grammar: str) -> Future:
        """The future template of ``grammar``: the cached one (finished or still compiling), or a new compile.

        A compile that failed is not kept: the requests that asked for it meanwhile share its
        failure, a later one compiles again (a failure such as running out of memory may pass).
        """
        future = self._cache.get(grammar)
        if future is not None and not (future.done() and compile_error(future) is not None):
            self._cache.move_to_end(grammar)
            return future
        future = self._workers.submit(lambda: self._build(grammar))
        self.builds += 1
        self._cache[grammar] = future
        self._cache.move_to_end(grammar)
        while len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
        return future

    def acquire(self, grammar: str) -> Future:
        """:meth:`compile`, counting one more live request that waits for the compile until :meth:`release`."""
        future = self.compile(grammar)
        self._waiters[future] = self._waiters.get(future, 0) + 1
        return future

    def release(self, grammar: str, future: Future) -> None:
        """A request that took ``future`` from :meth:`acquire` no longer waits for it (it took its matcher, or left).

        When none waits any more and the compile has not started, it is cancelled (the compile
        thread skips it) and dropped from the cache: a later request of ``grammar`` compiles it
        anew.  A compile already running or finished stays cached for the next request.
        """
        left = self._waiters.get(future, 0) - 1
        if left > 0:
            self._waiters[future] = left
            return
        self._waiters.pop(future, None)
        if self.cancel_abandoned and future.cancel():  # False once the compile thread has taken it (or it ended)
            self.cancelled += 1
            if self._cache.get(grammar) is future:
                del self._cache[grammar]

    def __len__(self) -> int:
        return len(self._cache)

    def __contains__(self, grammar: object) -> bool:
        return grammar in self._cache
