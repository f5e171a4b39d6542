"""The start-up reading of the ``LIGHTLLM_*`` environment for one server process.

Two duties, both before anything is loaded:

* every variable this process reads is read once and a bad value stops the start with one line
  (exit 2), instead of failing requests or a model rank later;
* every ``LIGHTLLM_*`` variable that is set but that nothing in this process will read gets one
  warning line naming why: a name no release reads (a typo, with the closest known name), a
  variable this run mode does not read (``LIGHTLLM_TORCH_THREADS`` on a PD master), one a flag
  given on the command line replaces (``LIGHTLLM_API_KEY`` with ``--api_key``), or a CPU-only
  variable on a CUDA device; so do two foreign variables a user may expect to work here:
  ``VLLM_API_KEY`` where this server's keys are used instead, and uvicorn's ``FORWARDED_ALLOW_IPS``
  (this server never trusts ``X-Forwarded-For``: a client is its connection's peer address).

Warnings rather than refusals: the environment is shared by every process an operator starts
(a PD master and its nodes often inherit one exported set), so a variable meant for another
role is normal; being told it has no effect here is what the operator needs.
"""

from __future__ import annotations

import argparse
import difflib
import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Tuple

from lightllm.server.run_mode import PD_NODE_MODES, PD_RUN_MODES, RUN_MODES, RunMode
from lightllm.utils.envs_utils import (
    ENV_VARS,
    VLLM_API_KEY_ENV,
    REPLACED_ENV_VARS,
    api_keys_from_env,
    idle_malloc_trim_seconds,
    pd_cluster_key_from_env,
    pd_node_busy_retry_timeout_seconds,
    pd_transfer_failure_probability,
    refuse_replaced_env_vars,
    step_trace_path,
)

ENV_PREFIX = "LIGHTLLM_"


@dataclass(frozen=True)
class EnvVarReaders:
    """The server processes that read one environment variable."""

    # The --run_mode values whose processes read it.
    run_modes: Tuple[str, ...]
    # True: read only when the model ranks run on the CPU (the torch thread counts).
    cpu_only: bool = False
    # A flag that, when given, is used instead of the variable (its dest name).
    flag: Optional[str] = None
    # Reads it at start, raising ValueError (one line naming it) for a bad value. None for the
    # CPU-only ones: launch/sizing.py reads them once the device is known (CUDA does not read them).
    check: Optional[Callable[[], object]] = None


_MODEL_RANK_MODES = (RunMode.NORMAL.value,) + PD_NODE_MODES
_CPU_RANKS = EnvVarReaders(_MODEL_RANK_MODES, cpu_only=True)

# Who reads each variable of envs_utils.ENV_VARS (a test keeps the two tables' names equal), in
# the order their values are checked.
ENV_VAR_READERS: Dict[str, EnvVarReaders] = {
    "LIGHTLLM_API_KEY": EnvVarReaders(RUN_MODES, flag="api_key", check=lambda: api_keys_from_env("LIGHTLLM_API_KEY")),
    "LIGHTLLM_ADMIN_API_KEY": EnvVarReaders(RUN_MODES, flag="admin_api_key",
                                            check=lambda: api_keys_from_env("LIGHTLLM_ADMIN_API_KEY")),
    "LIGHTLLM_PD_CLUSTER_KEY": EnvVarReaders(PD_RUN_MODES, flag="pd_cluster_key", check=pd_cluster_key_from_env),
    "LIGHTLLM_PD_TRANSFER_FAILURE_PROBABILITY": EnvVarReaders((RunMode.PREFILL.value,),
                                                              check=pd_transfer_failure_probability),
    "LIGHTLLM_PD_NODE_BUSY_RETRY_TIMEOUT_SECONDS": EnvVarReaders((RunMode.PD_MASTER.value,),
                                                                 check=pd_node_busy_retry_timeout_seconds),
    "LIGHTLLM_IDLE_MALLOC_TRIM": EnvVarReaders(_MODEL_RANK_MODES, check=idle_malloc_trim_seconds),
    "LIGHTLLM_STEP_TRACE": EnvVarReaders(_MODEL_RANK_MODES, check=step_trace_path),
    "LIGHTLLM_TORCH_THREADS": _CPU_RANKS,
    "LIGHTLLM_PREFILL_TORCH_THREADS": _CPU_RANKS,
    "LIGHTLLM_WIDE_FORWARD_MS_PER_TOKEN": _CPU_RANKS,
}

# Variables LightLLM reads that this server does not, and what does their job here: a user arriving
# with LightLLM's environment is told the flag, not only that the name is unknown.
FOREIGN_ENV_HINTS: Dict[str, str] = {
    "LIGHTLLM_LOG_LEVEL": "use --log_level (debug, info, warning, error)",
}

# uvicorn's list of proxies whose X-Forwarded-For it trusts: this server turns that rewriting off (a
# client is its socket's peer address), so the variable is not read; a start with it set is told so.
FORWARDED_ALLOW_IPS_ENV = "FORWARDED_ALLOW_IPS"
FORWARDED_ALLOW_IPS_WARNING = (
    f"{FORWARDED_ALLOW_IPS_ENV} is set but not read: this server never trusts X-Forwarded-For; a client is the "
    "address of its connection (behind a proxy, the proxy's), and the per-client limits count that address "
    "(docs/EN/limits_and_auth.md, Client address)")

# LIGHTLLM_* names the project's scripts read (not the server): not reported as unknown when set.
SCRIPT_ENV_VARS = {
    "LIGHTLLM_DEMO_MODEL_DIR": "scripts/start_1p1d.sh",
}


def check_environment_values(run_mode: str) -> None:
    """Read every device-independent variable ``run_mode``'s processes read; raise ``ValueError``
    (one line naming it) for the first bad value, or for a variable a former release read."""
    refuse_replaced_env_vars()
    for readers in ENV_VAR_READERS.values():
        if readers.check is not None and run_mode in readers.run_modes:
            readers.check()


def unread_variable_warnings(args: argparse.Namespace, environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """One line per set ``LIGHTLLM_*`` variable that no process of ``args.run_mode`` will read.

    The device is not known yet: :func:`cpu_only_variable_warnings` covers the CPU-only ones.
    An empty value counts as unset, as every reader treats it.
    """
    environ = os.environ if environ is None else environ
    warnings = []
    for name in sorted(name for name, value in environ.items() if name.startswith(ENV_PREFIX) and value):
        if name in REPLACED_ENV_VARS or name in SCRIPT_ENV_VARS:
            continue  # refused at start / read by a script, not the server
        readers = ENV_VAR_READERS.get(name)
        if name in FOREIGN_ENV_HINTS:
            warnings.append(f"{name} is set but only LightLLM reads it, not this server: {FOREIGN_ENV_HINTS[name]}")
        elif readers is None:
            close = difflib.get_close_matches(name, list(ENV_VARS), n=1, cutoff=0.8)
            hint = f" (did you mean {close[0]}?)" if close else ""
            warnings.append(f"{name} is set but no LIGHTLLM_* variable of that name is read{hint}; "
                            "the variables are listed in docs/EN/server_args.md")
        elif args.run_mode not in readers.run_modes:
            warnings.append(f"{name} is set but a {args.run_mode} process does not read it "
                            f"(read by: {', '.join(readers.run_modes)}); it has no effect here")
        elif readers.flag is not None and getattr(args, readers.flag) is not None:
            warnings.append(f"{name} is set but --{readers.flag} was given, which is used instead")
    if environ.get(VLLM_API_KEY_ENV):
        if args.run_mode in PD_NODE_MODES:
            warnings.append(f"{VLLM_API_KEY_ENV} is set but not read: a PD {args.run_mode} node serves no public "
                            "API (its /pd/ paths take the cluster key)")
        elif args.api_key or environ.get("LIGHTLLM_API_KEY"):
            # Without a key of ours the start is refused instead (AuthPolicy.from_args).
            warnings.append(f"{VLLM_API_KEY_ENV} is set but not read: the API keys are those of "
                            f"{'--api_key' if args.api_key else 'LIGHTLLM_API_KEY'}")
    if environ.get(FORWARDED_ALLOW_IPS_ENV):
        warnings.append(FORWARDED_ALLOW_IPS_WARNING)
    return warnings


def cpu_only_variable_warnings(run_mode: str, device: str, environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """One line per set CPU-only variable (torch thread counts) when the model runs on ``device`` != cpu."""
    environ = os.environ if environ is None else environ
    if device == "cpu":
        return []
    return [
        f"{name} is set but the model ranks run on {device}, where it is not read (CPU ranks only)"
        for name, readers in ENV_VAR_READERS.items()
        if readers.cpu_only and run_mode in readers.run_modes and environ.get(name)
    ]
