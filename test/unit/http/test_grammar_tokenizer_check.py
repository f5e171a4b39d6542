"""Structured output on a model whose tokenizer the grammar engine cannot read (a WordPiece
decoder): every request asking for a grammar gets a 400 naming the field that asked, before
admission, instead of a 500 from the model rank; requests without one are served."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from api_fakes import FakeManager, FakeServed, assert_error, chat, completion
from lightllm.server.grammar_tokenizer_check import GrammarTokenizerCheck
from lightllm.server.http.app import create_app
from lightllm.server.served_model import ServedModel
from lightllm.utils.tokenizer_utils import load_tokenizer


def _wordpiece_tokenizer() -> PreTrainedTokenizerFast:
    """A BERT-style tokenizer: WordPiece model and decoder ('##' continuations)."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "hello", "world", "##s", *"abcdefghijklmnopqrstuvwxyz"]
    backend = Tokenizer(models.WordPiece({word: i for i, word in enumerate(vocab)}, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]", eos_token="[SEP]")


def test_the_check_names_why_a_wordpiece_decoder_cannot_run_grammars() -> None:
    check = GrammarTokenizerCheck(_wordpiece_tokenizer(), [3])
    problem = check.problem()
    assert problem is not None and "WordPiece" in problem and "\n" not in problem
    assert check.problem() == problem  # found once, then remembered


def test_a_byte_level_tokenizer_runs_grammars(tiny_llama_dir: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    assert GrammarTokenizerCheck(tokenizer, [tokenizer.eos_token_id]).problem() is None


def test_the_served_model_asks_its_own_tokenizer(tiny_llama_dir: Path) -> None:
    served = ServedModel("m", ["m"], _wordpiece_tokenizer(), 64, [3], 128)
    assert "WordPiece" in served.structured_output_problem()
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    served = ServedModel("m", ["m"], tokenizer, len(tokenizer), [tokenizer.eos_token_id], 128)
    assert served.structured_output_problem() is None


class UnreadableTokenizerServed(FakeServed):
    """The fake served model of a tokenizer the grammar engine cannot read."""

    def structured_output_problem(self) -> str | None:
        return "can't determine decoder type: WordPiece"


@pytest.fixture()
def unreadable() -> FakeManager:
    return FakeManager(UnreadableTokenizerServed())


@pytest.fixture()
def unreadable_client(unreadable: FakeManager) -> TestClient:
    return TestClient(create_app(unreadable), raise_server_exceptions=False)


_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize(
    "send, fields, param",
    [
        (completion, {"guided_regex": "[a-z]+"}, "guided_regex"),
        (completion, {"guided_choice": ["a", "b"]}, "guided_choice"),
        (completion, {"structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs"),
        (completion, {"response_format": {"type": "json_object"}}, "response_format"),
        (chat, {"guided_json": {"type": "object"}}, "guided_json"),
        (chat, {"response_format": {"type": "json_object"}}, "response_format"),
        (chat, {"tools": [_TOOL], "tool_choice": "required"}, "tool_choice"),
    ],
)
def test_openai_requests_with_a_grammar_are_refused_naming_their_field(
        unreadable_client: TestClient, unreadable: FakeManager, send, fields, param) -> None:
    response = send(unreadable_client, **fields)
    assert_error(response, 400, param=param)
    assert "cannot read its tokenizer" in response.json()["error"]["message"]
    assert "WordPiece" in response.json()["error"]["message"]
    assert not unreadable.calls  # refused before admission
    assert send(unreadable_client).status_code == 200  # free text is served


def test_native_requests_with_a_constraint_are_refused_naming_it(
        unreadable_client: TestClient, unreadable: FakeManager) -> None:
    response = unreadable_client.post("/generate", json={"inputs": "hi", "parameters": {"regular_constraint": "[a-z]+"}})
    assert_error(response, 400, param="parameters.regular_constraint")
    assert not unreadable.calls
    assert unreadable_client.post("/generate", json={"inputs": "hi"}).status_code == 200
