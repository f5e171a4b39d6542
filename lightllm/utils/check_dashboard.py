"""Check that a Grafana dashboard only queries series a server exports.

Every PromQL expression of the dashboard (panel targets and template variable queries) is
read for the metrics it queries (``name{...}``, a bare ``name``, ``rate(name[5m])``, and the
metric of ``label_values(name, label)``), the labels its matchers name, and its grouping labels
(``by (...)``, ``on (...)``; :mod:`lightllm.utils.promql_names`): each metric must be a sample
name in the Prometheus exposition, each matcher label a label of its metric (a matcher on a
label the series lack leaves the panel empty), and each grouping label a label of one of the
expression's metrics (``without``/``ignoring`` lists only drop labels, so they are not checked).

Usage: ``python -m lightllm.utils.check_dashboard DASHBOARD.json URL_OR_FILE``
(``URL_OR_FILE``: a ``/metrics`` URL or a saved exposition). Exit code 1 lists the problems.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Set

from prometheus_client.parser import text_string_to_metric_families

from lightllm.utils.http_client_support import API_KEY_HELP, auth_headers, default_api_key, http_refusal
from lightllm.utils.one_line_errors import OneLineErrorParser
from lightllm.utils.promql_names import expression_names

# Labels Prometheus adds to every series it scrapes, so no exposition shows them.
SCRAPE_LABELS = frozenset({"job", "instance"})


def exported_labels(exposition: str) -> Dict[str, Set[str]]:
    """Sample name -> label names seen on it, from a Prometheus text exposition."""
    labels: Dict[str, Set[str]] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return labels


def dashboard_expressions(dashboard: Dict[str, Any]) -> Iterator[str]:
    """Every PromQL expression in a Grafana dashboard JSON model (rows' nested panels too)."""
    def panels(items: List[Dict[str, Any]]) -> Iterator[Dict[str, Any]]:
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    for panel in panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            if "expr" in target:
                yield target["expr"]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable.get("query")
            yield query.get("query", "") if isinstance(query, dict) else str(query)


def dashboard_problems(dashboard: Dict[str, Any], exposition: str) -> List[str]:
    """Problems of ``dashboard`` against ``exposition``; empty when every query can be answered."""
    exported = exported_labels(exposition)
    problems: List[str] = []
    expressions = list(dashboard_expressions(dashboard))
    if not expressions:
        problems.append("the dashboard has no PromQL expressions")
    for expr in expressions:
        names = expression_names(expr)
        metrics = {selector.metric for selector in names.selectors} | {metric for metric, _ in names.label_values}
        for metric, label in names.label_values:
            if metric in exported and label not in exported[metric] | SCRAPE_LABELS:
                problems.append(f"{expr!r}: {metric} has no label {label!r}")
        if not metrics:
            problems.append(f"{expr!r}: names no metric")
        missing = sorted(m for m in metrics if m not in exported)
        problems.extend(f"{expr!r}: {m} is not exported" for m in missing)
        for selector in names.selectors:
            labels = exported.get(selector.metric, set(selector.labels)) | SCRAPE_LABELS
            for label in sorted(set(selector.labels) - labels):
                problems.append(f"{expr!r}: {selector.metric} has no label {label!r} (the matcher selects nothing)")
        known: Set[str] = set()
        for metric in metrics:
            known |= exported.get(metric, set())
        for keyword, label in names.grouping:
            if known and label not in known | SCRAPE_LABELS:
                problems.append(f"{expr!r}: grouping label {label!r} ({keyword}) is on none of {sorted(metrics)}")
    return problems


def _read_dashboard(path: Path) -> Dict[str, Any]:
    """The dashboard's JSON model; ValueError naming ``path`` when it cannot be read."""
    try:
        dashboard = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read dashboard {str(path)!r}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"dashboard {str(path)!r} is not JSON: {exc}") from None
    if not isinstance(dashboard, dict):
        raise ValueError(f"dashboard {str(path)!r} is not a JSON object (a Grafana dashboard model)")
    return dashboard


def main(argv: Optional[List[str]] = None) -> int:
    """CLI entry point."""
    parser = OneLineErrorParser(prog="python -m lightllm.utils.check_dashboard", description=__doc__.splitlines()[0])
    parser.add_argument("dashboard", type=Path, help="Grafana dashboard JSON model")
    parser.add_argument("metrics", help="a /metrics URL or a file with a Prometheus text exposition")
    parser.add_argument("--api-key", default=default_api_key(),
                        help=API_KEY_HELP + "; /metrics needs it when the server was started with --api_key")
    args = parser.parse_args(argv)
    try:  # read first: a missing dashboard is named before any server is asked
        dashboard = _read_dashboard(args.dashboard)
    except ValueError as exc:
        parser.error(str(exc))
    if args.metrics.startswith(("http://", "https://")):
        import httpx

        try:
            response = httpx.get(args.metrics, timeout=10, headers=auth_headers(args.api_key))
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            parser.error(f"cannot read metrics from {args.metrics}: {exc}")
        if response.status_code != 200:
            # A 401 (no or wrong --api-key) or a 503 (still loading) is not an exposition to parse.
            parser.error(f"{args.metrics} answered {http_refusal(response)}")
        exposition = response.text
    else:
        try:
            exposition = Path(args.metrics).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            parser.error(f"cannot read metrics file {args.metrics!r}: {getattr(exc, 'strerror', None) or exc}")
    try:
        problems = dashboard_problems(dashboard, exposition)
    except ValueError as exc:  # prometheus_client's parser refuses a malformed exposition
        parser.error(f"the metrics from {args.metrics} are not a Prometheus text exposition: {exc}")
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print(f"{args.dashboard}: every expression is answered by {args.metrics}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
