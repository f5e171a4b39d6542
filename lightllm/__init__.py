"""lightllm: LLM serving with a configurable prefill-queue scheduler."""
