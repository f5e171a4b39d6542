"""PNG plots of a strategy-comparison report (see :mod:`lightllm.benchmark.report_writer`).

Plots are drawn on bare ``Figure`` objects (Agg canvas), never through pyplot, so no global
backend or figure state is touched.  matplotlib is imported only when a plot is drawn: it is a
test/plotting extra (requirements-test.txt), not a serving requirement, so every tool importing
this module still runs without it (:func:`plots_unavailable` says why there are no plots).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, List, Mapping, Sequence, Tuple

if TYPE_CHECKING:
    from matplotlib.figure import Figure

CLASS_ORDER: tuple[str, ...] = ("short", "long")


def plots_unavailable() -> str | None:
    """Why the PNG plots cannot be drawn (one line), or None when matplotlib imports."""
    try:
        # Every module the plots use: a broken install (a numpy ABI mismatch) fails in a submodule,
        # and must be seen before the run, not when its report is written.
        import matplotlib.backends.backend_agg  # noqa: F401
        import matplotlib.figure  # noqa: F401
        import matplotlib.ticker  # noqa: F401
    except ImportError as exc:
        return (f"matplotlib cannot be imported ({exc}); install it (pip install matplotlib, or "
                "pip install -r requirements-test.txt) for ttft_cdf_*.png and throughput_*.png")
    return None


def _new_figure(figsize: tuple[float, float]) -> "Figure":
    """A bare Figure on an Agg canvas (matplotlib is imported here, when a plot is drawn)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


# Longest whisker the throughput plot of paired changes draws, in percent points.
_WHISKER_CAP = 500.0


def change_whiskers(
    points: Sequence[float], changes: Sequence[Mapping[str, Any]],
) -> Tuple[List[float], List[float], List[List[Tuple[int, str]]]]:
    """Whisker lengths below and above each paired change, and the labels of those cut short.

    No whisker where there is no interval (no pairs, or a single one). Whiskers are drawn at most
    ``_WHISKER_CAP`` points long, so one very wide interval (two repeats far apart) does not squash
    every bar; a whisker cut there, or an unbounded end, gets a label ``(sign, text)`` saying
    where the interval ends (+1 above the bar, -1 below).
    """
    err_low: List[float] = []
    err_high: List[float] = []
    capped: List[List[Tuple[int, str]]] = []
    for point, change in zip(points, changes):
        low, high = change["ci_low_percent"], change["ci_high_percent"]
        labels: List[Tuple[int, str]] = []
        if low is None:
            err_low.append(0.0)
            err_high.append(0.0)
            capped.append(labels)
            continue
        err_low.append(min(point - low, _WHISKER_CAP))
        if point - low > _WHISKER_CAP:
            labels.append((-1, f"to {low:+.0f}%"))
        if high is None:
            err_high.append(_WHISKER_CAP)
            labels.append((1, "unbounded"))
        else:
            err_high.append(min(high - point, _WHISKER_CAP))
            if high - point > _WHISKER_CAP:
                labels.append((1, f"to {high:+.0f}%"))
        capped.append(labels)
    return err_low, err_high, capped


def plot_ttft_cdf(ttft_ms: Mapping[str, Mapping[str, Sequence[float]]], path: str | Path, title: str) -> Path:
    """TTFT CDF, one panel per request class, one line per strategy.

    ``ttft_ms[strategy][request_class]`` holds the TTFTs (ms) of every measured repeat
    pooled together.
    """
    present = {c for per in ttft_ms.values() for c, v in per.items() if len(v)}
    classes = [c for c in CLASS_ORDER if c in present] + sorted(present - set(CLASS_ORDER))
    if not classes:
        raise ValueError("ttft_ms must hold at least one TTFT value")
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig = _new_figure((5.5 * len(classes), 4.2))
    for i, cls in enumerate(classes):
        ax = fig.add_subplot(1, len(classes), i + 1)
        for strategy, per in ttft_ms.items():
            values = sorted(per.get(cls, []))
            if not values:
                continue
            fractions = [(k + 1) / len(values) for k in range(len(values))]
            ax.step(values, fractions, where="post", label=f"{strategy} (n={len(values)})")
        if all(v > 0 for per in ttft_ms.values() for v in per.get(cls, [])):
            ax.set_xscale("log")
            # Plain numbers on decade ticks only: labelled minor ticks overlap on a log axis.
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{cls} requests")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path


def plot_throughput(
    section: Mapping[str, Any], strategies: Sequence[str], baseline: str, path: str | Path, title: str,
    confidence: float = 0.95,
) -> Path:
    """Output throughput bars: medians with min-max whiskers, and paired changes with interval whiskers
    (their ``confidence``, as the changes were computed)."""
    values = [[v for v in section["values"][s]["output_throughput"] if v is not None] for s in strategies]
    medians = [section["medians"][s]["output_throughput"] or 0.0 for s in strategies]
    others = [s for s in strategies if s != baseline]
    fig = _new_figure((11 if others else 5.5, 4.2))
    ax = fig.add_subplot(1, 2 if others else 1, 1)
    low = [m - min(v) if v else 0.0 for m, v in zip(medians, values)]
    high = [max(v) - m if v else 0.0 for m, v in zip(medians, values)]
    ax.bar(strategies, medians, yerr=[low, high], capsize=6, color="tab:blue", alpha=0.8)
    ax.set_ylabel("output tokens/s")
    ax.set_title("median over repeats (whiskers: min-max)")
    ax.grid(True, axis="y", alpha=0.3)
    if others:
        changes = [section["changes"][s]["output_throughput"] for s in others]
        points = [c["percent"] if c["percent"] is not None else 0.0 for c in changes]
        err_low, err_high, capped = change_whiskers(points, changes)
        ax2 = fig.add_subplot(1, 2, 2)
        colors = ["tab:green" if p >= 0 else "tab:red" for p in points]
        ax2.bar(others, points, yerr=[err_low, err_high], capsize=6, color=colors, alpha=0.8)
        ax2.axhline(0.0, color="black", linewidth=0.8)
        if any(capped):
            ax2.margins(y=0.12)  # room for the labels inside the axes
        for x, (point, ends) in enumerate(zip(points, capped)):
            # A capped whisker looks like a bounded one: say where the interval really ends.
            for sign, text in ends:
                ax2.annotate(text, (x, point + sign * _WHISKER_CAP), ha="center", fontsize="small",
                             va="bottom" if sign > 0 else "top", textcoords="offset points",
                             xytext=(0, 4 * sign))
        ax2.set_ylabel(f"change vs {baseline} (%)")
        pairs = sorted({c["pairs"] for c in changes})
        ax2.set_title(f"paired change (whiskers: {100 * confidence:g}% Student-t interval, "
                      f"n={'/'.join(map(str, pairs))} pairs)")
        ax2.grid(True, axis="y", alpha=0.3)
    fig.suptitle(title)
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path
