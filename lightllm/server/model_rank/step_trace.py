"""Rank 0's per-step trace: one CSV row per step that ran a forward (``LIGHTLLM_STEP_TRACE``).

Why: where a step's time goes (scheduling, forward, sampling, publishing) and whether it paid for
page faults is what explains a throughput or latency number, and the server's cumulative
``lightllm_step_seconds`` counters cannot show one slow step among fast ones. The trace costs two
clock reads and one ``getrusage`` per step and one buffered line per working step; off by default.

Columns: ``t_s`` (seconds since the trace opened, at the step's start), ``step_ms`` (the backend's
step: schedule, forward and post-processing), ``schedule_ms``, ``forward_ms``, ``post_ms`` (the
step report's phases), ``publish_ms`` (writing the step's results for the other processes),
``prefill_tokens`` (tokens submitted to the forward, decode rows of a mixed step included),
``decode_rows``, ``minor_faults`` (the rank process's minor page faults during the step and its
publishing: memory touched for the first time, or again after the idle heap trim).
"""

from __future__ import annotations

import resource
import time
from typing import Callable, Optional, TextIO

from lightllm.server.model_rank.scheduling.step_report import StepReport

COLUMNS = ("t_s", "step_ms", "schedule_ms", "forward_ms", "post_ms", "publish_ms", "prefill_tokens", "decode_rows",
           "minor_faults")


def minor_faults() -> int:
    """Minor page faults of this process so far (every thread)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class StepTrace:
    """Writes one row per working step to ``path`` (truncated when the trace opens).

    The loop calls :meth:`begin` before the backend's step, :meth:`stepped` after it and
    :meth:`end` after publishing; ``end`` writes nothing for a step that ran no forward.
    """

    def __init__(self, path: str, clock: Callable[[], float] = time.monotonic,
                 faults: Callable[[], int] = minor_faults) -> None:
        self._clock = clock
        self._faults = faults
        self._file: Optional[TextIO] = open(path, "w", buffering=1, encoding="utf-8")
        self._file.write(",".join(COLUMNS) + "\n")
        self._opened = clock()
        self._started = self._stepped = self._opened
        self._faults_before = 0

    def begin(self) -> None:
        """A step starts now."""
        self._started = self._clock()
        self._faults_before = self._faults()

    def stepped(self) -> None:
        """The backend's step returned; publishing starts."""
        self._stepped = self._clock()

    def end(self, report: StepReport) -> None:
        """The step's results are published: write its row if it ran a forward."""
        if self._file is None or not report.did_work:
            return
        now = self._clock()
        row = (
            f"{self._started - self._opened:.6f}",
            f"{(self._stepped - self._started) * 1000:.3f}",
            f"{report.schedule_seconds * 1000:.3f}",
            f"{report.forward_seconds * 1000:.3f}",
            f"{report.post_seconds * 1000:.3f}",
            f"{(now - self._stepped) * 1000:.3f}",
            str(report.prefill_token_num),
            str(report.decode_batch_size),
            str(self._faults() - self._faults_before),
        )
        self._file.write(",".join(row) + "\n")

    def close(self) -> None:
        """Flush and close the file; later rows are dropped."""
        if self._file is not None:
            self._file.close()
            self._file = None
