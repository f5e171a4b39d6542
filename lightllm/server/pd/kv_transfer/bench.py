"""Measure KV transfer time per 1K tokens between two local transfer processes (CPU, gloo).

    python -m lightllm.server.pd.kv_transfer.bench --model_dir /tmp/demo_small \
        --tokens 4096 --page_sizes 64 256 1024 --repeat 5

Reads layers, KV heads, head dim and dtype as the server does (``config.json``, and the weights'
dtype where it names none; float16 as float32 on CPU, like ``--data_type auto``), moves
``--tokens`` tokens from scattered slots of a "prefill" cache into scattered slots of a
"decode" cache ``--repeat`` times per page size, and prints the median seconds from the
prefill side's export to the decode side's acknowledgement.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from lightllm.common.basemodel.model_config import ModelConfig
from lightllm.common.basemodel.model_config_error import ModelConfigError
from lightllm.common.basemodel.serving_dtype import DATA_TYPE_CHOICES, auto_dtype_on, dtype_name, parse_dtype
from lightllm.common.kv_cache_mem_manager.mem_manager import KVCacheMemoryManager
from lightllm.server.pd.kv_transfer.handle import KVTransferHandle
from lightllm.server.pd.kv_transfer.protocol import MAX_PAGES_IN_FLIGHT, PIPELINE_BYTES
from lightllm.utils.interrupts import interruptible
from lightllm.utils.one_line_errors import OneLineErrorParser
from lightllm.utils.free_ports import free_port


def _geometry(model_dir: Path, data_type: str = "auto") -> Dict[str, object]:
    """The KV cache's shape and dtype as a CPU server with this ``--data_type`` keeps them (ModelConfigError)."""
    config = ModelConfig.from_dir(model_dir)
    dtype = auto_dtype_on(config.dtype, "cpu") if data_type == "auto" else dtype_name(data_type)
    return {
        "num_layers": config.num_hidden_layers,
        "kv_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "dtype": parse_dtype(dtype),
    }


def _wait(handle: KVTransferHandle, request_id: int, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for result in handle.poll():
            if result.request_id == request_id:
                return result
        time.sleep(0.0005)
    raise TimeoutError(f"request {request_id} not done within {timeout_s} s")


def cache_bytes(tokens: int, geometry: Dict[str, object]) -> int:
    """Bytes :func:`measure` allocates: two caches (prefill, decode) of ``2 * tokens`` slots, K and V."""
    per_token = geometry["num_layers"] * geometry["kv_heads"] * geometry["head_dim"] * 2
    return 2 * 2 * tokens * per_token * torch.empty((), dtype=geometry["dtype"]).element_size()


def peak_bytes(tokens: int, page_sizes: List[int], geometry: Dict[str, object]) -> int:
    """Memory :func:`measure` holds at its peak, an upper estimate: the two caches, a copy of one
    cache buffer while ``share_memory_`` moves it, and the largest page size's buffers (the
    receiver's pages in flight and two on the sender's side)."""
    caches = cache_bytes(tokens, geometry)
    slot_bytes = caches // (2 * 2 * tokens)  # one token's K and V
    pages = 0
    for page_size in page_sizes:
        page_bytes = min(page_size, tokens) * slot_bytes
        page_count = -(-tokens // page_size)
        depth = max(2, min(MAX_PAGES_IN_FLIGHT, PIPELINE_BYTES // max(page_bytes, 1), page_count))
        pages = max(pages, (depth + 2) * page_bytes)
    return caches + caches // 4 + pages


def shared_memory_free_bytes() -> Optional[int]:
    """Free bytes of /dev/shm, where the shared caches live (None where it cannot be read)."""
    try:
        stats = os.statvfs("/dev/shm")
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def available_memory_bytes() -> Optional[int]:
    """``MemAvailable`` of /proc/meminfo (None where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def measure(
    model_dir: Path, tokens: int, page_sizes: List[int], repeat: int, data_type: str = "auto"
) -> List[Dict[str, float]]:
    """Median transfer seconds (and per 1K tokens) for each page size."""
    geometry = _geometry(model_dir, data_type)
    source = KVCacheMemoryManager(tokens * 2, device="cpu", shareable=True, **geometry)
    target = KVCacheMemoryManager(tokens * 2, device="cpu", shareable=True, **geometry)
    source.k_buffer.normal_()
    source.v_buffer.normal_()
    rows = []
    for page_size in page_sizes:
        port = free_port()
        sender = KVTransferHandle("prefill", source, "127.0.0.1", port, page_size=page_size, timeout_s=60.0)
        receiver = KVTransferHandle("decode", target, "127.0.0.1", port, timeout_s=60.0)
        try:
            if not (sender.wait_ready(120) and receiver.wait_ready(120)):
                raise RuntimeError(f"transfer pair did not start: {sender.broken_reason or receiver.broken_reason}")
            seconds = []
            for attempt in range(repeat + 1):  # the first one warms up both processes
                src = torch.randperm(tokens * 2)[:tokens]
                dst = torch.randperm(tokens * 2)[:tokens]
                receiver.receive(attempt, dst)
                sender.send(attempt, src)
                sent, received = _wait(sender, attempt), _wait(receiver, attempt)
                if not (sent.ok and received.ok):
                    raise RuntimeError(sent.reason or received.reason)
                if attempt:
                    seconds.append(sent.seconds)
            median = statistics.median(seconds)
            rows.append({"page_size": page_size, "seconds": median, "seconds_per_1k": median * 1000 / tokens,
                         "mib": sent.bytes / 2**20, "mib_per_s": sent.bytes / 2**20 / median})
        finally:
            sender.close()
            receiver.close()
    return rows


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser: one-line usage errors (``error: ...``, exit 2), as every tool's."""
    parser = OneLineErrorParser(prog="python -m lightllm.server.pd.kv_transfer.bench",
                                description=__doc__.splitlines()[0])
    parser.add_argument("--model_dir", type=Path, required=True,
                        help="checkpoint whose config.json gives the KV geometry")
    parser.add_argument("--tokens", type=int, default=4096,
                        help="tokens per transfer; both caches hold twice as many, which must fit this machine's "
                        "available memory (default %(default)s)")
    parser.add_argument("--page_sizes", type=int, nargs="+", default=[64, 256, 1024],
                        help="tokens per page, each page size measured once; a page size above --tokens moves one "
                        "partial page, as --tokens itself would (default %(default)s)")
    parser.add_argument("--repeat", type=int, default=5, help="timed transfers per page size (default %(default)s)")
    parser.add_argument("--data_type", choices=DATA_TYPE_CHOICES,
                        default="auto", help="KV dtype, as the server's --data_type (auto: the checkpoint's, "
                        "float16 as float32 on CPU) (default %(default)s)")
    return parser


@interruptible("every transfer process it started was stopped; nothing was measured in full")
def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point; a bad flag or checkpoint exits with status 2 and a one-line error."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if not (args.model_dir / "config.json").is_file():
        parser.error(f"--model_dir {args.model_dir} has no config.json")
    if args.tokens <= 0 or args.repeat <= 0 or min(args.page_sizes) <= 0:
        parser.error("--tokens, --repeat and --page_sizes must be positive")
    if len(set(args.page_sizes)) != len(args.page_sizes):
        parser.error(f"--page_sizes names a page size twice ({' '.join(map(str, args.page_sizes))}); name each once")
    try:
        geometry = _geometry(args.model_dir, args.data_type)
    except ModelConfigError as exc:
        parser.error(f"--model_dir {args.model_dir}: no KV geometry ({exc})")
    # Refused before anything is allocated: an oversized --tokens ended in torch's out-of-memory traceback.
    needed, available = peak_bytes(args.tokens, args.page_sizes, geometry), available_memory_bytes()
    if available is not None and needed > available:
        parser.error(f"--tokens {args.tokens} needs about {needed / 2**30:.1f} GiB at its peak (the two caches of 2 x "
                     f"{2 * args.tokens} slots of this model's KV, a copy while they are shared, the page buffers); "
                     f"this machine has {available / 2**30:.1f} GiB available")
    shared, shm_free = cache_bytes(args.tokens, geometry), shared_memory_free_bytes()
    if shm_free is not None and shared > shm_free:
        parser.error(f"--tokens {args.tokens} needs {shared / 2**30:.1f} GiB of shared memory for the two caches; "
                     f"/dev/shm has {shm_free / 2**30:.1f} GiB free (a container's default is 64 MiB: raise --shm-size)")
    print(f"geometry: {geometry}, {args.tokens} tokens per transfer, median of {args.repeat}")
    larger = [size for size in args.page_sizes if size > args.tokens]
    if larger:
        print(f"note: page size {', '.join(map(str, larger))} is above --tokens {args.tokens}: each transfer is one "
              "partial page, as with a page size of --tokens")
    print(f"{'page_size':>9} {'MiB':>7} {'ms':>8} {'ms/1K tok':>10} {'MiB/s':>8}")
    for row in measure(args.model_dir, args.tokens, args.page_sizes, args.repeat, args.data_type):
        print(f"{row['page_size']:>9} {row['mib']:>7.1f} {row['seconds'] * 1000:>8.1f} "
              f"{row['seconds_per_1k'] * 1000:>10.2f} {row['mib_per_s']:>8.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
