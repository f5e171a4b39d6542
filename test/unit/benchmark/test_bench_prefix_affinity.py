"""The pure parts of the prefix-affinity benchmark: counter reading and the hit rate."""

from __future__ import annotations

from lightllm.benchmark.bench_prefix_affinity import build_parser, counter_total, hit_rate

METRICS = """# HELP lightllm_prompt_tokens_total Prompt tokens received
lightllm_prompt_tokens_total{model_name="m",strategy="default"} 120.0
lightllm_prompt_tokens_total{model_name="m",strategy="hrrn"} 30.0
lightllm_prompt_tokens_created{model_name="m"} 1.7e9
lightllm_cached_prompt_tokens_total{model_name="m",strategy="default"} 90.0
"""


def test_counter_total_sums_every_series_of_the_counter_only():
    assert counter_total(METRICS, "lightllm_prompt_tokens") == 150.0
    assert counter_total(METRICS, "lightllm_cached_prompt_tokens") == 90.0
    assert counter_total(METRICS, "lightllm_missing") == 0.0


def test_hit_rate_is_cached_over_prompt_tokens_of_the_measured_interval():
    before = {"prefill": (100.0, 50.0), "prefill_2": (0.0, 0.0)}
    after = {"prefill": (300.0, 200.0), "prefill_2": (200.0, 50.0)}
    assert hit_rate(before, after) == (150.0 + 50.0) / (200.0 + 200.0)
    assert hit_rate(after, after) == 0.0


def test_parser_offers_only_pd_topologies(tiny_llama_dir):
    args = build_parser().parse_args(["--model_dir", str(tiny_llama_dir)])
    assert args.topology == "2p1d" and args.affinity == [256, 0]
    assert "normal" not in next(a for a in build_parser()._actions if a.dest == "topology").choices
