"""A model rank's compiled grammars: each distinct grammar compiled once, on a thread of its own.

Building an ``llguidance.LLMatcher`` compiles its grammar against the tokenizer: well under a
millisecond for most JSON schemas, 0.9 to 1.4 s for the costliest schema the HTTP process lets
through (an integer ``multipleOf`` near the limit of ``lightllm/server/http/schema_cost.py``).
Built in the step, as matchers once were, that cost was paid once per request (each of ``n``
choices is a request of its own) while every other request waited for the step: an ``n=16``
request of ``multipleOf: 99991`` held a plain request sent during it for 20 s.

:class:`GrammarCompiler` keeps one *template* matcher per grammar text, which nothing ever
advances; each request gets ``template.deep_copy()`` (about 10 us: the copies share the compiled
grammar, so 16 of them take no more memory than one).  A compile runs on a daemon thread and its
template comes back in a ``Future``: llguidance releases the GIL while it builds, so a compile
overlaps the rank's forwards instead of stopping them, and the request it is for waits for it
(``StepEngine``'s grammar hold) while the others run.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future
from typing import Any, Callable, Optional

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
# that a new grammar queued behind a costly one waits for it too (only its own request waits).
COMPILE_THREADS = 1


class GrammarCompiler:
    """Grammar text -> compiled template matcher, LRU-bounded; compiles on a daemon thread.

    Args:
        build: compiles one grammar text into a template matcher (runs on the compile thread).
        capacity: distinct grammars kept (least recently asked for evicted first).
        workers: the thread(s) that compile; default: a pool of :data:`COMPILE_THREADS` of its own.

    :meth:`compile` is called from the rank's loop only, so the cache needs no lock; the futures
    it hands out are thread-safe.
    """

    def __init__(self, build: Callable[[str], Any], capacity: int = GRAMMAR_CACHE_SIZE,
                 workers: Optional[DaemonWorkers] = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._build = build
        self.capacity = capacity
        self._workers = workers if workers is not None else DaemonWorkers(COMPILE_THREADS, "lightllm-grammar")
        self._cache: "OrderedDict[str, Future]" = OrderedDict()
        # Compiles started (cache misses), for tests and diagnostics.
        self.builds = 0

    def compile(self, grammar: str) -> Future:
        """The future template of ``grammar``: the cached one (finished or still compiling), or a new compile.

        A compile that failed is not kept: the requests that asked for it meanwhile share its
        failure, a later one compiles again (a failure such as running out of memory may pass).
        """
        future = self._cache.get(grammar)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(grammar)
            return future
        future = self._workers.submit(lambda: self._build(grammar))
        self.builds += 1
        self._cache[grammar] = future
        self._cache.move_to_end(grammar)
        while len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
        return future

    def __len__(self) -> int:
        return len(self._cache)

    def __contains__(self, grammar: object) -> bool:
        return grammar in self._cache
