"""``inputs`` of ``/generate`` and ``/generate_stream`` as token ids, as LightLLM's HTTP manager takes them.

A client that tokenized itself sends ``{"inputs": [1, 20, 30]}``; the ids are validated as
``/v1/completions`` validates a token-id prompt (integers, integral floats included, inside the
model's vocabulary), used as given (no tokenization, no characters-per-token bound), and the
request then runs exactly as its text would: same prompt ids to the manager, same answers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, AsyncIterator

import pytest
from fastapi.testclient import TestClient

from api_fakes import MODEL, FakeManager, FakeServed, assert_error, sse_events
from pd_master_support import master_manager
from lightllm.server.http.app import create_app
from lightllm.server.http.server_options import HttpLimits, HttpServerOptions

PATHS = ("/generate", "/generate_stream")
TEXT = "hello there"


class _EncodeCountingServed(FakeServed):
    """A FakeServed that records every text it is asked to tokenize."""

    def __init__(self) -> None:
        super().__init__()
        self.encoded: list[str] = []

    def encode_prompt(self, text: str, add_special_tokens: bool = True, within: int | None = None) -> list[int]:
        self.encoded.append(text)
        return super().encode_prompt(text, add_special_tokens, within)


@pytest.mark.parametrize("path", PATHS)
def test_text_and_its_ids_reach_the_manager_and_answer_alike(client: TestClient, manager: FakeManager,
                                                             path: str) -> None:
    ids = manager.served.encode_prompt(TEXT)
    parameters = {"max_new_tokens": 3, "return_details": True}
    answers = [client.post(path, json={"inputs": inputs, "parameters": parameters}) for inputs in (TEXT, ids)]
    assert [answer.status_code for answer in answers] == [200, 200]
    assert manager.calls[0].prompt_ids == manager.calls[1].prompt_ids == ids
    assert manager.calls[0].params == manager.calls[1].params
    if path == "/generate":
        by_text, by_ids = (answer.json() for answer in answers)
        assert by_ids == by_text and by_ids["prompt_tokens"] == len(ids) and "prompt_cache_len" in by_ids
    else:
        by_text, by_ids = (sse_events(answer) for answer in answers)
        assert by_ids == by_text and by_ids[-1]["finished"] is True
        assert by_ids[-1]["details"]["prompt_tokens"] == len(ids)


def test_integral_floats_are_token_ids(client: TestClient, manager: FakeManager) -> None:
    # The project's rule for every integer field, and /v1/completions' for its token ids.
    assert client.post("/generate", json={"inputs": [1.0, 20, 30.0]}).status_code == 200
    assert manager.calls[0].prompt_ids == [1, 20, 30]
    assert all(type(token_id) is int for token_id in manager.calls[0].prompt_ids)


@pytest.mark.parametrize(("inputs", "words"), [
    ([], "must not be empty"),
    ([1, 2.5], "item 1 is 2.5"),
    ([-1], "token id -1 is outside the vocabulary [0, 100)"),
    ([1, 100], "token id 100 is outside the vocabulary [0, 100)"),
    ([True, 2], "item 0 is true"),
    ([[1, 2]], "item 0 is an array"),
    ([1, [2]], "item 1 is an array"),
    ([1, "2"], "item 1 is a string"),
    ([1, {"id": 2}], "item 1 is an object"),
    (5, "got 5"),
    ({"ids": [1]}, "got an object"),
    ("", "must not be empty"),
])
@pytest.mark.parametrize("path", PATHS)
def test_inputs_that_are_no_prompt_are_refused_naming_inputs(client: TestClient, manager: FakeManager, path: str,
                                                             inputs: Any, words: str) -> None:
    error = assert_error(client.post(path, json={"inputs": inputs}), 400, "inputs")
    assert words in error["message"]
    assert manager.calls == []


@pytest.mark.parametrize("prompt", [[], [1, 2.5], [-1], [1, 100], [True, 2], [[1, [2]]], [1, "2"]])
def test_refused_as_v1_completions_refuses_the_same_ids(client: TestClient, manager: FakeManager,
                                                        prompt: list[Any]) -> None:
    assert_error(client.post("/v1/completions", json={"model": MODEL, "prompt": prompt}), 400, "prompt")
    assert_error(client.post("/generate", json={"inputs": prompt}), 400, "inputs")
    assert manager.calls == []


@pytest.mark.parametrize(("prompt", "words"), [
    ([1, True], "item 1 is true"),
    ([1, 2.5], "item 1 is 2.5"),
    ([1, None], "item 1 is null"),
    ([[1, 2], [3, True]], "prompt 1 item 1 is true"),
    ([[1, 2], [3, {"id": 4}]], "prompt 1 item 1 is an object"),
])
def test_v1_completions_names_the_item_that_is_no_token_id_as_generate_does(client: TestClient, manager: FakeManager,
                                                                           prompt: list[Any], words: str) -> None:
    error = assert_error(client.post("/v1/completions", json={"model": MODEL, "prompt": prompt}), 400, "prompt")
    assert error["message"].endswith(words), error["message"]


def test_add_special_tokens_leaves_ids_as_given(client: TestClient, manager: FakeManager) -> None:
    # As /v1/completions (and vLLM, and LightLLM's HTTP manager): a client that tokenized chose its
    # special tokens, so the flag, which says how to tokenize a text, is accepted and the ids kept.
    ids = manager.served.encode_prompt(TEXT, add_special_tokens=False)
    for add in (True, False):
        body = {"inputs": ids, "parameters": {"max_new_tokens": 2, "add_special_tokens": add}}
        assert client.post("/generate", json=body).status_code == 200
        completion = {"model": MODEL, "prompt": ids, "max_tokens": 2, "add_special_tokens": add}
        assert client.post("/v1/completions", json=completion).status_code == 200
    assert [call.prompt_ids for call in manager.calls] == [ids] * 4
    # The same text with the flag off gives those ids again.
    client.post("/generate", json={"inputs": TEXT, "parameters": {"max_new_tokens": 2, "add_special_tokens": False}})
    assert manager.calls[-1].prompt_ids == ids


def test_ids_are_neither_tokenized_nor_bounded_by_characters() -> None:
    manager = FakeManager(_EncodeCountingServed())  # max_req_total_len 64: 2 characters per token allow 128 characters
    client = TestClient(create_app(manager, HttpServerOptions(limits=HttpLimits(prompt_chars_per_token=2))))
    # 60 ids written as JSON take 240 characters, more than the 128 the bound allows a text: it is about text.
    ids = [99] * 60
    assert client.post("/generate", json={"inputs": ids, "parameters": {"max_new_tokens": 4}}).status_code == 200
    assert manager.served.encoded == [] and manager.calls[0].prompt_ids == ids


def test_context_length_counts_the_ids(client: TestClient, manager: FakeManager) -> None:
    # FakeManager: max_req_total_len 64.
    too_long = assert_error(client.post("/generate", json={"inputs": [5] * 60, "parameters": {"max_new_tokens": 5}}),
                            400, "parameters.max_new_tokens", "context_length_exceeded")
    assert "60 in the prompt" in too_long["message"]
    assert_error(client.post("/generate_stream", json={"inputs": [5] * 64}), 400, "inputs", "context_length_exceeded")
    assert manager.calls == []
    # A default length is cut to the room the ids leave, as for text.
    answer = client.post("/generate", json={"inputs": [5] * 62}).json()
    assert manager.calls[0].params.max_new_tokens == 2 and answer["finish_reason"] == "length"
    assert answer["prompt_tokens"] == 62


def test_n_best_of_and_details_with_ids(client: TestClient, manager: FakeManager) -> None:
    ids = manager.served.encode_prompt(TEXT)
    body = {"inputs": ids, "parameters": {"n": 2, "best_of": 3, "return_details": True, "max_new_tokens": 3}}
    answer = client.post("/generate", json=body).json()
    assert len(manager.calls) == 3 and all(call.prompt_ids == ids for call in manager.calls)
    assert len(answer["generated_text"]) == 2 and len(answer["details"]) == 2 and len(answer["tokens"]) == 2
    assert answer["prompt_tokens"] == len(ids) and answer["prompt_cache_len"] == manager.cached_tokens
    assert_error(client.post("/generate_stream", json={"inputs": ids, "parameters": {"n": 2}}), 400, "parameters.n")


def test_openapi_describes_both_forms(client: TestClient) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    document = client.get("/openapi.json").json()
    validator = jsonschema.Draft202012Validator({**document, **document["components"]["schemas"][
        "NativeGenerateRequest"]})
    for inputs in ("hi", [1, 20, 30], [1.0, 2]):
        assert client.post("/generate", json={"inputs": inputs}).status_code == 200
        validator.validate({"inputs": inputs})
    # Refusals a schema-driven fuzzer could generate (the vocabulary is the served model's, not the schema's).
    for inputs in ("", [], [-1], [1.5], [True], [[1]], [1, "2"], 5):
        assert client.post("/generate", json={"inputs": inputs}).status_code == 400
        assert not validator.is_valid({"inputs": inputs}), inputs


# ---------------------------------------------------------------- through a PD master


@pytest.fixture(scope="module")
def pd_master(tiny_llama_dir: Path) -> Any:
    return master_manager(tiny_llama_dir)


def test_pd_master_takes_ids_as_given(pd_master: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The master runs the same NativeEndpoints over its own manager, which takes the ids unchanged.

    No node joins: the master's own generate still checks the request (vocabulary, context) and then
    answers 503 for want of nodes, for the text and its ids alike.
    """
    specs: list[Any] = []
    generate = pd_master.generate

    async def recording(spec: Any, *, request: Any = None) -> AsyncIterator[Any]:
        specs.append(spec)
        async for event in generate(spec, request=request):
            yield event

    monkeypatch.setattr(pd_master, "generate", recording)
    client = TestClient(create_app(pd_master), raise_server_exceptions=False)
    ids = pd_master.served.tokenizer(TEXT)["input_ids"]
    for inputs in (TEXT, ids):
        assert client.post("/generate", json={"inputs": inputs, "parameters": {"max_new_tokens": 2}}).status_code == 503
    assert [list(spec.prompt_ids) for spec in specs] == [ids, ids]
    vocab = pd_master.served.vocab_size
    error = assert_error(client.post("/generate", json={"inputs": [1, vocab]}), 400, "inputs")
    assert f"[0, {vocab})" in error["message"] and len(specs) == 2
