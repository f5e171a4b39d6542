"""The tool-call history in a chat's ``messages``: an assistant turn's ``tool_calls`` and a tool
message's ``tool_call_id``, checked with 400s that name the field, and the calls in the shape chat
templates expect.
"""

from __future__ import annotations

import json
from typing import Any

from lightllm.server.http.validation.base_models import integral
from lightllm.server.http.validation.body import json_type_name
from lightllm.server.http.errors import invalid_request
from lightllm.server.http.validation.json_text import parse_json_text

_CALL_KEYS = ("id", "type", "function")
# Accepted and not used: a streamed call's position, left on a call a client assembled from the
# stream's deltas (as vLLM accepts it).
_UNUSED_CALL_KEYS = ("index",)
# Accepted and not used: the openai SDK's parse()/stream() helpers add the arguments parsed into the
# tool's pydantic model, a repeat of ``arguments`` (which the template renders).
_UNUSED_FUNCTION_KEYS = ("parsed_arguments",)
_FUNCTION_SHAPE = "{'name': <string>, 'arguments': <JSON string>}"
_CALL_SHAPE = f"{{'id': <string>, 'type': 'function', 'function': {_FUNCTION_SHAPE}}}"
# The shape check_message_tool_calls accepts, for the OpenAPI document: every key required and
# not null (null counts as missing), index the one optional key.
TOOL_CALL_SCHEMA: dict[str, Any] = {
    "type": "object", "required": list(_CALL_KEYS), "additionalProperties": False, "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name", "arguments"], "additionalProperties": False,
                     "properties": {"name": {"type": "string"},
                                    "arguments": {"type": "string", "description": "JSON text encoding an object"},
                                    "parsed_arguments": {"description": "The openai SDK's parse of arguments; "
                                                                        "not used"}}},
        "index": {"type": ["integer", "null"], "description": "A streamed call's position; not used"}}}


def check_message_tool_calls(value: list[Any] | None) -> list[dict[str, Any]] | None:
    """An assistant message's ``tool_calls`` (OpenAI form), checked; ``ValueError`` names the problem."""
    if value is None:
        return None
    calls = []
    for index, call in enumerate(value):
        # Every key is required, as OpenAI and vLLM require them: the id pairs the call with its tool
        # message, and a client that sends the response's call back has all three.
        if not isinstance(call, dict):
            raise ValueError(f"tool call {index} is not an object: it must be {_CALL_SHAPE}")
        if call.get("type") not in (None, "function"):
            raise ValueError(f"tool call {index} has type {call['type']!r}: only function calls are supported, "
                             f"{_CALL_SHAPE}")
        missing = [key for key in _CALL_KEYS if call.get(key) is None]
        unknown = sorted(str(key) for key in set(call) - set(_CALL_KEYS) - set(_UNUSED_CALL_KEYS))
        if missing or unknown:
            problem = (f"lacks {', '.join(repr(key) for key in missing)}" if missing
                       else f"has unknown key(s) {', '.join(repr(key) for key in unknown)}")
            raise ValueError(f"tool call {index} {problem}: it must be {_CALL_SHAPE}")
        if not isinstance(call["id"], str):
            raise ValueError(f"tool call {index} id must be a string, got {json_type_name(call['id'])}")
        position = integral(call.get("index"))  # 1.0 is 1, as in every integer field
        if position is not None and (not isinstance(position, int) or isinstance(position, bool)):
            raise ValueError(f"tool call {index} index must be an integer (a streamed call's position; it is not "
                             f"used), got {json_type_name(position)}")
        function = call["function"]
        known = {"name", "arguments", *_UNUSED_FUNCTION_KEYS}
        extra = sorted(str(key) for key in set(function) - known) if isinstance(function, dict) else []
        if extra:
            # Refused, not dropped (vLLM drops them): the template gets the name and arguments only.
            raise ValueError(f"tool call {index} function has unknown key(s) {', '.join(map(repr, extra))}: it "
                             f"must be {_FUNCTION_SHAPE}")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not isinstance(function.get("arguments"), str):
            raise ValueError(f"tool call {index} function must be {_FUNCTION_SHAPE}")
        # The arguments' JSON is read by check_tool_messages, which knows the message's index for the 400.
        calls.append(call)
    return calls


def check_tool_call_arguments(calls: list[dict[str, Any]], param: str) -> None:
    """Each call's ``function.arguments`` must be JSON text encoding an object, under the body's rules
    (:func:`~lightllm.server.http.validation.json_text.parse_json_text`); ``param`` is the ``tool_calls``
    field's path."""
    for index, call in enumerate(calls):
        where = f"{param}.{index}.function.arguments"
        # A repeated key is allowed: the model's own output may hold one, and clients send it back as history.
        arguments = parse_json_text(call["function"]["arguments"], where, unique_keys=False)
        if not isinstance(arguments, dict):
            raise invalid_request(f"Invalid value for '{where}': the arguments must encode a JSON object, got "
                                  f"{json_type_name(arguments)}", where)


def template_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool calls as chat templates expect them (transformers' convention): arguments as a mapping."""
    rendered = []
    for call in calls:
        function = call["function"]
        # Read before (check_tool_call_arguments), so json.loads cannot fail here.
        rendered.append({"id": call["id"], "type": "function",
                         "function": {"name": function["name"], "arguments": json.loads(function["arguments"])}})
    return rendered


def check_tool_messages(messages: list[Any]) -> None:
    """Tool-call fields only where they belong: ``tool_calls`` on assistant messages, ``tool_call_id`` (required)
    on tool messages; and each call's arguments JSON text encoding an object."""
    for index, message in enumerate(messages):
        if message.tool_calls and message.role != "assistant":
            raise invalid_request(f"messages[{index}].tool_calls is only allowed on assistant messages",
                                  f"messages.{index}.tool_calls")
        if message.tool_calls:
            check_tool_call_arguments(message.tool_calls, f"messages.{index}.tool_calls")
        if message.role == "tool" and not message.tool_call_id:
            raise invalid_request(f"messages[{index}] has role 'tool' and needs tool_call_id",
                                  f"messages.{index}.tool_call_id")
        if message.tool_call_id is not None and message.role != "tool":
            raise invalid_request(f"messages[{index}].tool_call_id is only allowed on tool messages",
                                  f"messages.{index}.tool_call_id")
