"""Writes the server-argument reference of docs/EN and docs/CN from the argument parser.

``python -m lightllm.server.launch.args_doc`` rewrites both files; a test fails when they
differ from what the parser produces, so the reference cannot drift.
"""

from __future__ import annotations

import sys
from pathlib import Path

import argparse
from typing import List, Optional

from lightllm.server.launch.arg_parser import make_argument_parser
from lightllm.server.launch.flag_roles import readers_of
from lightllm.server.launch.environment_check import ENV_VAR_READERS
from lightllm.utils.envs_utils import ENV_VARS

HEADERS = {
    "EN": (
        "# Server arguments\n\n"
        "Generated from `lightllm/server/launch/arg_parser.py` (with `batching_flags.py`, `http_flags.py` and `pd_flags.py`) by `python -m lightllm.server.launch.args_doc`; "
        "do not edit by hand.\n\n"
        "Launch: `python -m lightllm.server.api_server --model_dir DIR [flags]`.\n\n"
        "The read-by column names the run modes (`--run_mode`) that read each flag; any other refuses it at start.\n\n"
    ),
    "CN": (
        "# 服务启动参数\n\n"
        "本页由 `python -m lightllm.server.launch.args_doc` 从 `lightllm/server/launch/arg_parser.py`（及 `batching_flags.py`、`http_flags.py`、`pd_flags.py`）自动生成，请勿手工修改。"
        "参数说明沿用解析器中的英文帮助文本。\n\n"
        "启动方式：`python -m lightllm.server.api_server --model_dir DIR [参数]`。\n\n"
        "“读取角色”一列列出读取该参数的运行模式（`--run_mode`）；其他模式在启动时拒绝该参数。\n\n"
    ),
}


# The table's column titles in each language.
COLUMNS = {
    "EN": ("flag", "default", "choices", "read by", "meaning"),
    "CN": ("参数", "默认值", "可选值", "读取角色", "说明"),
}


def arguments_markdown(parser: Optional[argparse.ArgumentParser] = None, lang: str = "EN") -> str:
    """The argument reference as a Markdown table, one section per argument group."""
    parser = parser or make_argument_parser()
    lines: List[str] = []
    for group in parser._action_groups:  # argparse exposes groups only through this attribute
        # A suppressed flag exists only to be refused with a pointer to its replacement.
        actions = [a for a in group._group_actions if a.dest != "help" and a.help != argparse.SUPPRESS]
        if not actions:
            continue
        # H2: the generated page's title is H1, and Sphinx -W rejects a jump from H1 to H3.
        columns = COLUMNS[lang]
        lines += [f"## {group.title}", "", f"| {' | '.join(columns)} |", "|" + " --- |" * len(columns)]
        for action in actions:
            flag = ", ".join(action.option_strings)
            default = "off" if isinstance(action, argparse._StoreTrueAction) else repr(action.default)
            choices = " / ".join(str(c) for c in action.choices) if action.choices else ""
            read_by = ", ".join(readers_of(action).ordered())
            # As --help shows it: argparse writes a literal "%" in help text as "%%" (fe80::1%%eth0).
            text = (action.help or "").replace("%%", "%")
            lines.append(f"| `{flag}` | `{default}` | {choices} | {read_by} | {text} |")
        lines.append("")
    return "\n".join(lines)


# The environment section's title, introduction and column titles in each language.
ENV_SECTION = {
    "EN": (
        "## Environment variables",
        "Read once at start by the processes named in the read-by column (CPU only: only when the model "
        "ranks run on the CPU); a bad value is refused at start in one line. A `LIGHTLLM_*` variable that "
        "is set where nothing reads it (another run mode, a CUDA device for a CPU-only one, a flag given "
        "instead, an unknown name) gets one warning line at start.",
        ("variable", "read by", "meaning"),
    ),
    "CN": (
        "## 环境变量",
        "由“读取角色”一列中的进程在启动时读取一次（“CPU only”：仅当模型 rank 运行在 CPU 上时读取；“`--x` wins”：变量与该参数同时给出时以参数为准）；"
        "取值非法时启动即以一行错误拒绝。"
        "已设置但无人读取的 `LIGHTLLM_*` 变量（其他运行模式、CUDA 设备上的仅 CPU 变量、已由对应参数取代、未知名称）在启动时各给出一行警告。",
        ("变量", "读取角色", "说明"),
    ),
}


def environment_markdown(lang: str = "EN") -> str:
    """The ``LIGHTLLM_*`` variables as a Markdown table, from envs_utils' tables."""
    title, intro, columns = ENV_SECTION[lang]
    lines = [title, "", intro, "", f"| {' | '.join(columns)} |", "|" + " --- |" * len(columns)]
    for name, meaning in ENV_VARS.items():
        readers = ENV_VAR_READERS[name]
        read_by = ", ".join(readers.run_modes) + (" (CPU only)" if readers.cpu_only else "")
        if readers.flag:
            read_by += f"; `--{readers.flag}` wins"
        lines.append(f"| `{name}` | {read_by} | {meaning} |")
    lines.append("")
    return "\n".join(lines)


def render(lang: str) -> str:
    """The whole server_args.md for ``lang`` (EN or CN)."""
    return HEADERS[lang] + arguments_markdown(lang=lang) + "\n" + environment_markdown(lang)


def doc_path(root: Path, lang: str) -> Path:
    """Where the reference lives."""
    return root / "docs" / lang / "server_args.md"


def main(argv: Optional[List[str]] = None) -> int:
    """Rewrite both language versions; with ``--check`` only report whether they are current."""
    cli = argparse.ArgumentParser(
        prog="python -m lightllm.server.launch.args_doc",
        description="Write docs/EN/server_args.md and docs/CN/server_args.md from the server's argument parser.",
    )
    cli.add_argument("--check", action="store_true",
                     help="write nothing; exit 1 naming the files that differ from what the parser produces")
    args = cli.parse_args(argv)
    root = Path(__file__).resolve().parents[3]
    stale = []
    for lang in HEADERS:
        path, text = doc_path(root, lang), render(lang)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.write_text(text)
    if stale:
        print(f"stale: {', '.join(stale)}; run python -m lightllm.server.launch.args_doc", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
