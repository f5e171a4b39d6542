"""How many special tokens a checkpoint's tokenizer adds to a prompt, read before anything starts.

A prompt builder (ours, or ``vllm bench serve``'s random dataset) counts them in a prompt's
length, so a length no larger than their number leaves no content: the tools refuse it up front.
"""

from __future__ import annotations


def tokenizer_special_tokens(model_dir: str) -> int:
    """The special tokens the tokenizer in ``model_dir`` adds to one prompt.

    Raises:
        ValueError: one line, when the tokenizer cannot be loaded.
    """
    from lightllm.utils.tokenizer_utils import load_tokenizer

    try:
        return int(load_tokenizer(model_dir).num_special_tokens_to_add(pair=False))
    except Exception as exc:  # whatever transformers raises, no prompt can be built
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ValueError(f"--model_dir {model_dir}: its tokenizer cannot be loaded ({type(exc).__name__}: {first})"
                         ) from None
