"""The tool fields of a chat request: ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked
with 400s that name the field (the tool-call history in ``messages``: :mod:`.history`).

:func:`plan_tool_calls` turns them, with the server's ``--tool_call_parser``, into a
:class:`ToolPlan`: what the chat template receives, which grammar (if any) constrains the
output, and how the output is read back into ``tool_calls``.

=========================  =========================================================================
``tool_choice``            behaviour
=========================  =========================================================================
absent, no ``tools``       plain chat (``tools: []`` is no tools; with it ``"auto"`` is ``"none"``)
``"none"``                 the tools reach the template; the output is plain content (no parser needed)
``"auto"`` (the default    the model decides; calls are parsed from its text by ``--tool_call_parser``
when ``tools`` are given)  (a 400 naming the flag when the server has none)
``"required"``             structured output forces a JSON array of ``{"name", "parameters"}`` calls
named function             structured output forces that function's arguments
=========================  =========================================================================
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from lightllm.server.http.errors import APIError, invalid_request
from lightllm.server.http.structured.guidance_options import check_guidance_options
from lightllm.server.http.structured.schema_positions import ANNOTATION_KEYWORDS, DATA_KEYWORDS, SCHEMA_MAP_KEYWORDS
from lightllm.server.http.openai.tool_calls.callable_tools import CallableTools
from lightllm.server.http.structured.response_format import compile_json_schema
from lightllm.server.http.openai.tool_calls.parsers import ToolCallParser, ForcedCallParser, make_parser

# OpenAI's limits on tools and function names.
MAX_TOOLS = 128
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
CHOICE_MODES = ("none", "auto", "required")
PARSER_FLAG = "--tool_call_parser"


# The arguments of a function that declares no parameters: OpenAI's "empty parameter list".
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class FunctionTool:
    """One ``{"type": "function", "function": {...}}`` entry of ``tools``."""

    name: str
    parameters: dict[str, Any] | None
    # The entry as the client sent it, less its function's null fields, for the chat template.
    spec: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)
    # "strict": true: arguments valid under ``parameters`` (held to it under auto by CallableTools).
    strict: bool = False

    @property
    def parameters_schema(self) -> dict[str, Any]:
        """The arguments' JSON schema (no arguments, ``{}``, when the tool gives none, as OpenAI defines it).

        Always typed as an object: many clients leave ``"type"`` out of a function's schema, and
        a grammar built from such a schema as written would allow any JSON value (a number, a
        string), which cannot be a call's arguments.
        """
        if self.parameters is None:
            return dict(NO_ARGUMENTS)
        return self.parameters if "type" in self.parameters else {"type": "object", **self.parameters}


def parse_tools(value: Any) -> list[FunctionTool]:
    """``tools`` as function tools; 400 naming the offending entry for anything else."""
    if not isinstance(value, list):
        raise invalid_request("tools must be a list of function tools", "tools")
    if len(value) > MAX_TOOLS:
        raise invalid_request(f"tools holds at most {MAX_TOOLS} entries, got {len(value)}", "tools")
    tools: list[FunctionTool] = []
    for index, entry in enumerate(value):
        param = f"tools.{index}"
        if isinstance(entry, dict) and entry.get("type") == "function" and "function" not in entry:
            # OpenAI's Responses API writes a function tool flat: {"type": "function", "name": ...}.
            flat = sorted(set(entry) & _FUNCTION_KEYS)
            hint = f": {', '.join(flat)} belong{'s' if len(flat) == 1 else ''} inside it" if flat else ""
            raise invalid_request(f"{param} lacks 'function'; a function tool is {{'type': 'function', 'function': "
                                  f"{{'name': ..., 'parameters': ...}}}}{hint}", param)
        if not isinstance(entry, dict) or entry.get("type") != "function":
            raise invalid_request(f"{param} must be {{'type': 'function', 'function': {{...}}}}; only function tools "
                                  "are supported", param)
        unknown = sorted(set(entry) - {"type", "function"})
        if unknown:
            # Other APIs (OpenAI's Responses) write a function's own keys beside "type"; here they
            # belong inside "function", and a key left there would otherwise be dropped unread.
            misplaced = [key for key in unknown if key in _FUNCTION_KEYS]
            hint = f"; {', '.join(misplaced)} belongs inside {param}.function" if misplaced else ""
            raise invalid_request(f"unknown key(s) in {param}: {', '.join(unknown)}{hint}", param)
        function = entry["function"]
        if not isinstance(function, dict):
            raise invalid_request(f"{param}.function must be an object", f"{param}.function")
        unknown = sorted(set(function) - _FUNCTION_KEYS)
        if unknown:
            raise invalid_request(f"unknown key(s) in {param}.function: {', '.join(unknown)}", f"{param}.function")
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise invalid_request(f"{param}.function.name must be 1 to 64 letters, digits, '_' or '-'",
                                  f"{param}.function.name")
        if any(tool.name == name for tool in tools):
            raise invalid_request(f"tools holds two functions named {name!r}", f"{param}.function.name")
        # null is leaving it out, as on every known field (OpenAI's SDKs send explicit nulls).
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise invalid_request(f"{param}.function.description must be a string", f"{param}.function.description")
        if "strict" in function and not isinstance(function["strict"], (bool, type(None))):
            raise invalid_request(f"{param}.function.strict must be a boolean", f"{param}.function.strict")
        parameters = function.get("parameters")
        if parameters is not None:
            _check_parameters(parameters, f"{param}.function.parameters")
        # The template sees a null field as absent too: rendered as written, "description": null would
        # put words in the prompt that leaving it out does not.
        spec = {"type": "function", "function": {key: value for key, value in function.items() if value is not None}}
        tools.append(FunctionTool(name, parameters, spec, strict=function.get("strict") is True))
    return tools


def _check_parameters(schema: Any, param: str) -> None:
    """A function's arguments are a JSON object: its schema must describe one."""
    if not isinstance(schema, dict):
        raise invalid_request(f"{param} must be a JSON schema object", param)
    kind = schema.get("type", "object")
    if kind != "object":
        raise invalid_request(f"{param} must describe an object (type 'object'), got type {kind!r}", param)
    if "properties" in schema and not isinstance(schema["properties"], dict):
        raise invalid_request(f"{param}.properties must be an object", f"{param}.properties")
    # Whatever tool_choice is: one rule for a schema's llguidance options wherever a schema is read.
    check_guidance_options(schema, param)


def parse_tool_choice(value: Any, tools: list[FunctionTool], tools_given: bool = False) -> tuple[str, str | None]:
    """``(mode, function name)`` of ``tool_choice``: mode is none/auto/required/named.

    ``tools_given``: the request sent ``tools``, possibly empty. An empty list is no tools (OpenAI
    reads it so; langchain's ``bind_tools([])`` sends it; vLLM 0.32 refuses it): ``auto`` then has
    nothing to call and is ``none``; ``required`` cannot be met and is refused, as is a named function.
    """
    if value is None:
        return ("auto" if tools else "none"), None
    if isinstance(value, str):
        if value not in CHOICE_MODES:
            raise invalid_request(f"tool_choice must be one of {', '.join(CHOICE_MODES)} or "
                                  "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
        if value == "auto" and not tools and tools_given:
            return "none", None
        if value == "required" and not tools and tools_given:
            raise invalid_request("tool_choice 'required' needs at least one tool, and tools is empty: there is "
                                  "nothing the model could be made to call; send tools, or tool_choice 'none' or "
                                  "'auto' (with no tools both answer without calls)", "tool_choice")
        if value != "none" and not tools:
            raise invalid_request(f"tool_choice {value!r} needs tools", "tool_choice")
        return value, None
    if not (isinstance(value, dict) and value.get("type") == "function" and set(value) == {"type", "function"}
            and isinstance(value["function"], dict) and set(value["function"]) == {"name"}
            and isinstance(value["function"]["name"], str)):
        raise invalid_request("tool_choice must be 'none', 'auto', 'required' or "
                              "{'type': 'function', 'function': {'name': <string>}}", "tool_choice")
    name = value["function"]["name"]
    if not tools:
        given = "tools is empty" if tools_given else "no tools were given"
        raise invalid_request(f"tool_choice names function {name!r} but {given}", "tool_choice")
    if all(tool.name != name for tool in tools):
        known = ", ".join(tool.name for tool in tools)
        raise invalid_request(f"tool_choice names function {name!r}, which is not among the tools ({known})",
                              "tool_choice.function.name")
    return "named", name


def required_schema(tools: list[FunctionTool], parallel: bool) -> dict[str, Any]:
    """The JSON schema of ``tool_choice: "required"``: a non-empty array of calls of the given functions.

    Each tool's schema sits in the root's ``$defs`` with its own references rewritten to point
    there: written inline, a tool's ``#/$defs/Addr`` (what pydantic and the openai SDK's
    ``pydantic_function_tool`` emit) named a path of the wrapper that does not exist, and ``#``
    (a recursive tool) meant the wrapper's array of calls.
    """
    defs = {_tool_key(index): _embedded(tool.parameters_schema, _tool_key(index)) for index, tool in enumerate(tools)}
    variants = [{"type": "object",
                 "properties": {"name": {"const": tool.name}, "parameters": {"$ref": f"#/$defs/{_tool_key(index)}"}},
                 "required": ["name", "parameters"], "additionalProperties": False} for index, tool in enumerate(tools)]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}, "$defs": defs}
    if not parallel:
        schema["maxItems"] = 1
    return schema


# Why a tool's x-guidance may only repeat the compact layout under tool_choice "required".
REQUIRED_LAYOUT = ("under tool_choice 'required' the tools' schemas are compiled inside one schema, and llguidance "
                   "reads x-guidance only at that schema's root, not in a tool's")

# Root keywords a tool's schema loses in the wrapper's $defs: an "$id" there made llguidance resolve
# the rewritten pointers against it (the tool compiled alone and was refused under "required").
_ROOT_ONLY_KEYWORDS = ("$id", "$schema")


def _tool_key(index: int) -> str:
    return f"tool_{index}"


def _rooted(schema: Any, key: str, names: bool = False, data: bool = False) -> Any:
    """``schema`` with every local JSON-pointer reference (``#``, ``#/...``) rewritten to start at
    ``#/$defs/<key>``.

    Everything but data is walked, places no keyword holds included (OpenAPI's
    ``#/components/schemas``, which a reference reaches): a property named ``default`` or ``enum``
    holds a schema whose references move too, while a ``default`` keyword's value is data and stays
    as written.  An anchor (``#name``) names a place anywhere in the document and stays.
    """
    if isinstance(schema, list):
        return [_rooted(item, key, False, data) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rooted = {}
    for name, value in schema.items():
        reference = not data and not names and name == "$ref" and isinstance(value, str)
        if reference and (value == "#" or value.startswith("#/")):
            rooted[name] = f"#/$defs/{key}{value[1:]}"
        else:
            inner_names = not data and not names and name in SCHEMA_MAP_KEYWORDS
            inner_data = data or (not names and name in (*DATA_KEYWORDS, *ANNOTATION_KEYWORDS))
            rooted[name] = _rooted(value, key, inner_names, inner_data)
    return rooted


def _embedded(schema: Any, key: str) -> Any:
    """A tool's schema as it sits in the wrapper's ``$defs`` under ``key``."""
    rooted = _rooted(schema, key)
    if isinstance(rooted, dict):
        for keyword in _ROOT_ONLY_KEYWORDS:
            rooted.pop(keyword, None)
    return rooted


def required_grammar(tools: list[FunctionTool], parallel: bool) -> str:
    """The grammar of ``tool_choice: "required"``; a 400 names the tool whose schema is unusable."""
    for index, tool in enumerate(tools):
        # Each tool's schema sits in the wrapper's $defs, where llguidance does not read x-guidance:
        # an option that would change the output could not be applied.
        check_guidance_options(tool.parameters_schema, f"tools.{index}.function.parameters",
                               compact_because=REQUIRED_LAYOUT)
    try:
        return compile_json_schema(required_schema(tools, parallel), "tools", "schema of the tools' calls")
    except APIError:
        # Name the tool when one alone is unusable; the combined schema's own problem (its size) otherwise.
        for index, tool in enumerate(tools):
            compile_json_schema(tool.parameters_schema, f"tools.{index}.function.parameters")
        raise


@dataclass
class ToolPlan:
    """How one chat request uses tools."""

    mode: str = "none"
    tools: list[FunctionTool] = field(default_factory=list)
    named: str | None = None
    parallel: bool = True
    parser: ToolCallParser | None = None
    grammar: str | None = None
    checked_tools: CallableTools | None = None

    @property
    def reads_calls(self) -> bool:
        """True when the output is read back into ``tool_calls``."""
        return self.mode in ("auto", "required", "named")

    @property
    def callable_tools(self) -> CallableTools:
        """The calls a client may receive: a call of an undeclared function, or a strict one's call with
        arguments breaking its schema (under auto), is read as content."""
        if self.checked_tools is None:
            self.checked_tools = CallableTools(frozenset(tool.name for tool in self.tools))
        return self.checked_tools

    @property
    def keeps_special_tokens(self) -> bool:
        """True when the output must keep special tokens for the parser to find the calls (vLLM turns
        ``skip_special_tokens`` off for such parsers whenever tools may be called)."""
        return self.mode == "auto" and self.parser is not None and self.parser.reads_special_tokens

    def template_options(self, options: dict[str, Any], generating: bool = True) -> dict[str, Any]:
        """``encode_chat`` options with the tools added for the template (as ``apply_chat_template(tools=...)``).

        Tools the template does not render are refused under ``none`` only: there the prompt is all
        they could act through.  Under ``auto`` they also decide which calls are read from the output
        (a client may describe them in its own system message for a template without tool support,
        and vLLM parses such calls), and a forced call (``required``, named) holds them in its grammar.
        ``generating`` false (``/tokenize``, which has no ``tool_choice``): nothing is generated, so
        nothing is refused for it; the ids are those the chat endpoint renders.
        """
        if not self.tools:
            return options
        kwargs = {**(options.get("chat_template_kwargs") or {}), "tools": [tool.spec for tool in self.tools]}
        return {**options, "chat_template_kwargs": kwargs, "check_tools_read": generating and self.mode == "none"}

    def combine_grammar(self, other: str | None) -> str | None:
        """The request's grammar: the forced call's, or ``other`` (what response_format, structured_outputs or
        guided_* ask for); 400 when both constrain the output."""
        if self.grammar is None:
            return other
        if other is not None:
            raise invalid_request("tool_choice 'required' or a named function constrains the output itself; it "
                                  "cannot be combined with response_format, structured_outputs or guided_*",
                                  "tool_choice")
        return self.grammar

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """``tool_calls`` when the model stopped after calling (auto, required); named calls stop as
        OpenAI's do (``stop``)."""
        if called and reason == "stop" and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason


def plan_tool_calls(body: Any, parser_name: str | None) -> ToolPlan:
    """The request's :class:`ToolPlan`; 400 for tool fields that do not fit together or the server."""
    tools = parse_tools(body.tools) if body.tools is not None else []
    mode, named = parse_tool_choice(body.tool_choice, tools, body.tools is not None)
    parallel = body.parallel_tool_calls is not False
    plan = ToolPlan(mode=mode, tools=tools, named=named, parallel=parallel)
    if mode == "auto":
        if parser_name is None:
            raise invalid_request(f"tool_choice 'auto' (the default when tools are given) needs the server to be "
                                  f"started with {PARSER_FLAG}; send tool_choice 'required', 'none' or a named "
                                  "function instead", "tool_choice")
        plan.parser = make_parser(parser_name)
        # Nothing forces a call written in free text: a strict tool's arguments are checked when read.
        plan.checked_tools = CallableTools.for_tools(tools)
    elif mode == "required":
        plan.parser = ForcedCallParser()
        plan.grammar = required_grammar(tools, parallel)
    elif mode == "named":
        tool = next(tool for tool in tools if tool.name == named)
        index = tools.index(tool)
        plan.grammar = compile_json_schema(tool.parameters_schema, f"tools.{index}.function.parameters")
    return plan
