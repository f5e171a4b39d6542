"""Settings an outside pass found accepted but not honoured, or accepted without a bound: each is
refused at start in one line now (or, where refusing would stop valid checkpoints, warned about).
"""

from __future__ import annotations

import json

import pytest

from lightllm.common.basemodel.generation_defaults import GenerationDefaults
from lightllm.common.basemodel.model_config import ModelConfig
from lightllm.server.argument_error import ArgumentError
from lightllm.server.launch.arg_parser import parse_server_args
from lightllm.server.launch.args_check import validate_args
from lightllm.server.launch.checkpoint_checks import generation_default_beyond_context
from lightllm.server.launch.checkpoint_reading import read_checkpoint
from lightllm.server.launch.sizing import plan_sizing
from lightllm.server.request_defaults import RequestDefaults


def _refusal(*argv: str) -> str:
    with pytest.raises(ArgumentError) as exc:
        validate_args(parse_server_args(["--model_dir", "/m", *argv]))
    assert "\n" not in str(exc.value)
    return str(exc.value)


@pytest.mark.parametrize("argv, named", [
    # 1e9 decode steps between admission rounds: a 2-token request waited 7.8 s behind a long one.
    (["--router_max_wait_tokens", "1000000000"], "--router_max_wait_tokens must be in [0, 1000] decode steps"),
    (["--router_token_ratio", "1e9"], "--router_token_ratio must be in (0, 100]"),
    # A token stands for at least one character: 0.5 refused prompts that fit.
    (["--prompt_chars_per_token", "0.5"], "--prompt_chars_per_token must be 0 (the check off) or in [1, 1e+06]"),
    # The variable's comma-separated value copied to the flag became one key no client sends.
    (["--api_key", "a,b"], "--api_key values hold one key each: give several as separate words"),
    (["--admin_api_key", "x", "y,z"], "--admin_api_key values hold one key each"),
])
def test_a_setting_beyond_what_works_is_refused(argv, named):
    assert named in _refusal(*argv)


@pytest.mark.parametrize("argv", [["--router_max_wait_tokens", "1000"], ["--router_token_ratio", "100"],
                                  ["--prompt_chars_per_token", "0"], ["--prompt_chars_per_token", "1"],
                                  ["--api_key", "a", "b"]])
def test_the_edges_are_accepted(argv):
    validate_args(parse_server_args(["--model_dir", "/m", *argv]))


def test_wide_forwards_may_not_have_fewer_threads_than_every_forward(tiny_llama_dir, monkeypatch):
    """LIGHTLLM_TORCH_THREADS=2 LIGHTLLM_PREFILL_TORCH_THREADS=1 started with a 'wide' forward of 1."""
    args = parse_server_args(["--model_dir", str(tiny_llama_dir)])
    config = ModelConfig.from_dir(str(tiny_llama_dir))
    monkeypatch.setenv("LIGHTLLM_TORCH_THREADS", "2")
    monkeypatch.setenv("LIGHTLLM_PREFILL_TORCH_THREADS", "1")
    with pytest.raises(ArgumentError, match=r"^LIGHTLLM_PREFILL_TORCH_THREADS=1 is below the 2 threads of every "
                                            r"forward \(LIGHTLLM_TORCH_THREADS\)"):
        plan_sizing(args, config, "cpu")
    monkeypatch.setenv("LIGHTLLM_PREFILL_TORCH_THREADS", "2")
    sizing = plan_sizing(args, config, "cpu")
    assert (sizing.torch_threads, sizing.prefill_torch_threads) == (2, 2)


def test_a_slow_tokenizer_the_checkpoint_lacks_is_refused(tiny_llama_dir):
    """--tokenizer_mode slow started with a warning and served the fast tokenizer."""
    args = parse_server_args(["--model_dir", str(tiny_llama_dir), "--tokenizer_mode", "slow"])
    with pytest.raises(ValueError, match=r"--tokenizer_mode slow: transformers \S+ loads .*'s tokenizer \(\w+\) "
                                         r"through its fast backend even when asked for a slow \(Python\) one, so "
                                         r"the fast one would serve anyway; use --tokenizer_mode fast or auto"):
        read_checkpoint(args)
    read_checkpoint(parse_server_args(["--model_dir", str(tiny_llama_dir), "--tokenizer_mode", "auto"]))


def test_a_generation_config_length_beyond_the_context_is_named(tiny_llama_dir, tmp_path):
    """generation_config.json max_new_tokens 99999 on a 4096-token server started silently."""
    folder = tmp_path / "generation"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 99999}))
    args = parse_server_args(["--model_dir", str(tiny_llama_dir), "--generation_config", str(folder)])
    defaults = RequestDefaults.from_args(args)
    line = generation_default_beyond_context(defaults, None, 1024)
    assert line is not None and "max_new_tokens 99999 does not fit the 1024-token context" in line
    assert str(folder) in line
    assert generation_default_beyond_context(defaults, 16, 1024) is None  # the flag replaces the file's
    fits = RequestDefaults(generation=GenerationDefaults(max_new_tokens=1023, source="x"))
    assert generation_default_beyond_context(fits, None, 1024) is None


def test_a_pd_master_hears_that_nccl_flags_are_the_nodes_not_to_raise_its_tp():
    """The master was told to give --nccl_port "with --tp 2 or more", a flag it refuses itself."""
    from lightllm.server.launch.pd_master import check_master_flags

    args = parse_server_args(["--model_dir", "/m", "--run_mode", "pd_master", "--nccl_port", "23590"])
    validate_args(args)
    with pytest.raises(ValueError, match="^--nccl_port configures model nodes and does nothing on --run_mode "
                                         "pd_master"):
        check_master_flags(args)


def test_an_address_this_machine_does_not_have_is_named_as_such():
    """`--host 8.8.8.8` asked whether another server was running on the port."""
    from lightllm.server.http.transport.listen_sockets import PortUnavailableError, bind_listeners

    with pytest.raises(PortUnavailableError) as refused:
        bind_listeners("192.0.2.1", 0)  # TEST-NET-1: never an address of this machine
    message = str(refused.value)
    assert "--host must be an address of this machine" in message and "another server" not in message, message
