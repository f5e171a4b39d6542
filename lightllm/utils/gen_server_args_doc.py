"""Writes the server-argument reference of docs/EN and docs/CN from the argument parser.

``python -m lightllm.utils.gen_server_args_doc`` rewrites both files; a test fails when they
differ from what the parser produces, so the reference cannot drift.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lightllm.server.api_cli import arguments_markdown

HEADERS = {
    "EN": (
        "# Server arguments\n\n"
        "Generated from `lightllm/server/api_cli.py` by `python -m lightllm.utils.gen_server_args_doc`; "
        "do not edit by hand.\n\n"
        "Launch: `python -m lightllm.server.api_server --model_dir DIR [flags]`.\n\n"
    ),
    "CN": (
        "# 服务启动参数\n\n"
        "本页由 `python -m lightllm.utils.gen_server_args_doc` 从 `lightllm/server/api_cli.py` 自动生成，请勿手工修改。"
        "参数说明沿用解析器中的英文帮助文本。\n\n"
        "启动方式：`python -m lightllm.server.api_server --model_dir DIR [参数]`。\n\n"
    ),
}


def render(lang: str) -> str:
    """The whole server_args.md for ``lang`` (EN or CN)."""
    return HEADERS[lang] + arguments_markdown()


def doc_path(root: Path, lang: str) -> Path:
    """Where the reference lives."""
    return root / "docs" / lang / "server_args.md"


def main() -> int:
    """Rewrite both language versions."""
    root = Path(__file__).resolve().parents[2]
    for lang in HEADERS:
        doc_path(root, lang).write_text(render(lang))
    return 0


if __name__ == "__main__":
    sys.exit(main())
