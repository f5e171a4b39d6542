"""Packaging for lightllm (clean-room). Install torch first from requirements-cpu.txt or
requirements-gpu.txt; see README.md."""

import re
from pathlib import Path

from setuptools import find_packages, setup

# The version lives in lightllm/__init__.py (GET /version reports it); read, not imported, so
# packaging needs none of the package's dependencies.
_INIT = (Path(__file__).resolve().parent / "lightllm" / "__init__.py").read_text(encoding="utf-8")
VERSION = re.search(r'^__version__ = "([^"]+)"$', _INIT, re.MULTILINE).group(1)


def _runtime_requirements() -> list:
    """requirements.txt's entries (the one list of runtime dependencies) and torch, which the
    requirement files pin per device instead."""
    lines = (Path(__file__).resolve().parent / "requirements.txt").read_text(encoding="utf-8").splitlines()
    return ["torch>=2.5"] + [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


setup(
    name="lightllm",
    version=VERSION,
    description="LLM serving with a configurable prefill-queue scheduler",
    packages=find_packages(include=["lightllm", "lightllm.*"]),
    # Files the package reads at run time besides its modules: the C++ kernels are built from
    # their sources on the machine that runs them, and the simulator's bundled cost profiles.
    package_data={
        "lightllm.common.basemodel": ["*.cpp"],
        "lightllm.common.basemodel.attention": ["*.cpp", "*.h"],
        "lightllm.benchmark.simulator": ["profiles/*.json"],
    },
    python_requires=">=3.10",
    install_requires=_runtime_requirements(),
)
