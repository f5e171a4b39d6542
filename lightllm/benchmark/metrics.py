"""Per-request timing records and the latency/throughput metrics computed from them.

Everything here is a pure function of :class:`RequestRecord` lists so metric formulas
can be checked on hand-made records. Times in records are seconds on one monotonic
clock whose zero is the benchmark start; reported latencies are milliseconds.

Definitions (per request, successful requests only):

* TTFT = first_token_time - send_time
* E2E  = end_time - send_time, where a successful request's end_time is its last output
  arrival (not a protocol trailer such as the OpenAI usage chunk or ``[DONE]``)
* TPOT = (E2E - TTFT) / (output_tokens - 1); undefined (excluded) for one-token outputs
* ITL  = gaps between consecutive output arrivals (``token_times``), pooled over all requests
  of a group: per token for LightLLM's native API, per streamed output chunk for the OpenAI
  APIs, where a chunk may carry several tokens (see :mod:`lightllm.benchmark.backends`)
* send lag = send_time - scheduled_time (client-side schedule deviation; all sent requests)

A request the server ended with a finish reason meaning it gave up (``abort``, ``error``) is a
failed request (see :mod:`lightllm.benchmark.stream_request`); every record keeps its ``finish_reason``.
A successful request whose ``output_tokens`` differ from its ``requested_output_tokens`` (a stop
sequence or EOS ended it early, or a length limit of the server's) is counted in
``output_len_mismatch``, and its finish reason in ``output_len_mismatch_finish_reasons``: its
latencies are real, but not those of the length the workload asked for, and :func:`format_summary`
warns about it, naming the finish reasons.  ``output_tokens_source`` says where each record's
count came from (``server``, ``stream`` or ``tokenizer``); the completed requests counted by the
client's tokenizer (a server that reported no count) are ``output_tokens_from_tokenizer``, and
:func:`format_summary` says so.

Throughputs divide by the benchmark duration, last end time minus first send time over
all requests, so per-class throughputs add up to the overall figure. Goodput counts the
successful requests meeting every configured SLO per second of that duration.
Percentiles interpolate linearly between order statistics (numpy's default method).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Iterable, Sequence

from lightllm.benchmark.cli_args import refuse_repeated_values

PERCENTILES: tuple[int, ...] = (50, 90, 95, 99)
SLO_KEYS: tuple[str, ...] = ("ttft", "tpot", "e2e")
UNREPORTED_FINISH = "unreported"
# Where a record's output token count came from (RequestRecord.output_tokens_source).
COUNT_FROM_SERVER, COUNT_FROM_STREAM, COUNT_FROM_TOKENIZER = "server", "stream", "tokenizer"
# What ended a request early, by finish reason, for the output-length warning.
_FINISH_MEANINGS = {"stop": "a stop sequence, or EOS when it is not ignored",
                    "length": "a length limit of the server's, such as its context"}


@dataclasses.dataclass
class RequestRecord:
    """Everything the client observed about one request (seconds since benchmark start)."""

    index: int
    request_class: str
    prompt_tokens: int
    scheduled_time: float
    send_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)
    end_time: float | None = None
    output_tokens: int = 0
    requested_output_tokens: int = 0
    error: str | None = None
    finish_reason: str | None = None
    # "server": the count the server reported; "stream": counted from the stream's events (one per
    # token natively); "tokenizer": the generated text counted by the client's tokenizer.
    output_tokens_source: str | None = None
    # The generated text of a response whose server reported no token count, kept in memory only
    # until the run counts its tokens: written out, the records would grow to the outputs' size.
    generated_text: str | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def success(self) -> bool:
        """True when the request finished without error and produced a first token."""
        return (
            self.error is None
            and self.send_time is not None
            and self.first_token_time is not None
            and self.end_time is not None
        )

    @property
    def ttft(self) -> float | None:
        """Time to first token in seconds, ``None`` for failed requests."""
        return self.first_token_time - self.send_time if self.success else None

    @property
    def e2e(self) -> float | None:
        """End-to-end latency in seconds, ``None`` for failed requests."""
        return self.end_time - self.send_time if self.success else None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first, ``None`` if undefined or failed."""
        if not self.success or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def inter_token_latencies(self) -> list[float]:
        """Gaps between consecutive token arrivals in seconds (empty for failures)."""
        if not self.success:
            return []
        times = self.token_times
        return [b - a for a, b in zip(times, times[1:])]

    @property
    def send_lag(self) -> float | None:
        """How late the request left the client relative to its schedule, in seconds."""
        return None if self.send_time is None else self.send_time - self.scheduled_time

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (one JSONL line), without the in-memory ``generated_text``."""
        data = dataclasses.asdict(self)
        del data["generated_text"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RequestRecord":
        """Inverse of :meth:`to_dict`; unknown keys are rejected."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"record has unknown fields: {sorted(unknown)}")
        return cls(**data)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile with linear interpolation (numpy's ``method='linear'``)."""
    if not values:
        raise ValueError("values must be non-empty")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be within [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def describe(values: Sequence[float], scale: float = 1.0) -> dict[str, float | int | None]:
    """Count, mean and percentiles of ``values`` multiplied by ``scale`` (None when empty)."""
    stats: dict[str, float | int | None] = {"count": len(values)}
    scaled = [v * scale for v in values]
    stats["mean"] = sum(scaled) / len(scaled) if scaled else None
    for q in PERCENTILES:
        stats[f"p{q}"] = percentile(scaled, q) if scaled else None
    return stats


def parse_slo(specs: Iterable[str]) -> dict[str, float]:
    """Parse ``["ttft:500", "tpot:50"]`` into ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds).

    A key named twice is refused: one of its limits would silently win.
    """
    slo: dict[str, float] = {}
    for spec in specs:
        key, sep, value = spec.partition(":")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"slo entries must look like KEY:MS with KEY in {SLO_KEYS}, got {spec!r}")
        refuse_repeated_values([*slo, key], "slo")
        try:
            limit = float(value)
        except ValueError:
            raise ValueError(f"slo limit for {key!r} must be a number of milliseconds, got {value!r}") from None
        if not math.isfinite(limit) or limit <= 0:
            raise ValueError(f"slo limit for {key!r} must be > 0 ms, got {value!r}")
        slo[key] = limit
    return slo


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """Whether a successful request meets every limit in ``slo`` (milliseconds).

    A TPOT limit is met vacuously by a one-token output: it has no later token that
    could be late, and its first-token latency is covered by the TTFT limit.
    """
    if not record.success:
        return False
    observed = {"ttft": record.ttft, "tpot": record.tpot, "e2e": record.e2e}
    for key, limit_ms in slo.items():
        if key not in observed:
            raise ValueError(f"slo key must be one of {SLO_KEYS}, got {key!r}")
        value = observed[key]
        if value is not None and value * 1e3 > limit_ms:
            return False
    return True


def benchmark_duration(records: Sequence[RequestRecord]) -> float | None:
    """Last end time minus first send time over all requests, or None if nothing was sent."""
    sends = [r.send_time for r in records if r.send_time is not None]
    ends = [r.end_time for r in records if r.end_time is not None]
    if not sends or not ends:
        return None
    return max(ends) - min(sends)


def _rate(count: float, duration: float | None) -> float | None:
    return count / duration if duration else None


def group_metrics(
    records: Sequence[RequestRecord], duration: float | None, slo: dict[str, float] | None = None
) -> dict[str, Any]:
    """Metrics of one group of requests (a class or all of them) over ``duration`` seconds."""
    done = [r for r in records if r.success]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    itls = [gap for r in done for gap in r.inter_token_latencies]
    good = sum(meets_slo(r, slo) for r in done) if slo else None
    # A requested length of 0 is a record that does not say what it asked for (hand-made, or older).
    mismatched = [r for r in done if r.requested_output_tokens and r.output_tokens != r.requested_output_tokens]
    return {
        "requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "output_tokens_from_tokenizer": sum(1 for r in done if r.output_tokens_source == COUNT_FROM_TOKENIZER),
        "output_len_mismatch": len(mismatched),
        "output_len_mismatch_finish_reasons": _finish_reason_counts(mismatched),
        "request_throughput": _rate(len(done), duration),
        "output_throughput": _rate(output_tokens, duration),
        "total_token_throughput": _rate(input_tokens + output_tokens, duration),
        "slo_met": good,
        "goodput": _rate(good, duration) if good is not None else None,
        "ttft_ms": describe([r.ttft for r in done], 1e3),
        "tpot_ms": describe([r.tpot for r in done if r.tpot is not None], 1e3),
        "itl_ms": describe(itls, 1e3),
        "e2e_ms": describe([r.e2e for r in done], 1e3),
        "send_lag_ms": describe([r.send_lag for r in records if r.send_lag is not None], 1e3),
    }


def _finish_reason_counts(records: Sequence[RequestRecord]) -> dict[str, int]:
    """How many of ``records`` ended with each finish reason (``unreported`` where none came)."""
    counts: dict[str, int] = {}
    for r in records:
        reason = r.finish_reason or UNREPORTED_FINISH
        counts[reason] = counts.get(reason, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def summarize(records: Sequence[RequestRecord], slo: dict[str, float] | None = None) -> dict[str, Any]:
    """JSON-serialisable summary: duration, overall metrics and metrics per request class."""
    duration = benchmark_duration(records)
    classes = sorted({r.request_class for r in records})
    errors: dict[str, int] = {}
    for r in records:
        if not r.success:
            message = r.error or "no token received"
            errors[message] = errors.get(message, 0) + 1
    return {
        "duration_s": duration,
        "slo_ms": dict(slo or {}),
        "overall": group_metrics(records, duration, slo),
        "classes": {c: group_metrics([r for r in records if r.request_class == c], duration, slo) for c in classes},
        "errors": errors,
    }


def records_jsonl(records: Iterable[RequestRecord]) -> str:
    """The JSONL text of ``records``: one JSON object per request."""
    return "".join(json.dumps(record.to_dict(), ensure_ascii=False) + "\n" for record in records)


def write_records_jsonl(path: str | Path, records: Iterable[RequestRecord]) -> None:
    """Write one JSON object per request."""
    Path(path).write_text(records_jsonl(records), encoding="utf-8")


def read_records_jsonl(path: str | Path) -> list[RequestRecord]:
    """Read records written by :func:`write_records_jsonl`."""
    with open(path, encoding="utf-8") as f:
        return [RequestRecord.from_dict(json.loads(line)) for line in f if line.strip()]


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}"


def format_summary(summary: dict[str, Any]) -> str:
    """Render a summary from :func:`summarize` as a fixed-width text table."""
    groups = {"overall": summary["overall"], **summary["classes"]}
    rows: list[tuple[str, list[str]]] = []
    for key in ("requests", "completed", "failed", "input_tokens", "output_tokens"):
        rows.append((key, [_fmt(g[key]) for g in groups.values()]))
    for key, label in (
        ("request_throughput", "request_throughput (req/s)"),
        ("output_throughput", "output_throughput (tok/s)"),
        ("total_token_throughput", "total_throughput (tok/s)"),
        ("goodput", "goodput (req/s)"),
    ):
        rows.append((label, [_fmt(g[key]) for g in groups.values()]))
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "send_lag_ms"):
        for stat in ("mean", *(f"p{q}" for q in PERCENTILES)):
            rows.append((f"{key} {stat}", [_fmt(g[key][stat]) for g in groups.values()]))
    width = max(len(label) for label, _ in rows) + 2
    col = 12
    header = "metric".ljust(width) + "".join(name.rjust(col) for name in groups)
    lines = [f"duration_s: {_fmt(summary['duration_s'], 3)}", header, "-" * len(header)]
    lines += [label.ljust(width) + "".join(v.rjust(col) for v in values) for label, values in rows]
    if summary.get("slo_ms"):
        lines.append("slo_ms: " + ", ".join(f"{k}<={v:g}" for k, v in summary["slo_ms"].items()))
    for message, count in summary.get("errors", {}).items():
        lines.append(f"error x{count}: {message}")
    overall = summary["overall"]
    mismatched, done = overall.get("output_len_mismatch"), overall["completed"]
    if mismatched:
        reasons = overall.get("output_len_mismatch_finish_reasons") or {}
        ended = "; ".join(f"finish_reason {reason} x{count}" + (f": {_FINISH_MEANINGS[reason]}"
                                                               if reason in _FINISH_MEANINGS else "")
                          for reason, count in reasons.items())
        lines.append(f"warning: {mismatched} of {done} completed requests generated a different number of output "
                     f"tokens than requested ({ended or 'finish reasons not recorded'}); their latencies are not "
                     "those of the requested lengths")
    counted = overall.get("output_tokens_from_tokenizer")
    if counted:
        lines.append(f"note: the server reported no output token count for {counted} of {done} completed requests; "
                     "their output tokens are the generated text counted by the client's tokenizer (records: "
                     "output_tokens_source \"tokenizer\"), which can differ from the tokens the server generated")
    return "\n".join(lines)
