"""Packaging for lightllm (clean-room). Install torch first from requirements-cpu.txt or
requirements-gpu.txt; see README.md."""

import re
from pathlib import Path

from setuptools import find_packages, setup

# The version lives in lightllm/__init__.py (GET /version reports it); read, not imported, so
# packaging needs none of the package's dependencies.
_INIT = (Path(__file__).resolve().parent / "lightllm" / "__init__.py").read_text(encoding="utf-8")
VERSION = re.search(r'^__version__ = "([^"]+)"$', _INIT, re.MULTILINE).group(1)

setup(
    name="lightllm",
    version=VERSION,
    description="LLM serving with a configurable prefill-queue scheduler",
    packages=find_packages(include=["lightllm", "lightllm.*"]),
    # The C++ attention kernel is built from its source on the machine that runs it.
    package_data={"lightllm.common.basemodel.attention": ["*.cpp"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.5",
        "transformers>=4.45",
        "tokenizers>=0.20",
        "safetensors>=0.4",
        "numpy>=1.26",
        "fastapi>=0.110",
        "uvicorn>=0.29",
        "pyzmq>=25",
        "httpx>=0.27",
        "prometheus-client>=0.20",
        "jinja2>=3.1",
        "tqdm>=4.66",
    ],
)
