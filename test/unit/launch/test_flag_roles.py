"""The roles that read each flag are declared once (flag_roles.add_flag) and every role check
derives from that declaration: each role refuses exactly the flags it does not read.

The master's allowlist and the nodes' deny lists used to be kept by hand next to the parser, so
a new flag was accepted and ignored wherever a list was not extended.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import List

import pytest

from lightllm.server.argument_error import ArgumentError
from lightllm.server.launch import role_refusals
from lightllm.server.launch.arg_parser import (
    flags_read_by,
    make_argument_parser,
    parse_server_args,
    server_flag_readers,
)
from lightllm.server.launch.args_check import validate_args
from lightllm.server.launch.flag_roles import FlagReaders, add_flag, flag_readers, readers_of
from lightllm.server.launch.pd_master import check_master_flags
from lightllm.server.run_mode import RUN_MODES

_ROOT = Path(__file__).resolve().parents[3]

# A value each flag takes on a role that reads it (a store_true flag takes none; others default).
_VALUES = {
    "api_key": ["k"], "admin_api_key": ["k"], "allowed_origins": ["*"], "eos_id": ["2"], "model_name": ["m"],
    "nccl_port": ["29999"], "pd_transfer_port": ["40123"], "pd_cluster_key": ["key"], "pd_node_id": ["n1"],
    "chat_template": ["t"], "max_new_tokens_default": ["4"], "max_req_total_len": ["64"],
    "max_total_token_num": ["4096"], "prompt_chars_per_token": ["4"], "http_max_connections_per_client": ["8"],
    "max_request_body_bytes": ["4096"], "top_logprobs_slots": ["4"], "batch_max_tokens": ["2048"],
    "reserved_memory_gb": ["1"], "sampling_seed": ["1"], "pd_reserve_lease_seconds": ["5"],
    "tool_call_parser": ["hermes"],
}
# Flags that do something only beside another: one rank (--tp 1) opens no rendezvous.
_WITH = {"nccl_host": ["--tp", "2"], "nccl_port": ["--tp", "2"]}
# Given on every role by every test; --prefill_max_wait_tokens was replaced and is refused everywhere.
_NOT_TRIED = {"model_dir", "run_mode", "prefill_max_wait_tokens"}


def _argv(action: argparse.Action) -> List[str]:
    if action.nargs == 0:
        return [action.option_strings[0]]
    value = _VALUES.get(action.dest) or [str(action.default)]
    return [action.option_strings[0], *value, *_WITH.get(action.dest, [])]


_FLAGS = {action.dest: _argv(action) for action in make_argument_parser()._actions
          if action.option_strings and action.dest not in _NOT_TRIED and action.dest != "help"}


def _refusal(role: str, name: str):
    """The refusal of ``--name`` given to ``role`` (validate_args, then the master's own check), or None."""
    args = parse_server_args(["--model_dir", "/m", "--run_mode", role, *_FLAGS[name]])
    try:
        validate_args(args)
        if role == "pd_master":
            check_master_flags(args)
    except (ArgumentError, ValueError) as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("role", RUN_MODES)
def test_each_role_refuses_exactly_the_flags_it_does_not_read(role):
    readers = server_flag_readers()
    for name in sorted(_FLAGS):
        refusal = _refusal(role, name)
        assert (refusal is None) == (role in readers[name]), (role, name, refusal)
        if refusal is not None:
            assert f"--{name}" in refusal and "\n" not in refusal, refusal


def test_every_flag_declares_its_readers_and_one_added_without_them_is_caught():
    parser = make_argument_parser()
    assert set(flag_readers(parser)) == {a.dest for a in parser._actions if a.option_strings and a.dest != "help"}
    parser.add_argument("--undeclared", type=int)
    with pytest.raises(TypeError, match="--undeclared was added without the roles that read it"):
        flag_readers(parser)


def test_a_flag_needs_a_reader_and_real_run_modes():
    with pytest.raises(ValueError):
        FlagReaders(())
    with pytest.raises(ValueError):
        FlagReaders(("prefil",))


def test_the_master_reads_what_it_serves_and_no_model_flag():
    master = flags_read_by("pd_master")
    assert {"host", "port", "api_key", "chat_template", "pd_heartbeat_interval", "pd_cluster_key"} <= master
    assert not master & {"tp", "max_total_token_num", "prefill_queue_strategy", "pd_master_ip", "slot_wait_seconds"}


def test_a_normal_server_refuses_only_pd_cluster_flags():
    """Its refusal says the flags configure PD clusters: they must all be pd_* flags."""
    assert {name for name, readers in server_flag_readers().items() if "normal" not in readers} == \
        {name for name in server_flag_readers() if name.startswith("pd_")}


def test_a_flag_of_a_kind_without_its_own_words_is_refused_naming_its_readers(monkeypatch):
    """A new flag needs no list: declared for prefill nodes alone, a decode node refuses it."""
    readers = dict(server_flag_readers())
    readers["running_max_req_size"] = FlagReaders(("normal", "prefill"))
    monkeypatch.setattr(role_refusals, "server_flag_readers", lambda: readers)
    args = parse_server_args(["--model_dir", "/m", "--run_mode", "decode", "--running_max_req_size", "8"])
    with pytest.raises(ArgumentError, match=r"^--running_max_req_size: read by normal servers and prefill nodes only "
                                            r"\(--run_mode normal or prefill\), not by a decode node$"):
        role_refusals.refuse_flags_not_read(args)


def test_add_flag_records_the_readers_on_the_flag():
    parser = argparse.ArgumentParser()
    action = add_flag(parser, "--x", roles=FlagReaders(("decode",)), type=int, default=1)
    assert readers_of(action).ordered() == ("decode",) and parser.parse_args(["--x", "2"]).x == 2


@pytest.mark.parametrize("name", sorted(n for n in server_flag_readers() if n.startswith("pd_")))
def test_a_pd_flag_s_help_labels_name_its_readers(name):
    """The help text's role labels ("PD master:", "Prefill nodes:") agree with the declaration."""
    help_text = next(a.help for a in make_argument_parser()._actions if a.dest == name)
    roles = server_flag_readers()[name]
    if help_text.startswith("PD master and nodes:"):
        assert roles.ordered() == ("prefill", "decode", "pd_master")
        return
    labels = {"PD master:": ("pd_master" in roles), "Prefill/decode nodes:": ("prefill" in roles and "decode" in roles),
              "Prefill nodes:": ("prefill" in roles and "decode" not in roles),
              "Decode nodes:": ("decode" in roles and "prefill" not in roles)}
    for label, expected in labels.items():
        assert (label in help_text) == expected, (label, help_text)


@pytest.mark.parametrize("lang, title", [("EN", "read by"), ("CN", "读取角色")])
def test_both_docs_say_which_roles_read_each_flag(lang, title):
    text = (_ROOT / "docs" / lang / "server_args.md").read_text()
    assert f"| {title} |" in text
    rows = {line.split(" | ")[0][3:-1]: line.split(" | ")[3] for line in text.splitlines() if line.startswith("| `--")}
    assert rows["--pd_kv_page_size"] == "prefill"
    assert rows["--chat_template"] == "normal, pd_master"
    assert rows["--pd_transfer_timeout_seconds"] == "prefill, decode, pd_master"
