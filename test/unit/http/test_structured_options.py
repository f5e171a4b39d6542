"""vLLM's ``structured_outputs`` options, as its own request models send them, on both OpenAI endpoints.

vLLM 0.32's ``ChatCompletionRequest(..., structured_outputs=StructuredOutputsParams(json=...))``
dumped with ``exclude_none=True`` (what its clients send) carries ``disable_any_whitespace``,
``disable_additional_properties`` and ``_backend_was_auto`` at their defaults; the server answered
400 ``unknown key(s) in structured_outputs``, and ``whitespace_pattern: null`` was refused too.

The app is the real ``create_app`` over ``api_fakes``' scripted manager; grammars are compiled and
matched by the real llguidance.
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from api_fakes import FakeManager, assert_error, chat, completion

# vLLM 0.32's StructuredOutputsParams(json={"type": "integer"}) as its request model, dumped with
# exclude_none=True, sends it.
VLLM_DUMP = {"json": {"type": "integer"}, "disable_any_whitespace": False, "disable_additional_properties": False,
             "_backend_was_auto": False}
SENDS = [completion, chat]


@pytest.mark.parametrize("send", SENDS)
@pytest.mark.parametrize("structured_outputs", [
    VLLM_DUMP,
    # null is absent on every known key; _backend is null unless vLLM itself set it.
    {**VLLM_DUMP, "whitespace_pattern": None, "_backend": None, "structural_tag": None},
    {"json": {"type": "integer"}, "disable_any_whitespace": None, "disable_additional_properties": None,
     "_backend_was_auto": None},
    # vLLM's bookkeeping, which its own request model drops on input (init=False fields): any value.
    {**VLLM_DUMP, "_backend_was_auto": True},
    {**VLLM_DUMP, "_backend": "xgrammar", "_backend_was_auto": True},
    {**VLLM_DUMP, "_backend": "guidance"},
])
def test_vllm_default_options_are_accepted(client: TestClient, manager: FakeManager, send: Any,
                                           structured_outputs: dict[str, Any]) -> None:
    assert send(client, structured_outputs={"json": {"type": "integer"}}).status_code == 200
    plain = manager.calls[-1].params.grammar
    response = send(client, structured_outputs=structured_outputs)
    assert response.status_code == 200, response.text
    assert manager.calls[-1].params.grammar == plain


def _accepts(grammar: str, text: str) -> bool:
    """Whether llguidance's matcher for ``grammar`` takes ``text`` whole, byte by byte."""
    import llguidance

    from lightllm.server.http.structured.response_format import _byte_tokenizer

    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar)
    return matcher.consume_tokens(list(text.encode())) and not matcher.is_error() and matcher.is_accepting()


@pytest.mark.parametrize("send", SENDS)
@pytest.mark.parametrize(("kind", "value", "compact", "spaced"), [
    ("json", {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}}},
     '{"a":[1,2]}', ['{"a": [1,2]}', '{"a":[1, 2]}', '{ "a":[1,2]}', '{"a":[1,2]}\n']),
    ("json", '{"type": "array", "items": {"type": "integer"}}', "[1,2]", ["[1, 2]", " [1,2]", "[1,2] "]),
    ("json_object", True, '{"k":{"x":1}}', ['{"k": {"x":1}}', '{"k":{"x":1} }']),
])
def test_disable_any_whitespace_is_what_json_does_here(client: TestClient, manager: FakeManager, send: Any,
                                                       kind: str, value: Any, compact: str, spaced: list[str]) -> None:
    """The JSON grammar is compiled compact: true asks for what the server does, and is accepted."""
    response = send(client, structured_outputs={kind: value, "disable_any_whitespace": True})
    assert response.status_code == 200, response.text
    grammar = manager.calls[-1].params.grammar
    assert _accepts(grammar, compact)
    assert not any(_accepts(grammar, text) for text in spaced)


@pytest.mark.parametrize("send", SENDS)
@pytest.mark.parametrize(("structured_outputs", "param", "message"), [
    ({"regex": "a b", "disable_any_whitespace": True}, "structured_outputs.disable_any_whitespace",
     "the regex constraint sets its own white space"),
    ({"grammar": 'start: %json {"type": "object"}', "disable_any_whitespace": True},
     "structured_outputs.disable_any_whitespace", "a Lark %json block keeps llguidance's rule"),
    # A schema's own llguidance options override the compact ones (test_guidance_options has the rest).
    ({"json": {"type": "object", "x-guidance": {"whitespace_flexible": True}}, "disable_any_whitespace": True},
     "structured_outputs.json.x-guidance.whitespace_flexible",
     "x-guidance.whitespace_flexible true cannot be applied: structured_outputs.disable_any_whitespace true"),
    ({**VLLM_DUMP, "disable_additional_properties": True}, "structured_outputs.disable_additional_properties",
     "would also close patternProperties objects and allOf branches"),
    ({**VLLM_DUMP, "whitespace_pattern": "[ ]?"}, "structured_outputs.whitespace_pattern",
     "no white space between tokens here"),
    ({**VLLM_DUMP, "_backend": 5}, "structured_outputs._backend", "must be a string"),
    ({**VLLM_DUMP, "disable_any_whitespace": "false"}, "structured_outputs.disable_any_whitespace",
     "must be true or false"),
    ({**VLLM_DUMP, "_backend_was_auto": 0}, "structured_outputs._backend_was_auto", "must be true or false"),
    # Unknown keys keep their message, options or not.
    ({**VLLM_DUMP, "backend": "guidance"}, "structured_outputs",
     "unknown key(s) in structured_outputs: backend; expected one of json, regex, choice, grammar, json_object"),
    # Options alone constrain nothing.
    ({"disable_any_whitespace": False, "_backend_was_auto": False}, "structured_outputs",
     "structured_outputs needs one of json"),
])
def test_options_the_server_would_not_apply_are_refused(client: TestClient, send: Any,
                                                        structured_outputs: dict[str, Any], param: str,
                                                        message: str) -> None:
    error = assert_error(send(client, structured_outputs=structured_outputs), 400, param)
    assert message in error["message"], error
