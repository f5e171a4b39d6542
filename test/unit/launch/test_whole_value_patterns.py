"""Names, hosts and addresses must fit their pattern whole: Python's ``$`` also matches before a final
newline, so ``"node-1\\n"`` passed every ``^...$`` check that used ``re.match``."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from lightllm.server.argument_error import ArgumentError
from lightllm.server.http.errors import APIError
from lightllm.server.http.openai.tool_calls.request import parse_tools
from lightllm.server.launch.arg_parser import parse_server_args
from lightllm.server.launch.args_check import validate_args
from lightllm.utils.host_names import host_problem
from lightllm.server.pd.protocol.stream_lines import TransferSetupBody


def test_a_host_name_with_a_trailing_newline_is_refused():
    assert host_problem("localhost") is None
    assert host_problem("localhost\n") is not None


@pytest.mark.parametrize("argv", [
    ["--allowed_origins", "https://app.example.com\n"],
    ["--run_mode", "pd_master", "--pd_node_id", "node-1\n"],
])
def test_flags_with_a_trailing_newline_are_refused(argv):
    validate_args(parse_server_args(["--model_dir", "/m", *[a.rstrip("\n") for a in argv]]))
    with pytest.raises(ArgumentError):
        validate_args(parse_server_args(["--model_dir", "/m", *argv]))


def test_a_tool_name_with_a_trailing_newline_is_refused():
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    assert parse_tools([tool])[0].name == "lookup"
    tool["function"]["name"] = "lookup\n"
    with pytest.raises(APIError) as refused:
        parse_tools([tool])
    assert refused.value.param == "tools.0.function.name"


def test_a_transfer_address_with_a_trailing_newline_is_refused():
    body = {"epoch": 0, "peer_node_id": "p", "prefill_transfer_address": "10.0.0.1:9000"}
    TransferSetupBody(**body)
    with pytest.raises(ValidationError):
        TransferSetupBody(**{**body, "prefill_transfer_address": "10.0.0.1:9000\n"})
