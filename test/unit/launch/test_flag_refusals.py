"""Flags that did nothing, or more than the code can do, are refused at start in one line.

Each test reproduces an outside tester's report: the flag was accepted and then ignored, its value
dropped, or it crashed a thread after the server was up. Parser-level, no process started, except
the one check that the launcher exits with the documented code.
"""

from __future__ import annotations

import json
import shutil
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from ipv6_support import link_local_address, needs_link_local

from lightllm.common.basemodel.model_config import ModelConfig
from lightllm.server.argument_error import ArgumentError
from lightllm.server.http.transport.listen_sockets import PortUnavailableError
from lightllm.server.launch.exit_codes import EXIT_PORT_UNAVAILABLE
from lightllm.server.launch.arg_parser import parse_server_args
from lightllm.server.launch.args_check import validate_args
from lightllm.server.launch.checkpoint_checks import check_args_against_checkpoint
from lightllm.server.launch.nccl_rendezvous import check_nccl_rendezvous
from lightllm.server.launch.seconds_flags import MAX_WAIT_SECONDS, SECONDS_FLAGS
from lightllm.utils.free_ports import free_port


def _refusal(*argv: str) -> str:
    """The one-line message validate_args refuses ``argv`` with."""
    with pytest.raises(ArgumentError) as exc:
        validate_args(parse_server_args(["--model_dir", "/m", *argv]))
    message = str(exc.value)
    assert "\n" not in message
    return message


# --- 1: a prefill-only PD flag on a decode node -------------------------------------------------


def test_pd_kv_page_size_on_a_decode_node_is_refused():
    """The decode side follows each transfer's header: its own value was silently ignored."""
    message = _refusal("--run_mode", "decode", "--pd_kv_page_size", "128")
    assert message.startswith("--pd_kv_page_size: read by prefill nodes only")
    validate_args(parse_server_args(["--model_dir", "/m", "--run_mode", "prefill", "--pd_kv_page_size", "128"]))


# --- 2: vLLM's and LightLLM's flags are named by their equivalent ------------------------------


@pytest.mark.parametrize(
    "flag, hint",
    [
        ("--seed", "--seed: use --sampling_seed"),
        ("--api-key", "--api-key: use --api_key"),
        ("--chat-template", "--chat-template: use --chat_template"),
        ("--tool-call-parser", "--tool-call-parser: use --tool_call_parser"),
        ("--generation-config", "--generation-config: use --generation_config"),
        ("--allowed-origins", "--allowed-origins: use --allowed_origins"),
        ("--logprobs-mode", "--logprobs-mode: use --logprobs_mode"),
        ("--enable-chunked-prefill", "--enable-chunked-prefill: chunked prefill is on by default"),
        ("--max-model-len", "--max-model-len: use --max_req_total_len"),
        ("--gpu-memory-utilization", "--gpu-memory-utilization: use --mem_fraction"),
        ("--enable-auto-tool-choice", "--enable-auto-tool-choice: tool_choice 'auto' works whenever --tool_call_parser"),
        ("--disable-log-requests", "--disable-log-requests: no per-request access log"),
        ("--uvicorn-log-level", "--uvicorn-log-level: uvicorn logs warnings only"),
        ("--max-num-seqs=8", "--max-num-seqs: use --running_max_req_size"),
        # LightLLM's own flags.
        ("--dp", "--dp: data parallelism is not built in"),
        ("--disable_log_stats", "--disable_log_stats: no periodic statistics are logged; /metrics exports them"),
        ("--disable-log-stats", "--disable-log-stats: no periodic statistics are logged"),
        ("--splitfuse_mode", "--splitfuse_mode: chunked prefill is on by default"),
        ("--max_req_input_len", "--max_req_input_len: a prompt may use all of --max_req_total_len"),
        ("--output_constraint_mode", "--output_constraint_mode: structured output"),
        ("--nnodes", "--nnodes: one server runs on one machine"),
        ("--quant_cfg", "--quant_cfg: quantization is not supported"),
        ("--enable_fa3", "--enable_fa3: attention kernels are chosen with --attention_backend"),
        # Either spelling finds the entry.
        ("--enable-flashinfer-decode", "--enable-flashinfer-decode: attention kernels are chosen"),
        ("--tensor_parallel_size", "--tensor_parallel_size: use --tp"),
    ],
)
def test_unknown_vllm_and_lightllm_flags_name_what_to_use(capsys, flag, hint):
    with pytest.raises(SystemExit) as exc:
        parse_server_args(["--model_dir", "/m", flag, "x"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("error: unrecognized arguments:")
    assert hint in err


@pytest.mark.parametrize("argv, named", [
    (["--port", "8001", "--port", "8002"], "--port is given twice;"),
    (["--port=8001", "--port", "8002"], "--port is given twice;"),
    (["--eos_id", "1", "--eos_id", "2"], "--eos_id is given twice;"),
    (["--disable_chunked_prefill", "--disable_chunked_prefill"], "--disable_chunked_prefill is given twice;"),
])
def test_a_flag_given_twice_is_refused_instead_of_keeping_the_last(capsys, argv, named):
    # argparse would keep the last value and drop the first without a word.
    with pytest.raises(SystemExit) as exc:
        parse_server_args(["--model_dir", "/m", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {named} give it once, with all its values")
    assert parse_server_args(["--model_dir", "/m", "--eos_id", "1", "2"]).eos_id == [1, 2]


def test_an_unknown_dashed_flag_without_an_underscore_twin_gets_no_hint(capsys):
    with pytest.raises(SystemExit):
        parse_server_args(["--model_dir", "/m", "--no-such-flag"])
    assert capsys.readouterr().err.startswith("error: unrecognized arguments: --no-such-flag (--help lists the flags)")


# --- 3: role labels say who reads each flag -----------------------------------------------------


_ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    "flag, help_roles, en_used_by, cn_used_by",
    [
        # The master bounds transfer setups and leases with it; the nodes every transfer wait.
        ("pd_transfer_timeout_seconds", ("Prefill/decode nodes:", "PD master:"), "nodes, master", "节点、master"),
        # The master's heartbeat interval; a node's registration-retry pace (registration_client).
        ("pd_heartbeat_interval", ("PD master:", "Prefill/decode nodes:"), "master, nodes", "master、节点"),
        ("pd_kv_page_size", ("Prefill nodes:",), "prefill node", "prefill 节点"),
    ],
)
def test_help_and_both_docs_name_every_role_that_reads_the_flag(flag, help_roles, en_used_by, cn_used_by):
    from lightllm.server.launch.arg_parser import flags_read_by, make_argument_parser

    help_text = next(a.help for a in make_argument_parser()._actions if a.dest == flag)
    for role in help_roles:
        assert role in help_text, help_text
    assert (flag in flags_read_by("pd_master")) == ("PD master:" in help_text)
    for lang, used_by in (("EN", en_used_by), ("CN", cn_used_by)):
        table = (_ROOT / "docs" / lang / "pd_deployment.md").read_text()
        row = next(line for line in table.splitlines() if line.startswith(f"| `--{flag}` |"))
        assert row.split(" | ")[2] == used_by, row


# --- 4, 5, 6, 10: a flag another flag cancels ---------------------------------------------------


@pytest.mark.parametrize(
    "argv, start",
    [
        (["--disable_prefill_overtake_bound", "--prefill_max_overtake_tokens", "4096"],
         "--prefill_max_overtake_tokens sets the overtaking bound, which --disable_prefill_overtake_bound turns off"),
        (["--disable_prefill_overtake_bound", "--prefill_overtake_fraction", "0.5"],
         "--prefill_overtake_fraction sets the overtaking bound"),
        (["--disable_prefill_overtake_bound", "--prefill_max_overtake_tokens", "1", "--prefill_overtake_fraction", "0"],
         "--prefill_max_overtake_tokens, --prefill_overtake_fraction set the overtaking bound"),
        (["--prefill_queue_strategy", "lpm", "--disable_dynamic_prompt_cache"],
         "--prefill_queue_strategy lpm orders by prefix-cache hits, which --disable_dynamic_prompt_cache turns off"),
        (["--disable_mixed_batches", "--disable_chunked_prefill"],
         "--disable_mixed_batches does nothing with --disable_chunked_prefill"),
        (["--mem_fraction", "0.5", "--max_total_token_num", "10000"],
         "--mem_fraction sizes the KV cache from the free memory, which --max_total_token_num fixes instead"),
        (["--reserved_memory_gb", "2", "--max_total_token_num", "10000"], "--reserved_memory_gb sizes the KV cache"),
    ],
)
def test_a_flag_another_flag_cancels_is_refused(argv, start):
    assert _refusal(*argv).startswith(start)


@pytest.mark.parametrize(
    "argv",
    [
        ["--disable_prefill_overtake_bound"],
        ["--prefill_queue_strategy", "lpm"],
        ["--disable_dynamic_prompt_cache", "--prefill_queue_strategy", "hrrn"],
        ["--disable_mixed_batches"],
        ["--disable_chunked_prefill"],
        ["--max_total_token_num", "10000"],
        ["--mem_fraction", "0.5", "--reserved_memory_gb", "2"],
    ],
)
def test_each_flag_alone_is_accepted(argv):
    validate_args(parse_server_args(["--model_dir", "/m", *argv]))


@pytest.fixture()
def dynamic_ntk_dir(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    """The tiny Llama with a dynamic-NTK RoPE (length-dependent: the prefix cache is off)."""
    model_dir = tmp_path / "dynamic"
    shutil.copytree(tiny_llama_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


@pytest.fixture()
def dynamic_ntk_config(dynamic_ntk_dir: Path) -> ModelConfig:
    model_config = ModelConfig.from_dir(str(dynamic_ntk_dir))
    assert model_config.rope.length_dependent
    return model_config


def test_lpm_is_refused_on_a_checkpoint_whose_rope_turns_the_prefix_cache_off(dynamic_ntk_config, tiny_llama_dir):
    args = parse_server_args(["--model_dir", "/m", "--prefill_queue_strategy", "lpm"])
    with pytest.raises(ArgumentError, match=r"^--prefill_queue_strategy lpm orders by prefix-cache hits, but this "
                                            r"checkpoint's RoPE scales with each request's length"):
        check_args_against_checkpoint(args, dynamic_ntk_config, 1024)
    check_args_against_checkpoint(args, ModelConfig.from_dir(str(tiny_llama_dir)), 1024)
    check_args_against_checkpoint(parse_server_args(["--model_dir", "/m"]), dynamic_ntk_config, 1024)


# --- 7: range errors print the value as given ---------------------------------------------------


@pytest.mark.parametrize(
    "argv, end",
    [
        (["--prefill_overtake_fraction", "1000.0001"], "got 1000.0001"),
        (["--schedule_time_interval", "0.0009999999"], "got 0.0009999999"),
        (["--run_mode", "pd_master", "--pd_heartbeat_interval", "60.0000001"], "got 60.0000001 (shorter"),
    ],
)
def test_range_errors_print_the_value_as_given_not_rounded(argv, end):
    assert end in _refusal(*argv)


# --- 8: every seconds flag has an upper bound the code can wait ---------------------------------


_ROLE_OF = {"pd_reserve_lease_seconds": "decode", "pd_transfer_timeout_seconds": "prefill"}


@pytest.mark.parametrize("name", [n for n in SECONDS_FLAGS if n != "pd_heartbeat_interval"])
@pytest.mark.parametrize("value", ["1e7", "1e300"])
def test_a_seconds_flag_beyond_what_a_wait_can_take_is_refused(name, value):
    """1e7 s is past epoll's and zmq's INT_MAX milliseconds: the front door's thread died with
    OverflowError (its port open, every request hanging), the router in its zmq poll."""
    role = _ROLE_OF.get(name, "pd_master" if name.startswith("pd_") else "normal")
    message = _refusal("--run_mode", role, f"--{name}", value)
    assert message.startswith(f"--{name} must be at most 1,000,000 seconds"), message
    validate_args(parse_server_args(["--model_dir", "/m", "--run_mode", role, f"--{name}", str(MAX_WAIT_SECONDS)]))


def test_the_master_node_expiry_is_bounded_too():
    message = _refusal("--run_mode", "pd_master", "--pd_heartbeat_interval", "60", "--pd_max_missed_heartbeats",
                       "100000")
    assert message.startswith("--pd_max_missed_heartbeats 100000 x --pd_heartbeat_interval 60.0 must be at most")


# --- 9: the torch.distributed rendezvous is checked before anything is created ------------------


def test_an_nccl_host_that_does_not_resolve_is_refused_like_host():
    with pytest.raises(PortUnavailableError, match=r"^--nccl_host 'nohost.invalid': cannot resolve it"):
        check_nccl_rendezvous(parse_server_args(["--model_dir", "/m", "--nccl_host", "nohost.invalid"]))
    with pytest.raises(ArgumentError, match=r"^--nccl_host 'not a host!': not an IP address"):
        check_nccl_rendezvous(parse_server_args(["--model_dir", "/m", "--nccl_host", "not a host!"]))
    check_nccl_rendezvous(parse_server_args(["--model_dir", "/m"]))


def test_a_taken_nccl_port_exits_3_naming_the_flag_before_anything_starts(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        with pytest.raises(PortUnavailableError, match=rf"^cannot listen on 127.0.0.1:{taken} \(--nccl_port\)"):
            check_nccl_rendezvous(parse_server_args(["--model_dir", "/m", "--tp", "2", "--nccl_port", str(taken)]))
        # One rank has no rendezvous: the port is never listened on.
        check_nccl_rendezvous(parse_server_args(["--model_dir", "/m", "--nccl_port", str(taken)]))
        # The launcher: one line, exit 3, before the HTTP port is bound or the model read.
        done = subprocess.run(
            [sys.executable, "-m", "lightllm.server.api_server", "--model_dir", str(tmp_path), "--port", "18641",
             "--tp", "2", "--nccl_port", str(taken)],
            capture_output=True, text=True, timeout=120,
        )
    assert done.returncode == EXIT_PORT_UNAVAILABLE, done.stderr
    assert done.stderr.splitlines() == [f"error: cannot listen on 127.0.0.1:{taken} (--nccl_port): Address already in "
                                        "use; is another server or torch.distributed job using it? Give another "
                                        "--nccl_port, or none for a free one"], done.stderr



@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "0:0:0:0:0:0:0:0"])
def test_a_wildcard_nccl_host_is_refused_naming_why(host):
    """--nccl_host :: was taken, and the rendezvous store then listened on every interface."""
    with pytest.raises(ArgumentError, match=rf"^--nccl_host '{re.escape(host)}' is a wildcard: the rendezvous store "
                                            "would listen on every interface; give the address the ranks reach it on"):
        check_nccl_rendezvous(parse_server_args(["--model_dir", "/m", "--tp", "2", "--nccl_host", host]))


def test_a_taken_ipv6_nccl_port_is_named_bracketed():
    """'cannot listen on ::1:18600' read as host ::1:18600 with no port; --host's error brackets it."""
    try:
        holder = socket.create_server(("::1", 0), family=socket.AF_INET6)
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with holder:
        taken = holder.getsockname()[1]
        for host in ("::1", "[::1]"):
            with pytest.raises(PortUnavailableError, match=rf"^cannot listen on \[::1\]:{taken} \(--nccl_port\)"):
                check_nccl_rendezvous(parse_server_args(["--model_dir", "/m", "--tp", "2", "--nccl_host", host,
                                                         "--nccl_port", str(taken)]))

# --- 11: a default max_new_tokens that leaves no room for a prompt -----------------------------


def test_a_default_max_new_tokens_at_or_past_the_context_is_refused(tiny_llama_dir):
    config = ModelConfig.from_dir(str(tiny_llama_dir))
    args = parse_server_args(["--model_dir", "/m", "--max_new_tokens_default", "5000", "--max_req_total_len", "1024"])
    with pytest.raises(ArgumentError, match=r"^--max_new_tokens_default 5000 leaves no room for a prompt within the "
                                            r"1024-token context .*give at most 1023$"):
        check_args_against_checkpoint(args, config, 1024)
    args.max_new_tokens_default = 1024
    with pytest.raises(ArgumentError, match="--max_new_tokens_default 1024 leaves no room"):
        check_args_against_checkpoint(args, config, 1024)
    args.max_new_tokens_default = 1023
    check_args_against_checkpoint(args, config, 1024)


# --- 5, 9, 11 through the launcher: refused in one line before any process starts ---------------


def _launch(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lightllm.server.api_server", *argv],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "argv, code, start",
    [
        (["--device", "cpu", "--port", "18642", "--max_new_tokens_default", "5000", "--max_req_total_len", "1024"], 2,
         "error: --max_new_tokens_default 5000 leaves no room for a prompt"),
        (["--run_mode", "pd_master", "--port", "18643", "--max_new_tokens_default", "1024", "--max_req_total_len",
          "1024"], 2, "error: --max_new_tokens_default 1024 leaves no room for a prompt"),
        (["--port", "18644", "--tp", "2", "--nccl_host", "nohost.invalid"], EXIT_PORT_UNAVAILABLE,
         "error: --nccl_host 'nohost.invalid': cannot resolve it"),
        # One rank opens no rendezvous: the flags would do nothing.
        (["--port", "18647", "--nccl_port", "29999"], 2,
         "error: --nccl_port sets the torch.distributed rendezvous of tensor-parallel ranks, which one rank (--tp 1) "
         "never opens; give it with --tp 2 or more, or leave it out"),
    ],
)
def test_the_launcher_refuses_in_one_line(tiny_llama_dir, argv, code, start):
    done = _launch("--model_dir", str(tiny_llama_dir), *argv)
    lines = [line for line in done.stderr.splitlines() if " INFO " not in line]
    assert done.returncode == code and len(lines) == 1 and lines[0].startswith(start), done.stderr
    assert "Traceback" not in done.stderr and "leaked" not in done.stderr


def test_the_launcher_refuses_lpm_on_a_dynamic_ntk_checkpoint(dynamic_ntk_dir):
    done = _launch("--model_dir", str(dynamic_ntk_dir), "--device", "cpu", "--port", "18645",
                   "--prefill_queue_strategy", "lpm")
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1].startswith("error: --prefill_queue_strategy lpm orders by prefix-cache hits")


@pytest.mark.parametrize(
    "argv, start",
    [
        # A blank id was served as '': every request naming the model got a 404.
        (["--model_name", ""], "--model_name values must be non-empty and carry no surrounding whitespace, got ''"),
        (["--model_name", "small", " small"], "--model_name values must be non-empty and carry no surrounding"),
        # It started and then refused every request (a one-token prompt leaves no room).
        (["--max_req_total_len", "1"], "--max_req_total_len 1 leaves no room for a completion"),
    ],
)
def test_settings_that_could_never_serve_a_request_are_refused(argv, start):
    assert _refusal(*argv).startswith(start)


def test_the_smallest_serving_settings_are_accepted():
    validate_args(parse_server_args(["--model_dir", "/m", "--model_name", "a b", "--max_req_total_len", "2"]))


@pytest.mark.parametrize("argv, named", [
    (["--api-key", "supersecret"], "--api-key (and 1 value, not shown: one may be a key) (--api-key: use --api_key)"),
    (["--admin-api-key", "supersecret"], "--admin-api-key (and 1 value, not shown"),
    (["--api_ke", "supersecret"], "--api_ke (and 1 value, not shown"),
    (["--api-key=supersecret"], "--api-key (and 1 value, not shown"),
    (["--pd-cluster-key", "supersecret", "--no-such-flag"], "--pd-cluster-key --no-such-flag (and 1 value, not shown"),
    (["supersecret"], "unrecognized arguments: 1 value (not shown: one may be a key)"),
    # A key may start with "-" (token_urlsafe's alphabet has it): still a value, never a flag name.
    (["--api-key", "-Xsupersecret"], "--api-key (and 1 value, not shown"),
    (["--api-key", "--supersecret"], "--api-key (and 1 value, not shown"),
    (["-supersecret"], "unrecognized arguments: 1 value (not shown: one may be a key)"),
    (["--api_ke", "--Zk3supersecret"], "--api_ke (and 1 value, not shown"),
    (["--api-key", "k1", "--Zsupersecret"], "--api-key (and 2 values, not shown"),
    # Names that merely contain "token" are not secret flags: the next flag is still named.
    (["--return-tokens-as-token-ids", "--max-num-seqs", "8"],
     "--return-tokens-as-token-ids --max-num-seqs (and 1 value, not shown"),
])
def test_an_unknown_flag_is_named_without_its_value(argv, named):
    # vLLM's --api-key spelling printed the key on the terminal (and in whatever log captured it).
    done = subprocess.run([sys.executable, "-m", "lightllm.server.api_server", "--model_dir", "/m", *argv],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert named in done.stderr and "supersecret" not in done.stderr + done.stdout, done.stderr


@needs_link_local
def test_a_link_local_nccl_host_with_its_zone_is_taken_and_given_a_port():
    """A zone names an interface of this machine, where the ranks meet: it was refused as meaningless
    "on another machine", and start-up's free port for it raised EINVAL."""
    host = link_local_address()
    for spelling in (host, f"[{host}]"):
        args = parse_server_args(["--model_dir", "/m", "--tp", "2", "--nccl_host", spelling])
        check_nccl_rendezvous(args)
        args.nccl_port = free_port(spelling)  # as start.py picks one when --nccl_port is not given
        check_nccl_rendezvous(args)
