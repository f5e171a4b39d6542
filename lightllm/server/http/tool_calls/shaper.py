"""Chat choices of a request whose output is read back into ``tool_calls`` (see :class:`ToolPlan`)."""

from __future__ import annotations

from typing import Any

from lightllm.server.http.openai_shapes import ChatShaper, final_finish_reason
from lightllm.server.http.tool_calls.extraction import Extraction, extract_calls, read_named_call
from lightllm.server.http.tool_calls.request import ToolPlan
from lightllm.server.http.tool_calls.streaming import NamedCallStream, ToolCallStream


def extract_for_plan(plan: ToolPlan, text: str) -> Extraction:
    """Content and calls of a whole generated text under ``plan`` (what its stream adds up to)."""
    if plan.mode == "named":
        return read_named_call(plan.named, text)
    return extract_calls(plan.parser, text, plan.parallel, plan.declared)


class ToolChatShaper(ChatShaper):
    """:class:`ChatShaper` whose messages and deltas carry ``tool_calls`` parsed from the output."""

    def __init__(self, plan: ToolPlan, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._plan = plan
        self._streams: dict[int, ToolCallStream | NamedCallStream] = {}

    def _stream(self, index: int) -> ToolCallStream | NamedCallStream:
        if index not in self._streams:
            plan = self._plan
            self._streams[index] = (NamedCallStream(plan.named) if plan.mode == "named"
                                    else ToolCallStream(plan.parser, plan.parallel, plan.declared))
        return self._streams[index]

    def stream_choice(self, index: int, event: Any) -> dict[str, Any] | None:
        """The chunk choice for one token: content and/or call deltas; None when it adds nothing."""
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
        if not delta and finish_reason is None and not self._with_logprobs:
            return None
        logprobs = self._formatter.chat([event]) if self._with_logprobs else None
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": event.stop_reason}

    def generated_choice(self, index: int, events: list[Any]) -> dict[str, Any]:
        """The whole choice: ``message.tool_calls`` when the output holds calls (read before any echo)."""
        choice = super().generated_choice(index, events)
        extraction = extract_for_plan(self._plan, choice["message"]["content"])
        if extraction.calls:
            choice["message"] = {"role": "assistant", "content": extraction.content,
                                 "tool_calls": [call.to_openai() for call in extraction.calls]}
        choice["finish_reason"] = self._plan.finish_reason(final_finish_reason(events), bool(extraction.calls))
        return choice
