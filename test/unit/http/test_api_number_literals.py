"""Numbers in a request body as JSON writes them: non-finite values, values a 64-bit float reads
as zero, zero literals and subnormals, on the OpenAI and native endpoints."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from api_fakes import MODEL, FakeManager, assert_error, completion


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_numbers_are_refused_as_not_finite(client: TestClient, literal: str) -> None:
    raw = '{"model": "%s", "prompt": "hi", "temperature": %s}' % (MODEL, literal)
    response = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    error = assert_error(response, 400, "temperature")
    assert "must be finite" in error["message"]
    raw = '{"inputs": "hi", "parameters": {"top_p": %s}}' % literal
    response = client.post("/generate", content=raw, headers={"content-type": "application/json"})
    assert "must be finite" in assert_error(response, 400, "parameters.top_p")["message"]


@pytest.mark.parametrize("literal", ["1e-400", "-1e-400", "0.5e-330", "12E-500"])
def test_nonzero_numbers_a_double_reads_as_zero_are_refused(client: TestClient, literal: str) -> None:
    """``json.loads`` read them as 0: greedy decoding for a temperature, even a negative one, accepted."""
    raw = '{"model": "%s", "prompt": "hi", "temperature": %s, "max_tokens": 2}' % (MODEL, literal)
    response = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    error = assert_error(response, 400, "temperature")
    assert error["message"] == (f"Invalid value for 'temperature': {literal} is too close to 0 for a 64-bit float "
                                "and would be read as 0; send 0 if that is what is meant")
    raw = '{"inputs": "hi", "parameters": {"temperature": %s}}' % literal
    response = client.post("/generate", content=raw, headers={"content-type": "application/json"})
    assert "would be read as 0" in assert_error(response, 400, "parameters.temperature")["message"]


@pytest.mark.parametrize("literal", ["0", "0.0", "-0.0", "0e10", "0.000e-999", "0.0e-400"])
def test_zero_literals_are_zero(client: TestClient, manager: FakeManager, literal: str) -> None:
    raw = '{"model": "%s", "prompt": "hi", "temperature": %s, "max_tokens": 2}' % (MODEL, literal)
    response = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 200 and manager.calls[-1].params.temperature == 0.0


def test_a_subnormal_literal_keeps_its_value_and_meets_the_field_rule(client: TestClient) -> None:
    raw = '{"model": "%s", "prompt": "hi", "temperature": 1e-320, "max_tokens": 2}' % MODEL
    response = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert "must be at least" in assert_error(response, 400, "temperature")["message"]


def test_json_carried_as_text_refuses_an_underflowing_number_too(client: TestClient) -> None:
    schema = '{"type": "object", "properties": {"x": {"type": "number", "minimum": 1e-400}}}'
    response = completion(client, guided_json=schema)
    error = assert_error(response, 400, "guided_json")
    assert "its JSON holds 1e-400, too close to 0 for a 64-bit float (it would be read as 0)" in error["message"]
