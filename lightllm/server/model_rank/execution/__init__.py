"""The torch side of a rank: the model executor, forward threads, sampling of rows, prompt logprobs."""
