"""KV slots of running requests and the radix prefix cache (torch tensors on the rank's device)."""
