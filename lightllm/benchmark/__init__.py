"""Serving benchmark client: workloads, exact-length prompts, streaming backends, metrics."""
