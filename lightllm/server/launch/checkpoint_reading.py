"""Reading the served checkpoint at start-up: what the launcher and a PD master refuse, warn about and log.

Everything here happens before any process starts, so a checkpoint this server cannot serve (an
unknown ``model_type``, a broken ``generation_config.json``, an EOS id outside the vocabulary, a
chat template that does not compile, weights that are not safetensors or a shard the index names
missing) ends the start with one line naming the problem.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Tuple

from lightllm.common.basemodel.checkpoint_files import weight_files
from lightllm.common.basemodel.model_config import ModelConfig
from lightllm.models.model_types import check_model_type
from lightllm.server.launch.sizing import ServerSizing
from lightllm.server.request_defaults import RequestDefaults, resolve_eos_token_ids, warn_without_eos

log = logging.getLogger(__name__)


def read_checkpoint(args: argparse.Namespace) -> Tuple[ModelConfig, RequestDefaults]:
    """``--model_dir``'s config and the request defaults the flags select; ``ValueError`` (one line) when unservable."""
    # Named by the flag the user typed: the config reader's own message names only a path.
    if not os.path.isdir(args.model_dir):
        raise ValueError(f"--model_dir {args.model_dir}: no such directory (a local checkpoint directory is needed)")
    if not os.path.isfile(os.path.join(args.model_dir, "config.json")):
        raise ValueError(f"--model_dir {args.model_dir}: no config.json there (not a Hugging Face checkpoint directory)")
    model_config = ModelConfig.from_dir(args.model_dir)
    check_model_type(model_config)
    request_defaults = RequestDefaults.from_args(args)
    resolve_eos_token_ids(args, model_config)
    warn_without_eos(args, model_config)
    log.info("generation defaults: %s", request_defaults.generation.describe())
    if request_defaults.chat_template is not None:
        log.info("chat template: --chat_template replaces the tokenizer's")
    return model_config, request_defaults


def check_weight_files(args: argparse.Namespace) -> None:
    """Refuse (``CheckpointFilesError``, a ``ValueError``, one line) a ``--model_dir`` whose weight files the ranks could not read.

    The file-list rule of :func:`weight_files`, the one the ranks' loader applies: no
    ``*.safetensors`` file (PyTorch ``*.bin`` weights only are named), or a shard the index names
    missing.  Only names are read; tensors (a missing one, a wrong shape) are checked by the
    ranks as they load.  Not for a PD master, which loads no weights.
    """
    files = weight_files(args.model_dir)
    log.info("weights: %d safetensors file(s) in %s", len(files), args.model_dir)


def log_checkpoint_limits(args: argparse.Namespace, model_config: ModelConfig, sizing: ServerSizing) -> None:
    """Say at start how the checkpoint's attention limits what this server does."""
    if model_config.sliding_window is not None:
        log.info("the checkpoint's layers attend to a sliding window of %d tokens: requests are limited to "
                 "%d tokens, within which full attention computes the same", model_config.sliding_window,
                 sizing.max_req_total_len)
    if model_config.rope.length_dependent and not args.disable_dynamic_prompt_cache:
        log.info("the checkpoint's RoPE scales with each request's length (dynamic NTK): the prefix cache is "
                 "off, since a cached key fits only requests of the length that computed it")
