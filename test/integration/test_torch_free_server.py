"""On a running tp=1 server exactly one process maps libtorch: the model rank.

test/unit/launch/test_torch_free_processes.py checks that the other processes' code imports without
torch; this checks what the processes of a real server actually mapped once it serves.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List

from server_process import start_server

# libtorch.so, libtorch_cpu.so, libtorch_cuda.so, libtorch_python.so (versioned suffixes too).
_LIBTORCH = re.compile(r"/libtorch[A-Za-z0-9_]*\.so")


def _tree(root: int) -> List[int]:
    """``root`` and every descendant, from the parent pids in /proc."""
    parents: Dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process exited while we looked
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    tree, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, parent in parents.items() if parent in frontier]
        tree += frontier
    return tree


def _maps_libtorch(pid: int) -> bool:
    return bool(_LIBTORCH.search(Path(f"/proc/{pid}/maps").read_text()))


def _name(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def test_only_the_model_rank_maps_libtorch(tiny_llama_dir: Path, tmp_path: Path) -> None:
    server = start_server(tiny_llama_dir, tmp_path, ["--max_total_token_num", "4096"])
    try:
        tree = _tree(server.proc.pid)
        names = {pid: _name(pid) for pid in tree}
        assert {"router", "detokenization", "model_rank0"} <= set(names.values()), names
        with_torch = [pid for pid in tree if _maps_libtorch(pid)]
        assert [names[pid] for pid in with_torch] == ["model_rank0"], names
        assert server.proc.pid not in with_torch  # the launcher, which serves HTTP
    finally:
        assert server.stop() == 0
