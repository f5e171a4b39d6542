"""The dashboard check reads every metric an expression queries, not only ``name{...}`` selectors.

It saw a metric only when a ``{`` followed its name: ``rate(vllm:nope_total[5m])`` passed, vLLM's old
``vllm:gpu_cache_usage_perc`` passed, and ``sum(vllm:num_requests_running)`` was refused as having
"no metric selector" (outside pass).
"""

from __future__ import annotations

from typing import List

import pytest

from lightllm.utils.check_dashboard import dashboard_problems
from lightllm.utils.promql_names import expression_names

EXPOSITION = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 0
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{model_name="m"} 3
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{model_name="m",le="+Inf"} 0
vllm:e2e_request_latency_seconds_sum{model_name="m"} 0
vllm:e2e_request_latency_seconds_count{model_name="m"} 0
"""


def _problems(expr: str) -> List[str]:
    return dashboard_problems({"panels": [{"targets": [{"expr": expr}]}]}, EXPOSITION)


def test_metrics_are_found_with_or_without_a_selector_block() -> None:
    names = expression_names('sum by (le) (rate(a_bucket{x=~"$v", y!="}"}[$__rate_interval])) / '
                             'on (job) group_left b offset 5m + ignoring (z) c @ 1609746000 > bool 1.5e3 '
                             'and topk(3, d) unless {__name__="e"} or max without (q) (f)')
    assert [(s.metric, s.labels) for s in names.selectors] == [
        ("a_bucket", ["x", "y"]), ("b", []), ("c", []), ("d", []), ("f", [])]
    assert names.grouping == [("by", "le"), ("on", "job")]  # ignoring/without only drop labels
    assert expression_names('label_values(g, model_name)').label_values == [("g", "model_name")]
    assert expression_names('histogram_quantile(0.95, x) * 1h30m').selectors[0].metric == "x"
    assert expression_names("vector(1) + time()").selectors == []


@pytest.mark.parametrize("expr, problem", [
    ("rate(vllm:nope_total[5m]) + rate(vllm:prompt_tokens_total{}[5m])", "vllm:nope_total is not exported"),
    ('sum(vllm:gpu_cache_usage_perc) / sum(vllm:num_requests_running{model_name=~"$model_name"})',
     "vllm:gpu_cache_usage_perc is not exported"),
    ('vllm:num_requests_running{bogus="x"}', "vllm:num_requests_running has no label 'bogus'"),
    ("sum by (bogus) (vllm:num_requests_running)", "grouping label 'bogus' (by)"),
    ("vector(1)", "names no metric"),
])
def test_a_query_the_server_cannot_answer_is_named(expr: str, problem: str) -> None:
    problems = _problems(expr)
    assert len(problems) == 1 and problem in problems[0], problems


@pytest.mark.parametrize("expr", [
    "sum(vllm:num_requests_running)",
    "sum without (bogus) (vllm:num_requests_running)",
    'rate(vllm:prompt_tokens_total{job="lightllm", instance=~".+"}[5m])',  # labels the scrape adds
    "histogram_quantile(0.9, sum by (le, instance) (rate(vllm:e2e_request_latency_seconds_bucket[1m])))",
])
def test_a_query_the_server_answers_passes(expr: str) -> None:
    assert _problems(expr) == []


@pytest.mark.parametrize("expr", [
    'label_values(vllm:num_requests_running{model_name="m"}, model_name)',  # a chained Grafana variable
    "label_values(vllm:num_requests_running, instance)",
    "sum(vllm:num_requests_running) BY (model_name)",
    "vllm:num_requests_running > 0 AND vllm:prompt_tokens_total < Inf",
    "vllm:num_requests_running > NaN",
    "sum(vllm:num_requests_running) # the running requests",
    "sum by ($group) (vllm:num_requests_running)",
])
def test_forms_real_dashboards_use_pass(expr: str) -> None:
    assert _problems(expr) == []


def test_a_chained_variable_query_checks_its_matchers_too() -> None:
    problems = _problems('label_values(vllm:num_requests_running{zone="a"}, model_name)')
    assert len(problems) == 1 and "has no label 'zone'" in problems[0], problems
