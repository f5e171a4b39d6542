"""A request's own chat template (``--trust_request_chat_template``) is kept nowhere after its request.

Jinja folds constants when it compiles (``{{ 'x' * 2000000 }}`` is one 2 MB string in the compiled
template), and transformers' LRU of compiled templates and the server's parse caches, keyed by template
text, kept every request's template: six requests each with its own such template left the HTTP
process 300 MB larger.  Checked here by what the caches and the heap hold, not by timing or RSS.
"""

from __future__ import annotations

import gc
import uuid

import jinja2
import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer
from transformers.utils import chat_template_utils

from api_fakes import chat
from chat_rendering_support import RenderingManager
from lightllm.server import template_variables
from lightllm.server.http.app import create_app
from lightllm.server.http.openai import chat_content_format, developer_role
from lightllm.server.http.server_options import HttpServerOptions
from lightllm.server.served_model import encode_chat_messages

SERVER_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
MESSAGES = [{"role": "user", "content": "hi"}]


def _cache_sizes() -> dict[str, int]:
    return {
        "transformers": chat_template_utils._compile_jinja_template.cache_info().currsize,
        "template_variables": template_variables._undeclared.cache.cache_info().currsize,
        "developer_role": developer_role.template_names_developer_role.cache.cache_info().currsize,
        "chat_content_format": chat_content_format.template_iterates_content.cache.cache_info().currsize,
    }


def _live_templates() -> int:
    gc.collect()
    return sum(1 for item in gc.get_objects() if issubclass(type(item), jinja2.Template))


def _request_template() -> str:
    # Unique per call, so no cache could have it from before; reads a variable (template_variables parses
    # it), names the developer role and loops over content (the other two parse caches see it too).
    marker = uuid.uuid4().hex
    return ("{% for m in messages %}{% if m.role == 'developer' %}D{% endif %}{{ m.role }}: "
            "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}{{ p.text }}{% endfor %}"
            "{% endif %}\n{% endfor %}{{ '" + marker + " ' * 3 }}{{ style | default('') }}")


@pytest.fixture()
def tokenizer(tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = SERVER_TEMPLATE
    return tokenizer


def test_a_rendered_request_template_leaves_no_cache_entry_and_no_compiled_template(tokenizer) -> None:
    # The server's own template is cached once (warmed here), and stays so.
    encode_chat_messages(tokenizer, MESSAGES)
    sizes, templates = _cache_sizes(), _live_templates()
    template = _request_template()
    ids = encode_chat_messages(tokenizer, MESSAGES, chat_template_kwargs={"chat_template": template, "style": "s"})
    assert _cache_sizes() == sizes
    assert _live_templates() == templates
    # Byte-identical to transformers' own render of that template (which caches it: compared last).
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True,
                                                                  chat_template=template, style="s")
    hits = chat_template_utils._compile_jinja_template.cache_info().hits
    encode_chat_messages(tokenizer, MESSAGES)
    assert chat_template_utils._compile_jinja_template.cache_info().hits == hits + 1  # the server's: still cached


def test_a_chat_request_with_its_own_template_leaves_nothing_behind(tokenizer) -> None:
    client = TestClient(create_app(RenderingManager(tokenizer), HttpServerOptions(trust_request_chat_template=True)),
                        raise_server_exceptions=False)
    assert chat(client).status_code == 200  # the server's template: cached from here on
    sizes, templates = _cache_sizes(), _live_templates()
    for _ in range(3):
        answer = chat(client, chat_template=_request_template(), chat_template_kwargs={"style": "s"},
                      messages=[{"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
                                {"role": "user", "content": "hi"}])
        assert answer.status_code == 200, answer.text
    assert _cache_sizes() == sizes
    assert _live_templates() == templates
