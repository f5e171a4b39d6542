"""The pure parts of lightllm.benchmark.process_footprint and process_snapshot: maps/stat parsing, labels, the report."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lightllm.benchmark import process_footprint as pf
from lightllm.benchmark import process_snapshot as ps
from lightllm.benchmark.footprint_report import markdown_report

MAPS = """\
55d0c0a00000-55d0c0a01000 r--p 00000000 08:01 123 /usr/bin/python3.11
7f00aa000000-7f00ab000000 rw-p 00000000 00:00 0
7f00ab000000-7f00ab100000 r-xp 00000000 08:01 456 /site-packages/torch/lib/libtorch_cpu.so
7f00ab100000-7f00ab200000 r--p 00100000 08:01 456 /site-packages/torch/lib/libtorch_cpu.so
7f00ab200000-7f00ab300000 r-xp 00000000 08:01 457 /my dir/torch/lib/libtorch_python.so (deleted)
7f00ab300000-7f00ab400000 r-xp 00000000 08:01 458 /site-packages/torch/lib/libtorch.so.2
7f00ab400000-7f00ab500000 r-xp 00000000 08:01 459 /site-packages/torch/lib/libc10.so
7f00ab500000-7f00ab600000 r--p 00000000 08:01 460 /backup/libtorch_cpu.so.bak
7f00ab600000-7f00ab700000 rw-s 00000000 00:05 461 /dev/shm/lightllm_libtorch_req
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0 [stack]
"""


def test_torch_libraries_finds_each_mapped_libtorch_once() -> None:
    assert ps.torch_libraries(MAPS) == ["libtorch.so.2", "libtorch_cpu.so", "libtorch_python.so"]


def test_torch_libraries_empty_without_torch() -> None:
    text = "\n".join(line for line in MAPS.splitlines() if "torch/lib/libtorch" not in line)
    assert ps.torch_libraries(text) == []
    assert ps.torch_libraries("") == []


def test_parse_stat_survives_parentheses_and_spaces_in_the_name() -> None:
    # Fields after the name: state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt
    # utime stime cutime cstime priority nice threads itrealvalue starttime ...
    after = "S 42 1 1 0 -1 0 0 0 0 0 150 25 0 0 20 0 3 0 9000 0 0"
    stat = ps.parse_stat(f"1234 (odd (name) x) {after}")
    assert stat == ps.StatTimes(ppid=42, utime=150, stime=25, starttime=9000)


def test_parse_stat_rejects_a_short_line() -> None:
    with pytest.raises(ValueError):
        ps.parse_stat("1234 (python) S 1")


def test_entry_module_for_maps_ranks_and_unknown_labels() -> None:
    table = {"main": "a.main", "model_rank": "a.rank"}
    assert ps.entry_module_for("main", table) == "a.main"
    assert ps.entry_module_for("model_rank3", table) == "a.rank"
    assert ps.entry_module_for("model_rank12", table) == "a.rank"
    assert ps.entry_module_for("resource_tracker", table) is None
    # Every real entry is a dotted lightllm module so a moved path shows up as an import error.
    assert all(m.startswith("lightllm.") for m in pf.ENTRY_MODULES.values())
    assert {"main", "router", "detokenization", "model_rank"} <= set(pf.ENTRY_MODULES)


def test_parse_entry_overrides() -> None:
    assert pf.parse_entry_overrides([]) == {}
    assert pf.parse_entry_overrides(["router=a.b", " model_rank = c.d "]) == {"router": "a.b", "model_rank": "c.d"}
    for bad in ("router", "=a.b", "router="):
        with pytest.raises(ValueError):
            pf.parse_entry_overrides([bad])


def _row(label: str, rss: int, anon: int, torch: bool) -> dict:
    return {"label": label, "pid": 100, "entry_module": ps.entry_module_for(label, pf.ENTRY_MODULES), "rss_kib": rss,
            "anon_kib": anon, "file_kib": 0, "shmem_kib": 0, "maps_libtorch": torch, "torch_libraries": [],
            "started_after_launch_s": 1.5, "cpu_s": 2.25}


def test_markdown_report_lists_processes_totals_and_imports() -> None:
    result = {
        "lightllm_path": "/x/lightllm/__init__.py",
        "repeats": 3,
        "launches": [
            {"time_to_ready_s": 10.0, "stop_s": 0.5, "processes": [_row("main", 2048, 1024, True)]},
            {"time_to_ready_s": 12.0, "stop_s": 0.4,
             "processes": [_row("main", 2048, 1024, True), _row("router", 1024, 512, False)]},
        ],
        "imports": [
            {"label": "router", "module": "lightllm.server.router.manager", "import_s": 0.5, "wall_s": 0.9,
             "loads_torch": False, "modules_loaded": 300},
            {"label": "pd_master", "module": "lightllm.gone", "error": ["ModuleNotFoundError: lightllm.gone"]},
        ],
    }
    text = markdown_report(result)
    assert "median 11.00 s over 2 launch(es)" in text
    # The process table comes from the last launch: both rows and their sum.
    assert "| main | 100 | lightllm.server.api_server | 2.0 | 1.0 | yes | 1.50 | 2.25 |" in text
    assert "| router | 100 | lightllm.server.router.manager | 1.0 | 0.5 | no |" in text
    assert "| **total** | | | 3.0 | 1.5 |" in text
    assert "| router | lightllm.server.router.manager | 0.50 | 0.90 | no | 300 |" in text
    assert "error: ModuleNotFoundError: lightllm.gone" in text
    assert "median of 3" in text


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_snapshot_of_this_process_reads_memory_and_maps() -> None:
    rows = ps.snapshot(os.getpid(), pf.ENTRY_MODULES)
    me = rows[0]
    assert (me.label, me.pid) == ("main", os.getpid())
    assert me.rss_kib > 0 and me.started_after_launch_s == 0.0
    # Whatever the test run imported, the flag agrees with the maps file.
    assert me.maps_libtorch == bool(ps.torch_libraries(Path("/proc/self/maps").read_text()))
