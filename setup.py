"""Packaging for lightllm (clean-room). Install torch first from requirements-cpu.txt or
requirements-gpu.txt; see README.md."""

from setuptools import find_packages, setup

setup(
    name="lightllm",
    version="0.1.0",
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
