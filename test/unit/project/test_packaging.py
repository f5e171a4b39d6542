"""A wheel built from the tree holds everything the package reads at run time (the C++ kernel
sources, the simulator's profiles) and requires every runtime dependency: a non-editable install
must run the same code as a checkout."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _data_files() -> set[str]:
    """Files under lightllm/ that are not Python modules (nor caches of them)."""
    return {str(path.relative_to(ROOT)) for path in (ROOT / "lightllm").rglob("*")
            if path.is_file() and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts}


def test_a_wheel_carries_the_runtime_files_and_requires_every_runtime_dependency(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    for name in ("setup.py", "requirements.txt", "MANIFEST.in", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "lightllm", source / "lightllm", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (wheel,) = (tmp_path / "dist").glob("lightllm-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = next(archive.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    expected = _data_files()
    assert {"lightllm/common/basemodel/cpp_layer_ops.cpp",
            "lightllm/benchmark/simulator/profiles/h100_qwen_0p8b.json"} <= expected
    assert not expected - names, f"missing from the wheel: {sorted(expected - names)}"
    required = {line.split(":", 1)[1].strip().split(">")[0].split("=")[0].split("<")[0].strip().lower()
                for line in metadata.splitlines() if line.startswith("Requires-Dist:")}
    listed = {line.strip().split(">")[0].split("=")[0].split("<")[0].strip().lower()
              for line in (ROOT / "requirements.txt").read_text().splitlines()
              if line.strip() and not line.lstrip().startswith("#")}
    assert "llguidance" in listed and listed | {"torch"} <= required, sorted(listed - required)
