"""Driving a backend with constrained requests the way a rank loop does, without a rank process.

A constrained request is held out of the steps until rank 0 marks its grammar ready
(``GrammarsReady``); these helpers play rank 0's part before each step.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Tuple

# A run that has not ended after this many steps is a hang, not a slow test.
MAX_STEPS = 20_000


def step_releasing_grammars(backend: Any) -> Any:
    """One loop iteration: release the held requests whose compile ended, or end those whose compile
    raised (rank 0's ``GrammarsReady``), then step.

    While only held requests live the step does nothing; a short sleep then stands for the rank
    loop's poll, so a compile on the other thread is not starved by a spinning test.
    """
    backend.grammars_ready(*backend.grammars_compiled())
    report = backend.step()
    if not report.did_work and any(req.grammar_held for req in backend.requests.values()):
        time.sleep(0.001)
    return report


def run_releasing_grammars(backend: Any) -> Tuple[Dict[int, List[int]], Dict[int, int]]:
    """Step until no work is left; each finished request's ``(outputs, statuses)`` by request id."""
    outputs: Dict[int, List[int]] = {}
    statuses: Dict[int, int] = {}
    for _ in range(MAX_STEPS):
        if not backend.has_work:
            return outputs, statuses
        for req, status in step_releasing_grammars(backend).finished:
            outputs[req.request_id], statuses[req.request_id] = list(req.output_ids), status
    raise AssertionError(f"the backend still had work after {MAX_STEPS} steps")
