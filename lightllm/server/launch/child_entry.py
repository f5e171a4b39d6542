"""The entries of the spawned children, in a module of their own so that each side imports only what it needs.

Spawned children unpickle their target by module name. Naming
:func:`~lightllm.server.model_rank.rank_assembly.model_rank_process_main` directly would make the
launcher import the rank's module, and with it torch, just to pass the function; naming a function
of :mod:`lightllm.server.launch.start` would make every child import the launcher's HTTP code.
"""

from __future__ import annotations

from typing import Any, Callable

from lightllm.utils.torch_free import keep_torch_out


def model_rank_entry(config: Any, ready_conn: Any) -> None:
    """Run a model rank (``config``: its ``ModelRankConfig``); torch is imported here, in the rank."""
    from lightllm.server.model_rank.rank_assembly import model_rank_process_main

    model_rank_process_main(config, ready_conn)


def torch_free_entry(target: Callable[[Any, Any], None], config: Any, ready_conn: Any) -> None:
    """Run ``target(config, ready_conn)`` (the router's or the detokenizer's main) with torch kept out.

    Their code imports no torch, but transformers (the detokenizer's tokenizer) would load it
    because it is installed: see :mod:`lightllm.utils.torch_free`.
    """
    keep_torch_out()
    target(config, ready_conn)
