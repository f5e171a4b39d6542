"""Every LIGHTLLM_* environment variable the server reads, with its meaning and default.

Flags belong in the argument parser; environment variables are kept for process-level knobs
that deployments set once (and for names LightLLM users already know).
"""

from __future__ import annotations

import os
from typing import Callable, List, Optional

# LIGHTLLM_WIDE_FORWARD_MS_PER_TOKEN's default (forward_threads.py explains the number). Kept
# here, with the variable, so the launcher sizes threads without importing the rank's torch code.
DEFAULT_WIDE_FORWARD_MS_PER_TOKEN = 0.15

# vLLM's variable for its API key, which this server does not read: refused when it would be the
# only key (a deployment moved from vLLM would serve without authentication), else warned about.
VLLM_API_KEY_ENV = "VLLM_API_KEY"

# LIGHTLLM_IDLE_MALLOC_TRIM's default: seconds a model rank stays idle before it returns freed
# heap memory to the kernel. The pages come back as page faults in the next forward (a burst of
# eight 1024-token prompts on the medium model faulted 35-54 thousand pages after a 3 s pause with
# a 1 s delay, ~30 with a longer one; its steps took ~3% longer), so a pause of a few seconds
# between bursts must not trigger it; a server idle for half a minute gives its activation memory back.
DEFAULT_IDLE_MALLOC_TRIM_SECONDS = 30.0

# LIGHTLLM_PD_NODE_BUSY_RETRY_TIMEOUT_SECONDS's default.  A normal server queues a burst it has
# no KV for and serves it as KV frees up; a PD master whose nodes answer busy does the same by
# retrying, and answering a burst with immediate 503s instead made a PD cluster refuse a third of
# a 64-request burst that a normal server of the same KV size served completely.  A minute lets
# such a burst drain (decode nodes free KV as their requests finish, typically within seconds)
# while a cluster that stays full still answers 503 server_busy in bounded time; 0 keeps the
# immediate answer for clients that retry on their own.
DEFAULT_PD_NODE_BUSY_RETRY_TIMEOUT_SECONDS = 60.0

ENV_VARS = {
    "LIGHTLLM_TORCH_THREADS": "Intra-op threads of each CPU model rank (decode over short contexts and everything else); default: (CPU cores - 1) divided by --tp, at least 1 (a core stays free for the HTTP, router and detokenization processes, which stream every decode step's tokens); at most 4 x the CPU count (refused at start above it).",
    "LIGHTLLM_PREFILL_TORCH_THREADS": "Intra-op threads a CPU model rank's forward borrows when its work pays for the front end's core (see LIGHTLLM_WIDE_FORWARD_MS_PER_TOKEN); default: LIGHTLLM_TORCH_THREADS if set, else CPU cores divided by --tp, at least 1; at least the threads of every forward (LIGHTLLM_TORCH_THREADS or its default) and at most 4 x the CPU count (refused at start otherwise).",
    "LIGHTLLM_WIDE_FORWARD_MS_PER_TOKEN": "A CPU forward runs with LIGHTLLM_PREFILL_TORCH_THREADS when its estimated work (matrix-product FLOPs and KV positions of this model, priced with rates measured at start-up) is at least this many milliseconds per token it streams; default " + f"{DEFAULT_WIDE_FORWARD_MS_PER_TOKEN:g}, 0: every forward wide, inf: only prefill forwards that stream nothing.",
    "LIGHTLLM_API_KEY": "Comma-separated API keys, used when --api_key is not given (keeps keys out of the process list); whitespace around a key and empty entries are dropped; a value holding no key (such as ',' or ' ') is refused at start; unset or empty: no keys.",
    "LIGHTLLM_ADMIN_API_KEY": "Comma-separated admin API keys, used when --admin_api_key is not given; read as LIGHTLLM_API_KEY is.",
    "LIGHTLLM_IDLE_MALLOC_TRIM": "Seconds a model rank must be idle after work before it returns freed heap memory to the kernel (malloc_trim); 0: never; at most 1e6; default " + f"{DEFAULT_IDLE_MALLOC_TRIM_SECONDS:g}.",
    "LIGHTLLM_STEP_TRACE": "A file path: rank 0 writes one CSV row per step that ran a forward (time, phases in ms, prompt tokens, decode rows, minor page faults; see lightllm/server/model_rank/step_trace.py), truncating the file at start; its directory must exist; default: no trace.",
    "LIGHTLLM_PD_TRANSFER_FAILURE_PROBABILITY": "For tests: probability in [0, 1] that a PD KV transfer is made to fail (the prefill side announces a wrong checksum for the intact payload, so the decode side's checksum check refuses it); default 0.",
    "LIGHTLLM_PD_CLUSTER_KEY": "The PD cluster's shared secret, used when --pd_cluster_key is not given (keeps it out of the process list); read by the PD master and the prefill and decode nodes only.",
    "LIGHTLLM_PD_NODE_BUSY_RETRY_TIMEOUT_SECONDS": "Seconds the PD master keeps retrying, with exponential backoff (at most 1 s apart), when every prefill or decode node answers busy, so that a burst waits for KV as on a normal server; then the client gets HTTP 503 (code server_busy) naming the busy node role; default " + f"{DEFAULT_PD_NODE_BUSY_RETRY_TIMEOUT_SECONDS:g}" + ", 0: no retry, the 503 comes at once; at most 1e6.",
}


def _env_int(name: str, minimum: int, requirement: str, maximum: Optional[int] = None) -> Optional[int]:
    """Environment variable ``name`` as an int in [``minimum``, ``maximum``], or None when unset or empty."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < minimum or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be {requirement}, got {raw!r}")
    return value


# Torch threads per CPU the thread-count variables may ask for. Each thread of a rank's pool is
# a busy-waiting OpenMP worker: beyond a few per core they only take turns on the same cores, and
# a count far beyond that (99999 was tried) exhausts the process's thread limit, so the rank's
# start then failed 11 s later with an EAGAIN from the C++ compiler that named nothing set by the
# user. The factor leaves room for machines whose reported cores are hyper-threads or are shared.
TORCH_THREADS_PER_CPU = 4


def max_torch_threads() -> int:
    """The largest LIGHTLLM_TORCH_THREADS / LIGHTLLM_PREFILL_TORCH_THREADS accepted on this machine."""
    return TORCH_THREADS_PER_CPU * (os.cpu_count() or 1)


def torch_threads_override(name: str = "LIGHTLLM_TORCH_THREADS") -> Optional[int]:
    """Environment variable ``name`` (a thread count) as an int in [1, :func:`max_torch_threads`], or None when unset."""
    bound = max_torch_threads()
    return _env_int(name, 1, f"an integer from 1 to {bound} ({TORCH_THREADS_PER_CPU} x the machine's "
                             f"{bound // TORCH_THREADS_PER_CPU} CPUs: more threads only take turns on the same cores)",
                    bound)


# Variables a former release read, and what replaced them: setting one is refused, not ignored.
REPLACED_ENV_VARS = {
    "LIGHTLLM_LONG_DECODE_POSITIONS": "LIGHTLLM_WIDE_FORWARD_MS_PER_TOKEN (decode forwards now run wide from their "
                                      "estimated work per streamed token, on every model width)",
}


def refuse_replaced_env_vars() -> None:
    """Raise for the first replaced variable that is set, naming what replaced it."""
    for name, replacement in REPLACED_ENV_VARS.items():
        if os.environ.get(name):
            raise ValueError(f"{name} is no longer read; use {replacement}")



def wide_forward_ms_per_token_override() -> Optional[float]:
    """``LIGHTLLM_WIDE_FORWARD_MS_PER_TOKEN`` as a float >= 0 (inf allowed), or None when unset."""
    if not os.environ.get("LIGHTLLM_WIDE_FORWARD_MS_PER_TOKEN"):
        return None
    return _env_float("LIGHTLLM_WIDE_FORWARD_MS_PER_TOKEN", "a number >= 0 (or inf)", lambda v: v >= 0)


# The longest wait in seconds, as for every seconds flag (lightllm.server.launch.seconds_flags,
# which this module below the server package does not import): longer would overflow a poll.
MAX_ENV_SECONDS = 1e6


def idle_malloc_trim_seconds() -> float:
    """``LIGHTLLM_IDLE_MALLOC_TRIM`` as seconds of idleness before a trim: inf for 0 (never), the
    default when unset; anything but a finite number >= 0 is refused."""
    if not os.environ.get("LIGHTLLM_IDLE_MALLOC_TRIM"):
        return DEFAULT_IDLE_MALLOC_TRIM_SECONDS
    seconds = _env_float("LIGHTLLM_IDLE_MALLOC_TRIM", "a number of seconds from 0 (never trim) to 1e6",
                         lambda v: 0.0 <= v <= MAX_ENV_SECONDS)
    return seconds if seconds > 0 else float("inf")


def step_trace_path() -> Optional[str]:
    """``LIGHTLLM_STEP_TRACE`` as an absolute file path, or None when unset or empty; refused when
    it names a directory, its directory does not exist, or the file cannot be opened for writing
    (it is created empty then; the rank truncates it when it starts tracing)."""
    raw = os.environ.get("LIGHTLLM_STEP_TRACE")
    if not raw:
        return None
    path = os.path.abspath(raw)
    folder = os.path.dirname(path)
    if os.path.isdir(path):
        raise ValueError(f"LIGHTLLM_STEP_TRACE must name a file, got the directory {raw!r}")
    if not os.path.isdir(folder):
        raise ValueError(f"LIGHTLLM_STEP_TRACE's directory {folder!r} does not exist")
    try:
        # Opening it is the only honest check: os.access says yes to root on a read-only mount or /proc.
        with open(path, "a"):
            pass
    except OSError as exc:
        raise ValueError(f"LIGHTLLM_STEP_TRACE {raw!r} cannot be written: {exc.strerror or exc}") from None
    return path


def key_character_problem(key: str, ascii_only: bool = False) -> Optional[str]:
    """Why ``key`` (an API, admin or cluster key) can never match as sent in an HTTP header, or None.

    The server reads a header's bytes as Latin-1 (as vLLM does): a key holding a character beyond
    U+00FF could never arrive, nor can a control character other than a tab travel in a header.
    ``ascii_only``: a key the server itself sends with httpx (the PD cluster key), which refuses
    anything beyond ASCII.  The message never shows the key.
    """
    for position, char in enumerate(key, 1):
        if (char < " " and char != "\t") or char == "\x7f":
            kind = "a control character (only a tab may travel in an HTTP header)"
        elif char > ("~" if ascii_only else "\xff"):
            kind = ("a character beyond ASCII (the cluster sends its key with httpx, which sends ASCII only)"
                    if ascii_only else "a character beyond Latin-1, which an HTTP header cannot carry")
        else:
            continue
        return f"character {position} of the key is {kind} (value not shown)"
    return None


def key_character_warning(key: str) -> Optional[str]:
    """A warning for a key that matches only from some clients, or None: a Latin-1 letter beyond
    ASCII (``é``) arrives from clients that encode headers as Latin-1 (Python's ``requests`` and
    ``http.client``); curl sends the bytes it is given (UTF-8 from most terminals: no match), and
    httpx, and so the ``openai`` package, refuses to send it."""
    if any(char > "~" for char in key):
        return ("holds a character beyond ASCII: clients that encode headers as Latin-1 (Python's requests and "
                "http.client) can send it, but curl sends it as typed (UTF-8 from most terminals, which does not "
                "match) and httpx, so the openai package, cannot send it (value not shown)")
    return None


def numbered_key(index: int, count: int) -> str:
    """``key 2 of 3`` (or ``the key`` when there is one), naming a key without showing it."""
    return "the key" if count == 1 else f"key {index} of {count}"


def api_keys_from_env(name: str) -> List[str]:
    """The comma-separated keys in environment variable ``name``; none when it is unset or empty.

    Whitespace around each key and empty entries are dropped (``"k1, k2,"``), but a value that
    holds no key at all is refused, naming the variable: ``","`` or ``" "`` used to yield no key,
    so the server served without authentication although the operator had set the variable, and
    warned nothing (``--api_key ""`` is refused the same way). The value is never shown (a secret).
    """
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return []
    keys = [key.strip() for key in raw.split(",") if key.strip()]
    if not keys:
        raise ValueError(f"{name} holds no key: its comma-separated keys must be non-empty "
                         f"({len(raw)} character{'' if len(raw) == 1 else 's'}, value not shown); unset it for no keys")
    for index, key in enumerate(keys, 1):
        problem = key_character_problem(key)
        if problem is not None:
            raise ValueError(f"{name} ({numbered_key(index, len(keys))}): {problem}")
    return keys


def _env_float(name: str, allowed: str, accept: Callable[[float], bool]) -> float:
    """Environment variable ``name`` as a float (0 when unset or empty); ``accept`` checks its range."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not accept(value):
        raise ValueError(f"{name} must be {allowed}, got {raw!r}")
    return value


def pd_transfer_failure_probability() -> float:
    """``LIGHTLLM_PD_TRANSFER_FAILURE_PROBABILITY`` as a float in [0, 1]; 0 when unset."""
    return _env_float("LIGHTLLM_PD_TRANSFER_FAILURE_PROBABILITY", "a number in [0, 1]", lambda v: 0.0 <= v <= 1.0)


def pd_node_busy_retry_timeout_seconds() -> float:
    """``LIGHTLLM_PD_NODE_BUSY_RETRY_TIMEOUT_SECONDS`` as a finite float >= 0 (0: no retry);
    :data:`DEFAULT_PD_NODE_BUSY_RETRY_TIMEOUT_SECONDS` when unset or empty.

    Read once, when the PD master starts (the start-up environment check and ``build_master``); the
    request path gets the value, never the variable.
    """
    if not os.environ.get("LIGHTLLM_PD_NODE_BUSY_RETRY_TIMEOUT_SECONDS"):
        return DEFAULT_PD_NODE_BUSY_RETRY_TIMEOUT_SECONDS
    return _env_float(
        "LIGHTLLM_PD_NODE_BUSY_RETRY_TIMEOUT_SECONDS", "a number of seconds from 0 (no retry) to 1e6",
        lambda v: 0.0 <= v <= MAX_ENV_SECONDS
    )


def pd_cluster_key_from_env() -> Optional[str]:
    """``LIGHTLLM_PD_CLUSTER_KEY``, or None when unset or empty.

    A value of only whitespace, or with surrounding whitespace, is refused like the flag's:
    taken as "no key" it would silently leave the cluster's endpoints open.  The message never
    shows the value (it is a secret).
    """
    raw = os.environ.get("LIGHTLLM_PD_CLUSTER_KEY")
    if raw is None or raw == "":
        return None
    if not raw.strip() or raw != raw.strip():
        raise ValueError("LIGHTLLM_PD_CLUSTER_KEY must be non-empty and carry no surrounding whitespace "
                         f"(got {len(raw)} characters; value not shown)")
    problem = key_character_problem(raw, ascii_only=True)
    if problem is not None:
        raise ValueError(f"LIGHTLLM_PD_CLUSTER_KEY: {problem}")
    return raw
