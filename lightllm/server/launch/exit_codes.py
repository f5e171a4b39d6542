"""The exit codes of ``python -m lightllm.server.api_server``, defined once for every launcher.

The normal server's launcher (:mod:`.start`), the PD master's (:mod:`.pd_master`), a PD node's
(:mod:`.pd_node`) and the :mod:`.supervisor` deciding how serving ended all return these; scripts
and orchestrators read them, so each keeps one meaning (docs/*/failure_handling.md lists them and
``test/unit/launch/test_exit_codes.py`` keeps that list and these constants the same). Only the
launcher exits with them, so they live in ``launch/``, above everything that could fail.
"""

from __future__ import annotations

EXIT_STOPPED = 0  # stopped by SIGTERM/SIGINT/SIGHUP (after the drain)
EXIT_FAILED = 1  # a child process died (while serving or loading), or start-up failed after the checks
EXIT_INVALID_CONFIG = 2  # refused before anything started: flags, model config, keys (one line `error: ...`)
EXIT_PORT_UNAVAILABLE = 3  # a port it must listen on is taken or cannot be bound (one line naming it)
