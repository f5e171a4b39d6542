"""Garbage-collector settings of the server's long-running processes."""

from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    """Exclude every object that exists once a process starts serving from the collector's full scans.

    Each server process holds hundreds of thousands of long-lived objects (torch, the tokenizer,
    the app, the model's modules); every full collection scanned them all, holding the
    interpreter lock for 0.3-0.9 s on a busy 2-core machine, so a health probe (HTTP process) or
    every stream's next token (router, model rank, detokenizer) waited for it. Frozen, they are
    never scanned again; nothing among them is garbage (they live as long as the process).
    """
    gc.collect()
    gc.freeze()
