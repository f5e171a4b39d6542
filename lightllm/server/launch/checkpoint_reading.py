"""Reading the served checkpoint at start-up: what the launcher and a PD master refuse, warn about and log.

Everything here happens before any process starts, so a checkpoint this server cannot serve (an
unknown ``model_type``, a broken ``generation_config.json``, an EOS id outside the vocabulary, a
chat template that does not compile, no tokenizer files, weights that are not safetensors, a shard
the index names missing, a weight file that is truncated or not safetensors, an index assigning a
tensor to a shard that does not hold it, a file this user cannot read or a dangling link) ends the start
with one line naming the problem.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Tuple

from lightllm.common.basemodel.weight_headers import read_weight_headers
from lightllm.common.basemodel.model_config import ModelConfig
from lightllm.models.model_types import architectures_mismatch, check_model_type
from lightllm.server.launch.checkpoint_access import checkpoint_access_problem
from lightllm.server.launch.sizing import ServerSizing
from lightllm.server.run_mode import RunMode
from lightllm.server.request_defaults import RequestDefaults, resolve_eos_token_ids, warn_without_eos
from lightllm.utils.tokenizer_file_checks import check_tokenizer_files_readable
from lightllm.utils.tokenizer_sources import check_tokenizer_sources
from lightllm.utils.tokenizer_utils import sentencepiece_packages_missing, slow_tokenizer_problem

log = logging.getLogger(__name__)


def read_checkpoint(args: argparse.Namespace) -> Tuple[ModelConfig, RequestDefaults]:
    """``--model_dir``'s config and the request defaults the flags select; ``ValueError`` (one line) when unservable."""
    # Named by the flag the user typed: the config reader's own message names only a path.
    if not os.path.isdir(args.model_dir):
        raise ValueError(f"--model_dir {args.model_dir}: no such directory (a local checkpoint directory is needed)")
    # Before any parser opens a file: their OSErrors were tracebacks (or "no config.json there").
    problem = checkpoint_access_problem(args.model_dir, weights=args.run_mode != RunMode.PD_MASTER)
    if problem is not None:
        raise ValueError(problem)
    if not os.path.isfile(os.path.join(args.model_dir, "config.json")):
        raise ValueError(f"--model_dir {args.model_dir}: no config.json there (not a Hugging Face checkpoint directory)")
    model_config = ModelConfig.from_dir(args.model_dir)
    check_model_type(model_config)
    mismatch = architectures_mismatch(model_config)
    if mismatch is not None:
        log.warning("%s", mismatch)
    # The HTTP and detokenization processes load the tokenizer only after every process started,
    # and transformers' error then names neither the directory nor a file: refuse here (the PD
    # master, which loads it too, reads the checkpoint through this function).
    check_tokenizer_sources(args.model_dir)
    missing = sentencepiece_packages_missing(args.model_dir)
    if missing:
        # Found here, not after the weights loaded and every process started (the detokenizer's error).
        raise ValueError(f"{args.model_dir} has only a SentencePiece tokenizer.model (no tokenizer.json), which "
                         f"transformers reads with the {' and '.join(missing)} package(s): pip install "
                         f"{' '.join(missing)}")
    check_tokenizer_files_readable(args.model_dir, args.tokenizer_mode)
    slow_problem = slow_tokenizer_problem(args.model_dir) if args.tokenizer_mode == "slow" else None
    if slow_problem is not None:
        # The fast tokenizer would serve anyway: the flag would be ignored.
        raise ValueError(f"--tokenizer_mode slow: {slow_problem}, so the fast one would serve anyway; use "
                         "--tokenizer_mode fast or auto")
    request_defaults = RequestDefaults.from_args(args)
    resolve_eos_token_ids(args, model_config)
    warn_without_eos(args, model_config)
    log.info("generation defaults: %s", request_defaults.generation.describe())
    if request_defaults.chat_template is not None:
        log.info("chat template: --chat_template replaces the tokenizer's")
    return model_config, request_defaults


def check_weight_files(args: argparse.Namespace) -> None:
    """Refuse (``CheckpointFilesError``, a ``ValueError``, one line) a ``--model_dir`` whose weight files the ranks could not read.

    What the ranks' loader checks when it opens the checkpoint (:func:`read_weight_headers`): the
    file-list rule (no ``*.safetensors`` file, PyTorch ``*.bin`` weights only are named; a shard
    the index names missing), each file's safetensors header (a truncated or empty file, one
    that is not safetensors) and the index against the headers (a tensor assigned to a shard
    that does not hold it).  Only names and headers are read; tensors (a missing one, a wrong
    shape) are checked by the ranks as they load.  Not for a PD master, which loads no weights.
    """
    headers = read_weight_headers(args.model_dir)
    log.info("weights: %d safetensors file(s) in %s", len(headers), args.model_dir)


def log_checkpoint_limits(args: argparse.Namespace, model_config: ModelConfig, sizing: ServerSizing) -> None:
    """Say at start how the checkpoint's attention limits what this server does."""
    if "max_position_embeddings" in model_config.defaulted and args.max_req_total_len is None:
        # The context sizes the KV cache and the shared memory; a default nobody wrote deserves a line.
        log.warning("requests are limited to %d tokens (max_position_embeddings %s); give --max_req_total_len to "
                    "serve less", sizing.max_req_total_len, model_config.defaulted["max_position_embeddings"])
    if model_config.sliding_window is not None:
        log.info("the checkpoint's layers attend to a sliding window of %d tokens: requests are limited to "
                 "%d tokens, within which full attention computes the same", model_config.sliding_window,
                 sizing.max_req_total_len)
    if model_config.rope.length_dependent and not args.disable_dynamic_prompt_cache:
        log.info("the checkpoint's RoPE scales with each request's length (dynamic NTK): the prefix cache is "
                 "off, since a cached key fits only requests of the length that computed it")
