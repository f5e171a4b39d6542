"""A real server on a checkpoint whose tokenizer the grammar engine cannot read (a WordPiece
decoder): structured-output requests get a 400 naming their field before admission, the reason
is logged once and no traceback; free text is served."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from server_process import start_server


def _save_wordpiece_tokenizer(model_dir: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"):
        (model_dir / name).unlink(missing_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "hello", "world", *"abcdefghijklmnopqrstuvwxyz",
             *(f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz")]
    backend = Tokenizer(models.WordPiece({word: i for i, word in enumerate(vocab)}, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                            sep_token="[SEP]", bos_token="[CLS]", eos_token="[SEP]").save_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def wordpiece_server(tiny_llama_dir, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("wordpiece") / "ckpt"
    shutil.copytree(tiny_llama_dir, model_dir)
    _save_wordpiece_tokenizer(model_dir)
    handle = start_server(model_dir, tmp_path_factory.mktemp("logs"), ["--max_total_token_num", "4096"])
    yield handle
    handle.stop()


def test_structured_output_is_refused_before_admission(wordpiece_server) -> None:
    url = wordpiece_server.url
    for body, param in [({"guided_regex": "[a-z ]+"}, "guided_regex"),
                        ({"response_format": {"type": "json_object"}}, "response_format")]:
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "hello world", "max_tokens": 4, **body},
                              timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and "WordPiece" in error["message"]
    response = httpx.post(f"{url}/generate", json={"inputs": "hello", "parameters": {"regular_constraint": "[a-z]+"}},
                          timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "parameters.regular_constraint"
    plain = httpx.post(f"{url}/v1/completions", json={"prompt": "hello world", "max_tokens": 4}, timeout=60)
    assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] >= 1
    log = wordpiece_server.log()
    assert log.count("structured output is not available with this model's tokenizer") == 1
    assert "Traceback" not in log
