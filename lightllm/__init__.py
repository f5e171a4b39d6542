"""lightllm: LLM serving with a configurable prefill-queue scheduler."""

# The one place the package version is written: setup.py reads it from here (without importing the
# package) and GET /version reports it.
__version__ = "0.1.0"
