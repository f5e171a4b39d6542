"""Whether a chat template wants a message's content as a list of parts or as one string.

OpenAI clients may send ``content`` as a list of ``{"type": "text", "text": ...}`` parts.  Some
chat templates loop over such a list themselves (``{% for part in message['content'] %}``);
most print ``message['content']`` and expect a string.  As vLLM does, the template's own syntax
decides: parts for a template that iterates over a message's content, the texts joined with
newlines for the others (a list printed as a string would put Python's list syntax in the prompt).
"""

from __future__ import annotations

from typing import Any

import jinja2
import jinja2.nodes

from lightllm.server.request_defaults import chat_template_environment
from lightllm.server.request_template_cache import cached_unless_request


def _is_content(node: jinja2.nodes.Node) -> bool:
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    return False


def _unfiltered(node: jinja2.nodes.Node) -> jinja2.nodes.Node:
    # ``m['content'] | selectattr(...)`` still iterates the parts.
    while isinstance(node, jinja2.nodes.Filter) and node.node is not None:
        node = node.node
    return node


def _iterates_content(template: str) -> bool:
    """True when ``template`` has a for-loop over some value's ``content``: ``x.content`` or ``x['content']``,
    through filters, or through a variable set to it (``{% set c = m['content'] %}{% for p in c %}``)."""
    try:
        tree = chat_template_environment().parse(template)
    except jinja2.TemplateSyntaxError:
        # Rendering reports the error; the content form does not matter then.
        return False
    aliases = {assign.target.name for assign in tree.find_all(jinja2.nodes.Assign)
               if isinstance(assign.target, jinja2.nodes.Name) and _is_content(_unfiltered(assign.node))}
    for loop in tree.find_all(jinja2.nodes.For):
        source = _unfiltered(loop.iter)
        if _is_content(source) or (isinstance(source, jinja2.nodes.Name) and source.name in aliases):
            return True
    return False


# template_iterates_content(template, request_template=False): cached for the server's templates; a
# request's own (request_template=True) is parsed each time and kept nowhere (request_template_cache).
template_iterates_content = cached_unless_request(_iterates_content, maxsize=64)


def rendering_template(tokenizer_template: Any, request_template: str | None, with_tools: bool) -> str | None:
    """The template text a chat renders with: the request's own, else the tokenizer's (of named templates,
    ``tool_use`` when tools are given and it exists, else ``default``, as transformers chooses)."""
    if request_template is not None:
        return request_template
    if isinstance(tokenizer_template, dict):
        if with_tools and "tool_use" in tokenizer_template:
            return tokenizer_template["tool_use"]
        return tokenizer_template.get("default")
    if isinstance(tokenizer_template, list):
        named = {item.get("name"): item.get("template") for item in tokenizer_template if isinstance(item, dict)}
        return rendering_template(named, None, with_tools)
    return tokenizer_template if isinstance(tokenizer_template, str) else None
