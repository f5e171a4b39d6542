"""The one argument parser of the server: flags, defaults, help text and the roles that read each
flag (:func:`~lightllm.server.launch.flag_roles.add_flag`) live only here.

Docs (docs/*/server_args.md) are generated from this parser by ``python -m
lightllm.server.launch.args_doc``; the start-up code checks combinations with
:func:`lightllm.server.launch.args_check.validate_args` so impossible settings end in a one-line error.
"""

from __future__ import annotations

import argparse
import functools
import sys
from types import MappingProxyType
from typing import FrozenSet, Iterable, List, Mapping, Optional, Sequence

from lightllm.common.basemodel.serving_dtype import DATA_TYPE_CHOICES
from lightllm.common.sampling.logprobs_mode import DEFAULT_LOGPROBS_MODE, LOGPROBS_MODES
from lightllm.server.http.openai.tool_calls.parsers import TOOL_CALL_PARSER_NAMES
from lightllm.server.launch.flag_roles import (
    EVERY_ROLE,
    MODEL_ROLES,
    PUBLIC_API,
    FlagReaders,
    add_flag,
    flag_readers,
)
from lightllm.server.launch.batching_flags import add_batching_flags
from lightllm.server.launch.http_flags import add_http_flags
from lightllm.server.launch.one_line_parser import OneLineErrorParser
from lightllm.utils.one_line_errors import finite_float
from lightllm.server.launch.pd_flags import add_pd_flags
from lightllm.server.launch.watchdog import DEFAULT_WATCHDOG_TIMEOUT_SECONDS, MIN_WATCHDOG_TIMEOUT_SECONDS
from lightllm.server.launch.flag_bounds import as_written
from lightllm.server.launch.seconds_flags import MAX_WAIT_SECONDS, SECONDS_LIMIT_HELP
from lightllm.server.run_mode import RUN_MODES, RunMode


class DefaultsInHelpFormatter(argparse.HelpFormatter):
    """``--help`` shows each flag's default, as vLLM's does (``--port`` 8000, ``--host`` 127.0.0.1
    differ from what a vLLM user expects); the generated server_args.md keeps them in a column."""

    def _get_help_string(self, action: argparse.Action) -> Optional[str]:
        text = action.help or ""
        default = action.default
        # None, False (a switch) and suppressed defaults say nothing a reader needs.
        if (action.option_strings and "%(default)" not in text and default not in (None, False, argparse.SUPPRESS)
                and not isinstance(default, bool)):
            text += " (default: %(default)s)"
        return text


def make_argument_parser() -> argparse.ArgumentParser:
    """Build the server's argument parser (usage errors: one line, see :class:`OneLineErrorParser`)."""
    parser = OneLineErrorParser(
        prog="python -m lightllm.server.api_server",
        # A prefix must not stand for a flag: `--max_new_tokens 64` silently meant
        # --max_new_tokens_default and LightLLM's `--mode` was "ambiguous" instead of unknown.
        allow_abbrev=False,
        formatter_class=DefaultsInHelpFormatter,
        description="Serve a local Hugging Face checkpoint over an OpenAI-compatible and a native HTTP API.",
    )
    group = parser.add_argument_group("deployment")
    add_flag(
        group, "--run_mode", roles=EVERY_ROLE,
        type=str,
        choices=list(RUN_MODES),
        default=RunMode.NORMAL.value,
        help="normal: one server runs prefill and decode. PD disaggregation (docs/*/pd_deployment.md): "
        "pd_master serves the public API and loads no weights; prefill and decode start nodes that "
        "register with the master at --pd_master_ip:--pd_master_port.",
    )
    add_flag(group, "--host", roles=EVERY_ROLE, type=str, default="127.0.0.1",
             help="HTTP listen address (an IPv6 address bracketed or not; nothing else in brackets; a link-local one with its zone naming the interface, e.g. fe80::1%%eth0, though not on a prefill or decode node, which advertises its --host to the master); 0.0.0.0: every IPv4 address, '::': every IPv6 and IPv4 address (dual stack).")
    add_flag(group, "--port", roles=EVERY_ROLE, type=int, default=8000, help="HTTP listen port.")
    add_flag(group, "--model_dir", roles=EVERY_ROLE, type=str, default=None, help="Local Hugging Face checkpoint directory.")
    add_flag(
        group, "--model_name", roles=EVERY_ROLE,
        type=str,
        nargs="+",
        default=None,
        help="Model ids a request's model may name (vLLM's --served-model-name); the API reports the first. "
        "Default: the directory name, and the --model_dir path as given.",
    )
    add_flag(
        group, "--tokenizer_mode", roles=EVERY_ROLE,
        type=str,
        choices=["fast", "slow", "auto"],
        default="fast",
        help="Tokenizer implementation: fast (Rust tokenizers), slow (Python; refused at start when transformers "
        "would load the fast one anyway, as transformers 5 does for most tokenizers) or auto.",
    )
    add_flag(
        group, "--tp", roles=MODEL_ROLES, type=int, default=1,
        help="Tensor-parallel size (model processes). Must divide num_attention_heads and intermediate_size, and "
             "divide or be a multiple of num_key_value_heads (refused at start otherwise): each rank holds a share of "
             "the KV heads, or, when --tp exceeds num_key_value_heads, a replica of one (as vLLM does).",
    )
    add_flag(group, "--nccl_host", roles=MODEL_ROLES, type=str, default="127.0.0.1", help="Rendezvous address of torch.distributed (an address of this machine, IPv6 bracketed or not, a link-local one with its zone naming the interface; rank 0's rendezvous store listens on it alone, not on every interface, so a wildcard (0.0.0.0, ::) is refused; checked at start: one that does not resolve or cannot be listened on exits 3). Refused with --tp 1, whose one rank opens no rendezvous.")
    add_flag(group, "--nccl_port", roles=MODEL_ROLES, type=int, default=None, help="Rendezvous port of torch.distributed; default: a free port. A taken port is refused at start (exit 3). Refused with --tp 1, whose one rank opens no rendezvous (LightLLM launch lines often pass one at any --tp: drop it when --tp is 1). Only the rendezvous uses it: the ranks' own connections (gloo on CPU, NCCL on GPU) take further ephemeral ports.")
    add_flag(
        group, "--data_type", roles=MODEL_ROLES,
        type=str,
        choices=list(DATA_TYPE_CHOICES),
        default="auto",
        help="Weight and KV dtype. auto takes config.json's dtype (dtype, else torch_dtype), else the weights' from their "
             "safetensors headers (as transformers and vLLM do); float16 is served in float32 on CPU; a float64 "
             "config is served in float32 with a warning; a dtype it cannot serve (int8 ...) is refused at start. "
             "An explicit value always wins over config.json.",
    )
    add_flag(group, "--device", roles=MODEL_ROLES, type=str, choices=["auto", "cpu", "cuda"], default="auto", help="Where the model runs.")
    add_flag(
        group, "--attention_backend", roles=MODEL_ROLES,
        type=str,
        choices=["auto", "torch", "torch_compiled", "cpp", "triton"],
        default="auto",
        help="Attention kernels: triton (Triton kernels reading the KV cache in place, plus fused RMSNorm and rotary; "
        "CUDA, or CPU only under TRITON_INTERPRET=1 for tests), torch (gather + scaled_dot_product_attention, the reference and the CPU path), "
        "cpp (CPU only: decode and prefill chunks of up to 16 tokens read the KV cache in place through a C++ kernel, longer "
        "prefill chunks through a tiled C++ kernel reading the context through the slot table; both kernels' vectors as wide as the build's (16 floats with AVX-512, 8 otherwise), both built for this machine "
        "on first use with the system compiler and cached under ~/.cache/lightllm/kernels; float32 or bfloat16, head_dim "
        "16/32/64/80/96/128/256, 1-8 or 16 query heads per KV head: a model outside that is refused, while auto runs it "
        "on torch's path), "
        "torch_compiled (CPU only: the same in place reads through a kernel torch.compile builds "
        "at startup, needs a C++ compiler; single requests, small batches and long prefill chunks as torch), "
        "auto (triton on CUDA when triton imports; cpp on CPU when a C++ compiler is on PATH and the kernel builds; else torch).",
    )
    add_flag(
        group, "--linear_backend", roles=MODEL_ROLES,
        type=str,
        choices=["auto", "torch", "onednn"],
        default="auto",
        help="Kernels of the projections (q/k/v, o, MLP, LM head): onednn (CPU only: each weight packed once at start-up into "
        "oneDNN's blocked layout, float32 or bfloat16; 2-4x torch's speed on the development VM), torch (torch.nn.functional.linear: "
        "MKL on CPU, cuBLAS on CUDA), auto (onednn on CPU when it runs for the dtype, else torch).",
    )
    add_flag(
        group, "--graceful_shutdown_seconds", roles=EVERY_ROLE,
        type=finite_float,
        default=30.0,
        help="On SIGTERM/SIGINT/SIGHUP: new requests get 503 at once, requests in flight may finish for at most this many "
        "seconds, then the rest end with an error and the server exits 0; 0 stops at once. A second signal stops at once."
        " " + SECONDS_LIMIT_HELP,
    )
    add_flag(
        group, "--watchdog_timeout", roles=MODEL_ROLES,
        type=finite_float,
        default=DEFAULT_WATCHDOG_TIMEOUT_SECONDS,
        help="Hang detection (SGLang's --watchdog-timeout): a child process (model rank, router, detokenizer) silent "
        "for this many seconds is taken for hung, and the server ends as when a child dies: every request fails with "
        "503 server_failed, exit code 1. Each child's main loop beats before and after each wait for work, so one "
        "step may take up to this long; a longer one (a huge prefill on a slow CPU, a first-time kernel compile) "
        f"counts as a hang. 0 turns it off; else at least {MIN_WATCHDOG_TIMEOUT_SECONDS:g} (an idle TP rank's loop "
        f"beats every 5-6 s), at most {as_written(MAX_WAIT_SECONDS)}. Refused on the PD master, which runs no model.",
    )

    add_batching_flags(parser)

    group = parser.add_argument_group("generation")
    add_flag(group, "--eos_id", roles=EVERY_ROLE, type=int, nargs="+", default=None, help="End-of-sequence token id(s); default: from the checkpoint.")
    add_flag(group, "--max_new_tokens_default", roles=PUBLIC_API, type=int, default=None, help="max_new_tokens when a request gives none, on every endpoint; default: 16 for /v1/completions and /generate (as OpenAI, vLLM and LightLLM), the remaining context for chat. Must be below the context (--max_req_total_len, default the checkpoint's): a prompt needs a token.")
    add_flag(
        group, "--sampling_seed", roles=MODEL_ROLES,
        type=int,
        default=None,
        help="Seed of the random generator that requests without their own seed sample from (the same on every "
        "TP rank). Default: a fresh seed drawn at each start and logged, so unseeded sampling differs between "
        "restarts; give the logged value to repeat it.",
    )
    add_flag(
        group, "--logprobs_mode", roles=MODEL_ROLES,
        choices=LOGPROBS_MODES,
        default=DEFAULT_LOGPROBS_MODE,
        help="What returned logprobs describe. scaled_logprobs (default, as LightLLM): the distribution after "
        "logit_bias, penalties, masks and temperature, before min-p/top-k/top-p. processed_logprobs (as vLLM's "
        "value of that name): the distribution each token was drawn from, after every processor and the "
        "min-p/top-k/top-p filters, renormalised (a filtered token is -inf; greedy rows: unfiltered, temperature 1). "
        "raw_logprobs (vLLM's default): the model's own distribution, log_softmax of its logits, whatever the "
        "sampling parameters. vLLM's raw_logits and processed_logits are not offered (the API's fields are "
        "log-probabilities). Prompt logprobs are always raw. PD prefill and decode nodes must agree (the master refuses a node that differs). "
        "Before scaled_logprobs had its name, processed_logprobs meant it: a launch line that passed processed_logprobs "
        "for LightLLM's numbers now passes scaled_logprobs.",
    )
    add_flag(
        group, "--generation_config", roles=PUBLIC_API,
        type=str,
        default="auto",
        help="Where sampling defaults come from for a request that leaves a field out: 'auto' reads the "
        "checkpoint's generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
        "presence_penalty, frequency_penalty, max_new_tokens: the keys vLLM reads; do_sample for /generate), as "
        "vLLM's default and LightLLM do; 'none' uses the server's own defaults; a directory reads its "
        "generation_config.json. A value outside the range a request may send is refused at start, naming the file "
        "and key. The values in effect are logged at start.",
    )
    add_flag(
        group, "--chat_template", roles=PUBLIC_API,
        type=str,
        default=None,
        help="Chat template for /v1/chat/completions replacing the tokenizer's: a Jinja file, or the template "
        "itself. Needed for a checkpoint without one; checked at start.",
    )
    add_flag(
        group, "--trust_request_chat_template", roles=PUBLIC_API,
        action="store_true",
        help="Accept a request's own chat_template (vLLM's chat_template field). Off by default: a template is a "
        "program the server runs (loops of any length on the tokenization threads), so it is refused with a 400 "
        "unless the clients are trusted.",
    )
    add_flag(
        group, "--tool_call_parser", roles=PUBLIC_API,
        type=str,
        choices=list(TOOL_CALL_PARSER_NAMES),
        default=None,
        help="Format in which the model writes tool calls, read back into tool_calls for chat requests with "
        "tool_choice 'auto' (the default when tools are given): hermes (JSON inside tool_call tags, as "
        "Qwen2/Qwen2.5 write them) or llama3_json (Llama 3.1 JSON, optionally after the python_tag token). Without it such "
        "requests get a 400; 'required', a named function and 'none' work without it (docs/*/api_compatibility.md).",
    )

    add_http_flags(parser)
    add_pd_flags(parser)

    group = parser.add_argument_group("logging")
    add_flag(group, "--log_level", roles=EVERY_ROLE, type=str, choices=["debug", "info", "warning", "error"], default="info", help="Log verbosity.")
    return parser


# The Namespace attribute that holds the dests written on the command line (see given_flags).
GIVEN_FLAGS_ATTR = "given_flags"


def parse_server_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the server's flags and record which of them the command line wrote.

    A flag written with its default value is still written: the role checks refuse a flag the
    process does not read whatever its value, so the namespace carries the written dests in
    ``given_flags``.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = make_argument_parser()
    args = parser.parse_args(argv)
    shadow = make_argument_parser()
    for action in shadow._actions:  # every dest absent unless written
        action.default = argparse.SUPPRESS
    setattr(args, GIVEN_FLAGS_ATTR, frozenset(vars(shadow.parse_args(argv))))
    return args


def flags_given(args: argparse.Namespace, names: Iterable[str]) -> List[str]:
    """The flags among ``names`` the command line wrote, in ``names`` order.

    For a namespace from :func:`parse_server_args`; one built otherwise (tests, library callers)
    counts a flag as given when its value differs from the parser's default.
    """
    written = getattr(args, GIVEN_FLAGS_ATTR, None)
    if written is not None:
        return [name for name in names if name in written]
    parser = make_argument_parser()
    return [name for name in names if hasattr(args, name) and getattr(args, name) != parser.get_default(name)]


@functools.lru_cache(maxsize=None)
def server_flag_readers() -> Mapping[str, FlagReaders]:
    """``dest -> readers`` of every server flag, as :func:`make_argument_parser` declares them."""
    return MappingProxyType(flag_readers(make_argument_parser()))


def flags_read_by(role: str) -> FrozenSet[str]:
    """The dests of the server flags that the run mode ``role`` reads."""
    return frozenset(name for name, readers in server_flag_readers().items() if role in readers.roles)


def flag_names(args: argparse.Namespace) -> List[str]:
    """The dests of the parser's flags present on ``args`` (without ``given_flags``)."""
    return [name for name in vars(args) if name != GIVEN_FLAGS_ATTR]
