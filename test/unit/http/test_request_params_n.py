"""vLLM's ``request_params_n``: every API request whose generations started observes its ``n``
once per prompt (a refused request never does), on every generating endpoint."""

from __future__ import annotations

from typing import Dict

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from api_fakes import MODEL, FakeManager
from lightllm.server.http.app import create_app
from lightllm.server.httpserver.metrics import N_BUCKETS, ServerMetrics


def _client(manager: FakeManager) -> TestClient:
    return TestClient(create_app(manager), raise_server_exceptions=False)


def test_each_endpoint_reports_n_once_per_prompt_of_an_accepted_request() -> None:
    manager = FakeManager()
    client = _client(manager)
    answer = client.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b", "c"], "max_tokens": 2, "n": 2,
                                                    "temperature": 0.5})
    assert answer.status_code == 200 and len(answer.json()["choices"]) == 6
    assert manager.request_params == [(2, 3)]
    client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 2})
    assert manager.request_params[-1] == (1, 1)
    # best_of: the request's n is observed (the choices it returns), not the generations it ran.
    client.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2, "n": 2, "best_of": 4,
                                         "temperature": 0.5})
    assert manager.request_params[-1] == (2, 1)
    streamed = client.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2, "n": 3,
                                                    "temperature": 0.5, "stream": True})
    assert streamed.status_code == 200
    assert manager.request_params[-1] == (3, 1)
    client.post("/generate", json={"inputs": "a", "parameters": {"max_new_tokens": 2, "n": 2, "do_sample": True}})
    assert manager.request_params[-1] == (2, 1)
    assert len(manager.request_params) == 5


def test_a_refused_request_is_not_observed() -> None:
    manager = FakeManager()
    manager.failure = "busy"
    answer = _client(manager).post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2, "n": 2,
                                                            "temperature": 0.5})
    assert answer.status_code == 503
    bad = _client(manager).post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2, "n": 0})
    assert bad.status_code == 400
    assert manager.request_params == []


def _histogram(metrics: ServerMetrics, name: str, **labels: str) -> Dict[str, float]:
    family = next(f for f in text_string_to_metric_families(metrics.render()[0].decode()) if f.name == name)
    return {s.labels.get("le", s.name): s.value for s in family.samples
            if all(s.labels.get(k) == v for k, v in labels.items())}


def test_n_is_a_histogram_with_vllms_buckets_under_both_names() -> None:
    metrics = ServerMetrics("default", None, "m")
    metrics.on_request_params(2)
    metrics.on_request_params(1, prompts=3)
    metrics.on_request_params(7)
    assert N_BUCKETS == (1, 2, 5, 10, 20)
    for name, labels in (("lightllm_request_params_n", {"strategy": "default"}),
                         ("vllm:request_params_n", {"engine": "0", "model_name": "m"})):
        samples = _histogram(metrics, name, **labels)
        assert samples == {"1.0": 3, "2.0": 4, "5.0": 4, "10.0": 5, "20.0": 5, "+Inf": 5,
                           f"{name}_count": 5, f"{name}_sum": 12}
