"""Offline generator for random-weight Llama / Qwen2 checkpoints with a real tokenizer.

Usage::

    python -m lightllm.utils.demo_model --out DIR [--arch llama|mistral|qwen2|qwen3] [--size tiny|small|medium] [--seed N]

Size presets (all GQA; shapes in :mod:`lightllm.utils.demo_model_config`):

* ``tiny``: hidden 64, 2 layers, 4/2 heads, vocab 1024, ~0.2M parameters; for unit tests.
* ``small``: hidden 256, 4 layers, 8/4 heads, intermediate 768, vocab 4096, 4K context,
  ~5.2M parameters (llama; 4.2M qwen2); for end-to-end runs and benchmarks.
* ``medium``: hidden 1024, 8 layers, 16/4 heads of 64, intermediate 1792, vocab 16384,
  4K context, ~98.6M parameters (llama; 81.8M qwen2, tied embeddings); a width where
  matrix products, not per-token overhead, dominate a forward.

The directory it writes is a normal Hugging Face checkpoint (``config.json``,
``generation_config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json``, ``special_tokens_map.json``) that transformers'
``AutoModelForCausalLM`` / ``AutoTokenizer`` and our own loader both read.  Nothing is
downloaded: the tokenizer is trained on standard-library source files and the weights are
drawn from a seeded generator, so the same arguments give byte-identical files on the same
Python installation.

Cost on a 2-core CPU: ``tiny`` about 0.4 s, ``small`` (~5M parameters, 21 MB) about 0.7 s,
most of it tokenizer training; ``medium`` (~99M parameters, 394 MB of fp32 safetensors)
about 5 s (3.4 s inside the test suite), most of it drawing and writing the weights.
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
from pathlib import Path
from typing import List, Optional

from safetensors.torch import save_file

from lightllm.utils.demo_json import write_json
from lightllm.utils.demo_model_config import (
    ARCHITECTURES,
    SIZES,
    check_arch,
    check_size,
    describe_size,
    generation_config,
    model_config,
)
from lightllm.utils.demo_tokenizer import SPECIAL_TOKENS, train_demo_tokenizer, write_tokenizer_files
from lightllm.utils.demo_weights import init_demo_weights
from lightllm.utils.one_line_errors import OneLineErrorParser, with_flag_names

MAX_SEED = 2**64 - 1  # torch.Generator seeds are unsigned 64-bit

# Every file a generated checkpoint holds; tests and callers may rely on this list.
DEMO_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


def _check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be in [0, 2**64 - 1], got {seed}")
    return seed


def generate_demo_model(out_dir: str | Path, arch: str = "llama", size: str = "tiny", seed: int = 0) -> Path:
    """Write a demo checkpoint into ``out_dir`` (created if missing) and return its path.

    Args:
        out_dir: target directory; existing checkpoint files in it are overwritten.
        arch: ``"llama"`` or ``"mistral"`` (separate lm_head; mistral without a sliding window),
            ``"qwen2"`` (q/k/v biases, tied embeddings) or ``"qwen3"`` (per-head q/k norms, tied
            embeddings).
        size: ``"tiny"`` (2 layers, hidden 64), ``"small"`` (4 layers, hidden 256, 4K
            context, ~5M parameters) or ``"medium"`` (8 layers, hidden 1024, GQA 16/4,
            4K context, ~99M parameters for llama, ~82M for qwen2).
        seed: seeds the weights; the tokenizer depends only on ``size``.

    Raises:
        ValueError: if ``arch``, ``size`` or ``seed`` is invalid, or ``out_dir`` is a file.
    """
    demo_arch = check_arch(arch)
    demo_size = check_size(size)
    _check_seed(seed)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir {str(out)!r} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = train_demo_tokenizer(demo_size.vocab_size)
    write_tokenizer_files(out, tokenizer, model_max_length=demo_size.max_position_embeddings)
    write_json(out / "config.json", model_config(demo_arch, demo_size, SPECIAL_TOKENS))
    write_json(out / "generation_config.json", generation_config(SPECIAL_TOKENS))
    weights = init_demo_weights(demo_arch, demo_size, seed)
    weights_path = out / "model.safetensors"
    save_file(weights, str(weights_path), metadata={"format": "pt"})
    # safetensors writes its file owner-only (0600); the checkpoint is readable as the other files
    # are (the umask's choice), so a server running as another user (a container's) can load it.
    os.chmod(weights_path, stat.S_IMODE(os.stat(out / "config.json").st_mode))
    return out


def _directory_name(text: str) -> str:
    # An empty name would write the checkpoint's files into the current directory.
    if not text.strip():
        raise argparse.ArgumentTypeError("must name a directory, got ''")
    return text


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser of ``python -m lightllm.utils.demo_model``."""
    parser = OneLineErrorParser(
        prog="python -m lightllm.utils.demo_model",
        description="Write a random-weight demo Llama/Qwen2/Qwen3/Mistral checkpoint with a locally trained tokenizer.",
        # One preset per line: the raw formatter keeps the epilog's line breaks.
        epilog="size presets (all GQA):\n" + "\n".join(f"  {describe_size(name)}" for name in SIZES),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", required=True, type=_directory_name, help="directory to write the checkpoint into")
    parser.add_argument("--arch", default="llama", choices=sorted(ARCHITECTURES), help="model architecture (default %(default)s)")
    parser.add_argument("--size", default="tiny", choices=list(SIZES), help="size preset (default tiny; listed below)")
    parser.add_argument("--seed", default=0, type=int, help="seed for the random weights (default 0)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """CLI entry point; prints the checkpoint directory and returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        out = generate_demo_model(args.out, arch=args.arch, size=args.size, seed=args.seed)
    except ValueError as exc:
        # The function names its parameters (out_dir, seed); the user typed flags.
        parser.error(with_flag_names(parser, str(exc), {"out_dir": "--out"}))
    except OSError as exc:
        parser.exit(1, f"error: cannot write {args.out}: {exc}\n")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
