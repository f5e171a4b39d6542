"""``--chat_template``: a file or the template itself, checked at start as transformers would compile it."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from lightllm.server.request_defaults import MAX_CHAT_TEMPLATE_FILE_BYTES, read_chat_template_flag

TEMPLATE = ("{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}{% generation %}"
            "<{{ m.role }}>{{ m.content | tojson }}{% endgeneration %}{% endfor %}")


def test_a_file_or_the_template_itself_is_read_as_transformers_renders_it(tmp_path: Path, tokenizer_dir: Path) -> None:
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    assert read_chat_template_flag(str(path)) == read_chat_template_flag(TEMPLATE) == TEMPLATE
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = read_chat_template_flag(str(path))
    rendered = tokenizer.apply_chat_template([{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}],
                                             tokenize=False)
    assert rendered == '<user>"hi"'


@pytest.mark.parametrize("value, message", [
    ("{% for m in messages %}", "not a valid Jinja template"),
    ("{{ messages | nosuchfilter }}", "No filter named 'nosuchfilter'"),
    ("/no/such/file.jinja", "no such file, and not a Jinja template either"),
])
def test_what_could_not_render_is_refused_in_one_line(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        read_chat_template_flag(value)
    assert "\n" not in str(caught.value) and str(caught.value).startswith("--chat_template")


def test_empty_and_oversized_files_are_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jinja"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match="the template is empty"):
        read_chat_template_flag(str(empty))
    large = tmp_path / "large.jinja"
    large.write_text("x" * (MAX_CHAT_TEMPLATE_FILE_BYTES + 1))
    with pytest.raises(ValueError, match="larger than"):
        read_chat_template_flag(str(large))
