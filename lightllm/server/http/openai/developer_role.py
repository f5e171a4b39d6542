"""Whether a chat template gets OpenAI's ``developer`` role as written or as ``system``.

``developer`` is OpenAI's newer name for ``system``.  Most chat templates (Llama, Qwen, Mistral)
know only ``system`` and would raise on a ``developer`` message, drop it, or render it as a user
turn, so they get it as ``system``.  A template that names the role itself (compares a message's
role with the string ``"developer"``, as templates that render the two differently do) gets it as
written, as vLLM always passes it.
"""

from __future__ import annotations

import jinja2
import jinja2.nodes

from lightllm.server.request_defaults import chat_template_environment
from lightllm.server.request_template_cache import cached_unless_request

DEVELOPER_ROLE = "developer"


def _names_developer_role(template: str | None) -> bool:
    """True when ``template`` holds the string constant ``"developer"`` (in a test, a list or a mapping)."""
    if template is None:
        return False
    try:
        tree = chat_template_environment().parse(template)
    except jinja2.TemplateSyntaxError:
        # Rendering reports the error; the role's name does not matter then.
        return False
    return any(node.value == DEVELOPER_ROLE for node in tree.find_all(jinja2.nodes.Const))


# template_names_developer_role(template, request_template=False): cached for the server's templates;
# a request's own (request_template=True) is parsed each time and kept nowhere (request_template_cache).
template_names_developer_role = cached_unless_request(_names_developer_role, maxsize=64)
