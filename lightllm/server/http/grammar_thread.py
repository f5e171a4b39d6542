"""The HTTP process's thread for structured-output grammar checks, apart from the tokenizer threads.

Checking a grammar before admission (:mod:`lightllm.server.http.response_format`) builds an
llguidance matcher, which for some schemas takes a second or more (``{"type": "integer",
"multipleOf": 99991}``: 0.5 s on a 2-core VM).  On the tokenizer threads such checks queued every
prompt behind them: twelve costly grammars sent at once held a plain 2-token request for 13 s and
``/tokenize`` for 4 s.  Here they queue only behind each other, on one thread (like the model rank's
one compile thread: the cores belong to the model), and a grammar checked before is not checked
again (``response_format``'s cache).  A client that leaves takes its queued check with it (the
job's future is cancelled, :class:`~lightllm.utils.daemon_workers.DaemonWorkers` skips it).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

from lightllm.server.http.response_format import response_format_grammar
from lightllm.server.http.structured_params import structured_grammar, usable_grammar
from lightllm.utils.daemon_workers import DaemonWorkers

if TYPE_CHECKING:
    from lightllm.server.http.tool_calls.request import ToolPlan

T = TypeVar("T")

GRAMMAR_THREADS = 1

# One pool per process, as the tokenizer threads' (tests build many apps).
_WORKERS = DaemonWorkers(GRAMMAR_THREADS, "lightllm-grammar")


async def on_grammar_thread(job: Callable[[], T]) -> T:
    """``job()`` (a request's grammar: built from its fields and checked) run on the grammar thread."""
    return await asyncio.wrap_future(_WORKERS.submit(job))


async def openai_request_grammar(manager: Any, body: Any, tool_plan: Optional["ToolPlan"] = None) -> Optional[str]:
    """The checked grammar an OpenAI request asks for (its structured-output fields, or the forced call
    of ``tool_plan``), or None; 400 naming the field that asked for an unusable one.

    Built on the grammar thread only when something asks for one: a plain request must not wait
    behind other clients' costly checks for the answer None.
    """

    def build() -> Optional[str]:
        grammar = structured_grammar(body.structured_outputs, body.guided_fields(),
                                     response_format_grammar(body.response_format))
        forced = tool_plan is not None and tool_plan.grammar is not None
        if tool_plan is not None:
            grammar = tool_plan.combine_grammar(grammar)
        return usable_grammar(manager, grammar, "tool_choice" if forced else body.structured_output_param())

    asks = (body.structured_outputs is not None or body.response_format is not None
            or any(value is not None for value in body.guided_fields().values())
            or (tool_plan is not None and tool_plan.grammar is not None))
    return await on_grammar_thread(build) if asks else build()
