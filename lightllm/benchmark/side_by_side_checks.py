"""What ``side_by_side`` refuses before any engine starts, each as a one-line ``ValueError``.

Every refusal here used to surface only after a server had loaded: a negative seed as the
client's traceback, a prompt the client cannot build as its traceback pasted into the error
line, ``--port`` in ``--server_args`` as a refused start, and a case longer than the context as a
run that reported success on cut outputs (or completed none of its prompts).
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import Optional, Sequence

from lightllm.benchmark.side_by_side_cases import WARMUP_SEED_OFFSET, Case
from lightllm.benchmark.workload_context import overflow_consequence, servers_context

# Flags side_by_side gives our server itself; a second value would be ambiguous, and --run_mode
# would start something else than the one server the comparison is about.
RESERVED_SERVER_FLAGS: tuple[str, ...] = ("--model_dir", "--model_name", "--host", "--port", "--run_mode")
# Importing vLLM takes seconds; a first run may compile bytecode.
PEER_VERSION_TIMEOUT_S = 300
# The client seeds numpy's legacy generator, which takes seeds 0 to 2**32 - 1 only.
MAX_CLIENT_SEED = 2**32 - 1


def check_server_args(server_args: Sequence[str]) -> None:
    """Refuse a flag in ``--server_args`` that side_by_side sets on our server itself."""
    for arg in server_args:
        flag = arg.split("=", 1)[0]
        if flag in RESERVED_SERVER_FLAGS:
            raise ValueError(f"--server_args must not set {flag}: side_by_side sets it on our server itself "
                             "(give --ports FIRST-LAST to choose where its port comes from)")


def check_seeds(seed: int, cases: Sequence[Case]) -> None:
    """Refuse a ``--seed`` whose case or warm-up seeds (``seed + index``, ``seed + 1000``) the client refuses."""
    highest = seed + max(WARMUP_SEED_OFFSET, len(cases) - 1)
    if seed < 0 or highest > MAX_CLIENT_SEED:
        raise ValueError(f"--seed must be within 0 and {MAX_CLIENT_SEED - max(WARMUP_SEED_OFFSET, len(cases) - 1)} "
                         f"(the client takes seeds up to 2**32 - 1, and the warm-up uses --seed + "
                         f"{WARMUP_SEED_OFFSET}), got {seed}")


def check_client_lengths(cases: Sequence[Case], special_tokens: int) -> None:
    """Refuse a case whose prompt the client's random dataset cannot build.

    ``vllm bench serve`` fills ``INPUT`` minus the tokenizer's ``special_tokens`` with sampled
    tokens after the shared ``PREFIX``, and refuses a prompt left with no token at all.
    """
    for case in cases:
        if case.prefix_len + max(0, case.input_len - special_tokens) < 1:
            raise ValueError(f"case {case.label}: an INPUT of {case.input_len} leaves the client's prompt no token "
                             f"(the tokenizer adds {special_tokens} special token(s), which INPUT counts): give an "
                             f"INPUT above {special_tokens}, or a PREFIX")


def check_cases_fit(model_dir: str, cases: Sequence[Case], engines: Sequence[str], server_args: Sequence[str]) -> None:
    """Refuse a case longer than the context of an engine it runs on.

    Our server's context is the checkpoint's, or the ``--max_req_total_len`` in ``--server_args``;
    vLLM's is the checkpoint's.  Ours cuts an output that does not fit (the run would report
    lengths it did not measure) and refuses a prompt that leaves no room; vLLM refuses both.
    """
    processes = {engine: ({"--server_args": server_args} if engine == "ours" else {}) for engine in set(engines)}
    limit = servers_context(model_dir, processes)
    if limit is None:
        return
    for case in cases:
        prompt = case.prefix_len + case.input_len
        if prompt + case.output_len <= limit.tokens:
            continue
        if "ours" in engines:
            consequence = overflow_consequence(prompt, case.output_len, limit.tokens)
        else:
            consequence = "vLLM would answer every such request with HTTP 400"
        raise ValueError(f"case {case.label} asks for {prompt} prompt plus {case.output_len} output tokens, "
                         f"{prompt + case.output_len} in all, more than {limit.name} of {limit.tokens} "
                         f"({limit.source}); {consequence}: lower the case's lengths")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> Optional[frozenset]:
    """The first CPU's feature flags from ``cpuinfo``, or None where there is no such file."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return frozenset(value.split())
    return None


def exit_description(returncode: int) -> str:
    """``exited with 1``, or ``died of SIGILL (illegal instruction)`` for a process a signal ended."""
    if returncode >= 0:
        return f"exited with {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        return f"died of signal {-returncode}"
    if name == "SIGILL":
        flags = cpu_flags()
        vector = "" if flags is None else "; this CPU has " + ("avx512f" if "avx512f" in flags else (
            "avx2, not avx512f" if "avx2" in flags else "neither avx2 nor avx512f"))
        return f"died of SIGILL, an illegal instruction: the build uses CPU instructions this machine lacks{vector}"
    return f"died of {name}"


def check_peer_runs(vllm_bin: Path) -> None:
    """Refuse a vLLM install that cannot start, before our server loads.

    The client of every run is vLLM's, so a peer whose build this CPU cannot run (vLLM's CPU
    wheels are compiled for AVX-512; on an AVX2-only VM ``vllm`` dies of SIGILL as it starts) failed
    only at the first warm-up, after our server had loaded, as "client failed: (no output)".
    """
    try:
        done = subprocess.run([str(vllm_bin), "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, errors="replace", timeout=PEER_VERSION_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ValueError(f"{vllm_bin} --version did not answer within {PEER_VERSION_TIMEOUT_S} s") from None
    except OSError as error:
        raise ValueError(f"{vllm_bin} cannot run: {error.strerror or error}") from None
    if done.returncode != 0:
        lines = [line for line in done.stdout.splitlines() if line.strip()]
        said = f": {lines[-1].strip()[:200]}" if lines else ""
        raise ValueError(f"{vllm_bin} --version {exit_description(done.returncode)}{said}; vLLM is both the peer "
                         "and the client of every run, so nothing can be measured with it")
