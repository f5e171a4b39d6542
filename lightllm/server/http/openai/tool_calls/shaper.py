"""Chat choices of a request whose output is read back into ``tool_calls`` (see :class:`ToolPlan`)."""

from __future__ import annotations

from typing import Any

from lightllm.server.http.openai.openai_shapes import ChatShaper, final_finish_reason
from lightllm.server.http.openai.tool_calls.extraction import Extraction, extract_calls, read_named_call
from lightllm.server.http.openai.tool_calls.request import ToolPlan
from lightllm.server.http.openai.tool_calls.streaming import NamedCallStream, ToolCallStream


def extract_for_plan(plan: ToolPlan, text: str) -> Extraction:
    """Content and calls of a whole generated text under ``plan`` (what its stream adds up to)."""
    if plan.mode == "named":
        return read_named_call(plan.named, text)
    return extract_calls(plan.parser, text, plan.parallel, plan.callable_tools.accepts)


class ToolChatShaper(ChatShaper):
    """:class:`ChatShaper` whose messages and deltas carry ``tool_calls`` parsed from the output."""

    def __init__(self, plan: ToolPlan, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._plan = plan
        self._streams: dict[int, ToolCallStream | NamedCallStream] = {}
        # Choices that have streamed some content (see opening_choices).
        self._content_sent: set[int] = set()

    def opening_choices(self, indices: list[int]) -> list[dict[str, Any]]:
        """As :meth:`ChatShaper.opening_choices`, but the role's content is null (without echo).

        The message's content is null when the output is only calls, so a stream that began with
        ``""`` added up to ``""`` where the response says null (the openai SDK's accumulated
        message showed the difference); OpenAI also opens a tool-call answer with a null content.
        """
        openings = super().opening_choices(indices)
        if self._echo is None:
            for opening in openings:
                opening["delta"]["content"] = None
        return openings

    def _stream(self, index: int) -> ToolCallStream | NamedCallStream:
        if index not in self._streams:
            plan = self._plan
            self._streams[index] = (NamedCallStream(plan.named) if plan.mode == "named"
                                    else ToolCallStream(plan.parser, plan.parallel, plan.callable_tools.accepts))
        return self._streams[index]

    def stream_choices(self, index: int, event: Any) -> list[dict[str, Any]]:
        """The chunk choices for one token: content and/or call deltas; none when it adds nothing.

        A call announced by the token that ends the choice goes in a chunk of its own, and the
        finish reason in a last chunk with an empty delta, as OpenAI streams them: the openai
        SDK's stream helper closes a call (``tool_calls.function.arguments.done``) only when it
        saw the call's index before the chunk with the finish reason, so a named or required
        call, which is sent whole at the end, was never reported done.
        """
        stream = self._stream(index)
        delta = stream.feed(event.text)
        finish_reason = event.finish_reason
        if finish_reason is not None:
            tail = stream.finish()
            if tail.get("content"):
                delta["content"] = delta.get("content", "") + tail["content"]
            if tail.get("tool_calls"):
                delta["tool_calls"] = delta.get("tool_calls", []) + tail["tool_calls"]
            finish_reason = self._plan.finish_reason(finish_reason, stream.calls_announced > 0)
            if self._echo is None and stream.calls_announced == 0 and index not in self._content_sent:
                # Neither calls nor content: the response's content is "", which null would not add up to.
                delta["content"] = delta.get("content", "")
        if delta.get("content") is not None:
            self._content_sent.add(index)
        if not delta and finish_reason is None and not self._with_logprobs \
                and not (self._every_token and event.token_id >= 0):
            return []
        logprobs = self.stream_logprobs(index, event) if self._with_logprobs else None
        if finish_reason is not None and "tool_calls" in delta:
            return [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None, "stop_reason": None},
                    {"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason,
                     "stop_reason": event.stop_reason}]
        return [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                 "stop_reason": event.stop_reason}]

    def generated_choice(self, index: int, events: list[Any]) -> dict[str, Any]:
        """The whole choice: ``message.tool_calls`` when the output holds calls (read before any echo)."""
        choice = super().generated_choice(index, events)
        extraction = extract_for_plan(self._plan, choice["message"]["content"])
        if extraction.calls:
            choice["message"] = {"role": "assistant", "content": extraction.content,
                                 "tool_calls": [call.to_openai() for call in extraction.calls]}
        choice["finish_reason"] = self._plan.finish_reason(final_finish_reason(events), bool(extraction.calls))
        return choice
