"""The HTTP process's thread for structured-output grammar checks, apart from the tokenizer threads.

Checking a grammar before admission (:mod:`lightllm.server.http.structured.response_format`) builds an
llguidance matcher, which for some schemas takes a second or more (``{"type": "integer",
"multipleOf": 99991}``: 0.5 s on a 2-core VM).  On the tokenizer threads such checks queued every
prompt behind them: twelve costly grammars sent at once held a plain 2-token request for 13 s and
``/tokenize`` for 4 s.  Here they queue only behind each other, on one thread (like the model rank's
one compile thread: the cores belong to the model), and a grammar checked before is not checked
again (``response_format``'s cache).  A client that leaves takes its queued check with it: while
a request waits its turn it watches its connection, and a gone client's job is cancelled
(:class:`~lightllm.utils.daemon_workers.DaemonWorkers` skips it).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

from lightllm.server.http.generation.client_presence import result_unless_gone
from lightllm.server.http.errors import client_closed_request
from lightllm.server.http.structured.response_format import response_format_grammar
from lightllm.server.http.structured.structured_params import STRUCTURED_KINDS, structured_grammar, usable_grammar
from lightllm.utils.daemon_workers import DaemonWorkers

if TYPE_CHECKING:
    from lightllm.server.http.openai.tool_calls.request import ToolPlan

T = TypeVar("T")

GRAMMAR_THREADS = 1

# One pool per process, as the tokenizer threads' (tests build many apps).
_WORKERS = DaemonWorkers(GRAMMAR_THREADS, "lightllm-grammar")


# How often a request waiting for the grammar thread looks whether its client is still there.
DISCONNECT_POLL_SECONDS = 0.25


async def on_grammar_thread(job: Callable[[], T], request: Any = None) -> T:
    """``job()`` (a request's grammar: built from its fields and checked) run on the grammar thread.

    ``request`` (the client's connection): while the job waits its turn, a client that leaves
    takes it off the queue (a 499 for the gone client), so abandoned costly checks do not hold
    up the grammars of clients still waiting.  A job already running finishes (it cannot be
    stopped); its result is dropped.
    """
    future = _WORKERS.submit(job)
    waiting = asyncio.wrap_future(future)
    if request is None:
        return await waiting
    done, result = await result_unless_gone(waiting, request, DISCONNECT_POLL_SECONDS)
    if not done:
        future.cancel()  # the job itself: skipped if it is still queued
        raise client_closed_request()
    return result


def _forces_a_call(body: Any) -> bool:
    """Whether ``tool_choice`` forces a call (``required``, a named function), whose tools' schemas compile."""
    return body.tools is not None and (body.tool_choice == "required" or isinstance(body.tool_choice, dict))


def _asks_structured_output(body: Any) -> bool:
    """Whether the request's structured-output fields ask for a grammar (``response_format`` text does not)."""
    response_format = body.response_format
    structured = body.structured_outputs
    # Only a kind compiles: options alone (or null kinds) are refused at once, inline.
    return ((isinstance(structured, dict) and any(structured.get(kind) is not None for kind in STRUCTURED_KINDS))
            or any(value is not None for value in body.guided_fields().values())
            or (isinstance(response_format, dict) and response_format.get("type") != "text"))


async def planned_tool_calls(manager: Any, body: Any, parser_name: Optional[str], request: Any = None) -> "ToolPlan":
    """The chat request's :class:`ToolPlan`: on the grammar thread when it forces a call (its grammar
    compiles there, and is checked usable in the same job), inline otherwise (nothing compiles)."""
    from lightllm.server.http.openai.tool_calls.request import plan_tool_calls

    if not _forces_a_call(body):
        return plan_tool_calls(body, parser_name)

    def plan() -> "ToolPlan":
        tool_plan = plan_tool_calls(body, parser_name)
        usable_grammar(manager, tool_plan.grammar, "tool_choice")
        return tool_plan

    return await on_grammar_thread(plan, request)


async def openai_request_grammar(manager: Any, body: Any, tool_plan: Optional["ToolPlan"] = None,
                                 request: Any = None) -> Optional[str]:
    """The checked grammar an OpenAI request asks for (its structured-output fields, or the forced call
    of ``tool_plan``), or None; 400 naming the field that asked for an unusable one.

    Built on the grammar thread only when a structured-output field asks for one: a plain request
    must not wait behind other clients' costly checks for the answer None, nor a forced call, whose
    grammar :func:`planned_tool_calls` checked already.
    """

    def build() -> Optional[str]:
        grammar = structured_grammar(body.structured_outputs, body.guided_fields(),
                                     response_format_grammar(body.response_format))
        forced = tool_plan is not None and tool_plan.grammar is not None
        if tool_plan is not None:
            grammar = tool_plan.combine_grammar(grammar)
        return usable_grammar(manager, grammar, "tool_choice" if forced else body.structured_output_param())

    return await on_grammar_thread(build, request) if _asks_structured_output(body) else build()
