"""Reading what a checkpoint ships beside its weights, without transformers: the sampling defaults of
``generation_config.json`` and the tokenizer's ``eos_token`` id (compared with what transformers reads)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from lightllm.common.basemodel.generation_defaults import (GenerationDefaults, GenerationDefaultsError,
                                                          read_generation_defaults, resolve_generation_defaults)
from lightllm.common.basemodel.model_config import ModelConfig, ModelConfigError
from lightllm.server.request_defaults import resolve_eos_token_ids
from lightllm.utils.tokenizer_files import tokenizer_eos_token_id


def _write(directory: Path, name: str, value: object) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(json.dumps(value))
    return directory


# ---------------------------------------------------------------- generation_config.json


def test_only_the_keys_the_file_sets_are_defaults(tmp_path: Path) -> None:
    directory = _write(tmp_path, "generation_config.json", {
        "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_new_tokens": 7,
        "do_sample": True, "eos_token_id": [1, 2], "bos_token_id": 0})
    defaults = read_generation_defaults(directory)
    assert defaults.sampling_fields() == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    assert (defaults.max_new_tokens, defaults.do_sample, defaults.min_p) == (7, True, None)
    assert "temperature=0.7" in defaults.describe() and str(directory) in defaults.describe()


def test_every_key_vllm_takes_from_the_file_is_a_default(tmp_path: Path) -> None:
    # presence_penalty and frequency_penalty were dropped without a word; vLLM applies them.
    directory = _write(tmp_path, "generation_config.json", {"presence_penalty": 1.9, "frequency_penalty": -1.5,
                                                            "max_new_tokens": 5, "num_beams": 4})
    defaults = read_generation_defaults(directory)
    assert defaults.sampling_fields() == {"presence_penalty": 1.9, "frequency_penalty": -1.5}
    assert "presence_penalty=1.9" in defaults.describe() and "frequency_penalty=-1.5" in defaults.describe()
    vllm_keys = {"repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k", "top_p",
                 "min_p", "max_new_tokens"}
    assert vllm_keys == {field.name for field in dataclasses.fields(GenerationDefaults)} - {"do_sample", "source"}


def test_a_checkpoint_without_the_file_or_keys_has_no_defaults(tmp_path: Path) -> None:
    assert read_generation_defaults(tmp_path) == GenerationDefaults()
    only_eos = _write(tmp_path / "eos", "generation_config.json", {"eos_token_id": 2, "do_sample": False})
    assert read_generation_defaults(only_eos).sampling_fields() == {}
    assert "server's defaults" in GenerationDefaults().describe()


@pytest.mark.parametrize("raw, named", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": "hot"}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"), ({"top_k": 2.5}, "top_k"), ({"min_p": 2}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"do_sample": "yes"}, "do_sample"), ({"temperature": True}, "temperature"),
    ({"temperature": 1e39}, "temperature"), ({"top_k": 99999999999}, "top_k"),
    ({"presence_penalty": 2.5}, "presence_penalty must be in \\[-2, 2\\]"), ({"presence_penalty": "x"}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty must be in \\[-2, 2\\]"), ({"frequency_penalty": True}, "frequency_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
])
def test_a_value_no_request_could_send_is_refused_naming_file_and_key(tmp_path: Path, raw: dict, named: str) -> None:
    directory = _write(tmp_path, "generation_config.json", raw)
    with pytest.raises(GenerationDefaultsError, match=named) as caught:
        read_generation_defaults(directory)
    assert "generation_config.json" in str(caught.value) and "\n" not in str(caught.value)


def test_a_broken_file_is_refused(tmp_path: Path) -> None:
    tmp_path.joinpath("generation_config.json").write_text("{not json")
    with pytest.raises(GenerationDefaultsError, match="not valid JSON"):
        read_generation_defaults(tmp_path)
    tmp_path.joinpath("generation_config.json").write_text("[1, 2]")
    with pytest.raises(GenerationDefaultsError, match="JSON object"):
        read_generation_defaults(tmp_path)


def test_the_flag_selects_the_checkpoint_none_or_another_directory(tmp_path: Path) -> None:
    model = _write(tmp_path / "model", "generation_config.json", {"temperature": 0.5})
    other = _write(tmp_path / "other", "generation_config.json", {"temperature": 0.9})
    assert resolve_generation_defaults("auto", model).temperature == 0.5
    assert resolve_generation_defaults("none", model) == GenerationDefaults()
    assert resolve_generation_defaults(str(other), model).temperature == 0.9
    with pytest.raises(GenerationDefaultsError, match="'auto', 'none' or a directory"):
        resolve_generation_defaults(str(tmp_path / "missing"), model)


# ---------------------------------------------------------------- the tokenizer's eos_token


def _bpe_tokenizer(path: Path, eos: str, specials: list[str]) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["hello world, the end of a turn"] * 20, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos).save_pretrained(path)
    return path


def _unigram_tokenizer(path: Path) -> Path:
    tok = Tokenizer(models.Unigram())
    trainer = trainers.UnigramTrainer(vocab_size=60, special_tokens=["<pad>", "<eot>"], show_progress=False,
                                      unk_token="<pad>")
    tok.train_from_iterator(["hello world, the end of a turn"] * 20, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eot>").save_pretrained(path)
    return path


@pytest.mark.parametrize("eos, specials", [("<|im_end|>", ["<|endoftext|>", "<|im_end|>"]), ("</s>", ["<s>", "</s>"])])
def test_the_eos_id_read_from_files_is_the_one_transformers_reads(tmp_path: Path, eos: str, specials: list[str]) -> None:
    path = _bpe_tokenizer(tmp_path, eos, specials)
    expected = AutoTokenizer.from_pretrained(path).eos_token_id
    assert tokenizer_eos_token_id(path) == expected == specials.index(eos)


def test_the_eos_id_resolves_from_every_place_a_tokenizer_keeps_it(tmp_path: Path) -> None:
    unigram = _unigram_tokenizer(tmp_path / "unigram")
    assert tokenizer_eos_token_id(unigram) == AutoTokenizer.from_pretrained(unigram).eos_token_id
    # Only in special_tokens_map.json, as an AddedToken dict (read: no added_tokens_decoder).
    bpe = _bpe_tokenizer(tmp_path / "bpe", "<|im_end|>", ["<|endoftext|>", "<|im_end|>"])
    config = json.loads((bpe / "tokenizer_config.json").read_text())
    config.pop("eos_token")
    config.pop("added_tokens_decoder", None)
    (bpe / "tokenizer_config.json").write_text(json.dumps(config))
    _write(bpe, "special_tokens_map.json", {"eos_token": {"content": "<|im_end|>", "lstrip": False}})
    assert tokenizer_eos_token_id(bpe) == AutoTokenizer.from_pretrained(bpe).eos_token_id == 1
    # Found through added_tokens_decoder when tokenizer_config.json names it (the map is then unread).
    config["eos_token"] = "<|im_end|>"
    config["added_tokens_decoder"] = {"1": {"content": "<|im_end|>", "special": True}}
    (bpe / "tokenizer_config.json").write_text(json.dumps(config))
    assert tokenizer_eos_token_id(bpe) == AutoTokenizer.from_pretrained(bpe).eos_token_id == 1
    assert tokenizer_eos_token_id(tmp_path / "nothing") is None
    _write(tmp_path / "unknown", "tokenizer_config.json", {"eos_token": "<never>"})
    assert tokenizer_eos_token_id(tmp_path / "unknown") is None


_DECODER = {str(index): {"content": text, "special": True}
            for index, text in enumerate(["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"])}
_ABSENT = object()


@pytest.mark.parametrize("config_eos, map_eos, decoder", [
    ("</s>", "</s>", False),            # both files agree
    ("<|im_end|>", "</s>", False),      # they disagree: the map replaces the config (was: the config's)
    ("<|im_end|>", "</s>", True),       # with added_tokens_decoder the map is not read
    ("</s>", "<|im_end|>", False),
    ("</s>", "<|im_end|>", True),
    ("<|im_end|>", _ABSENT, False),     # only one file names it
    (_ABSENT, "<|im_end|>", False),
    (_ABSENT, "<|im_end|>", True),      # the map unread: no eos_token at all
    ("<|im_end|>", None, False),        # the map's null replaces the config's too
    (None, "<|im_end|>", False),
    ("<|im_end|>", "map without the key", False),
])
def test_the_eos_token_is_the_one_transformers_settles_on_when_the_files_disagree(
        tiny_llama_dir: Path, tmp_path: Path, config_eos: object, map_eos: object, decoder: bool) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("eos_token")
    if config_eos is not _ABSENT:
        config["eos_token"] = config_eos
    if decoder:
        config["added_tokens_decoder"] = _DECODER
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    special = json.loads((model / "special_tokens_map.json").read_text())
    special.pop("eos_token")
    if map_eos is not _ABSENT and map_eos != "map without the key":
        special["eos_token"] = map_eos
    if map_eos is _ABSENT:
        (model / "special_tokens_map.json").unlink()
    else:
        (model / "special_tokens_map.json").write_text(json.dumps(special))
    assert tokenizer_eos_token_id(model) == AutoTokenizer.from_pretrained(model).eos_token_id


def test_a_config_without_eos_ids_stops_where_the_tokenizer_does(tiny_llama_dir: Path, tmp_path: Path) -> None:
    # The tester's case: config.json's eos_token_id null, none in generation_config.json, and the
    # tokenizer files disagreeing (no added_tokens_decoder). The server stopped at <|im_end|>, the
    # tokenizer (and so vLLM) at </s>.
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["eos_token_id"] = None
    (model / "config.json").write_text(json.dumps(config))
    (model / "generation_config.json").write_text(json.dumps({"bos_token_id": 1}))
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    tokenizer_config["eos_token"] = "<|im_end|>"
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    tokenizer = AutoTokenizer.from_pretrained(model)
    assert tokenizer.eos_token == "</s>"
    assert ModelConfig.from_dir(model).eos_token_ids == [tokenizer.eos_token_id]


def _vocabulary_file_tokenizers(tmp_path: Path) -> dict[str, Path]:
    """Tokenizers transformers builds from a vocabulary file alone (no tokenizer.json), each with
    its ``eos_token`` only in that file."""
    import sentencepiece

    text = ["hello world, the end of a turn", "a chat that ends its turn"] * 20
    made = {}
    sp = tmp_path / "sentencepiece"
    sp.mkdir()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(text), model_prefix=str(sp / "tokenizer"),
                                             vocab_size=25, user_defined_symbols=["<|im_end|>"],
                                             minloglevel=2)
    _write(sp, "tokenizer_config.json", {"tokenizer_class": "LlamaTokenizer", "eos_token": "<|im_end|>"})
    made["sentencepiece"] = sp
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      show_progress=False))
    gpt2 = tmp_path / "vocab_json"
    gpt2.mkdir()
    bpe.model.save(str(gpt2))
    _write(gpt2, "tokenizer_config.json", {"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>"})
    made["vocab.json"] = gpt2
    bert = tmp_path / "vocab_txt"
    bert.mkdir()
    (bert / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "hello", "world"]) + "\n")
    _write(bert, "tokenizer_config.json", {"tokenizer_class": "BertTokenizer", "eos_token": "[SEP]"})
    made["vocab.txt"] = bert
    return made


def test_the_eos_id_resolves_from_a_vocabulary_file_without_tokenizer_json(tmp_path: Path) -> None:
    # It resolved only from tokenizer.json and added_tokens_decoder: a ChatML eos_token kept in
    # tokenizer.model (or vocab.json, vocab.txt) was warned about and generation ran past it.
    for kind, directory in _vocabulary_file_tokenizers(tmp_path).items():
        expected = AutoTokenizer.from_pretrained(directory).eos_token_id
        assert isinstance(expected, int), kind
        assert tokenizer_eos_token_id(directory) == expected, kind
    assert tokenizer_eos_token_id(_write(tmp_path / "absent", "tokenizer_config.json", {"eos_token": "<x>"})) is None


def test_a_vocabulary_file_gives_the_eos_id_only_when_it_is_the_one_file_and_as_transformers_reads_it(
        tmp_path: Path) -> None:
    # A guessed id joins the end-of-sequence set: generation would stop at an ordinary token.
    made = _vocabulary_file_tokenizers(tmp_path)
    sp, gpt2, bert = made["sentencepiece"], made["vocab.json"], made["vocab.txt"]
    shutil.copy(sp / "tokenizer.model", sp / "a_draft.model")  # which one the class reads is its choice
    assert tokenizer_eos_token_id(sp) is None
    (sp / "a_draft.model").unlink()
    shutil.copy(gpt2 / "vocab.json", sp / "vocab.json")
    assert tokenizer_eos_token_id(sp) is None
    (bert / "vocab.txt").write_text("[PAD]\n[UNK]\n[SEP]\nhello\n[SEP]\nworld\n")
    assert tokenizer_eos_token_id(bert) == AutoTokenizer.from_pretrained(bert).eos_token_id == 4


def test_the_model_config_stops_at_the_tokenizer_eos_too(tmp_path: Path, tiny_llama_dir: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    im_end = AutoTokenizer.from_pretrained(model).convert_tokens_to_ids("<|im_end|>")
    config = json.loads((model / "config.json").read_text())
    eos = config["eos_token_id"]
    (model / "generation_config.json").unlink()
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    tokenizer_config["eos_token"] = "<|im_end|>"
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    special_map = model / "special_tokens_map.json"
    if special_map.exists():
        special_map.unlink()
    assert AutoTokenizer.from_pretrained(model).eos_token_id == im_end != eos
    assert ModelConfig.from_dir(model).eos_token_ids == [eos, im_end]


@pytest.mark.parametrize("content, named", [
    ("[1, 2]", "must hold a JSON object"), ('{"eos_token_id": "x"}', "eos_token_id must be a token id"),
    ("{not json", "not valid JSON"),
])
def test_the_model_config_refuses_a_generation_config_it_cannot_read(tmp_path: Path, tiny_llama_dir: Path,
                                                                     content: str, named: str) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    (model / "generation_config.json").write_text(content)
    with pytest.raises(ModelConfigError, match=named) as caught:
        ModelConfig.from_dir(model)
    assert "generation_config.json" in str(caught.value)


def test_eos_ids_outside_the_vocabulary_are_refused_naming_their_source(tiny_llama_dir: Path) -> None:
    config = ModelConfig.from_dir(tiny_llama_dir)
    args = argparse.Namespace(eos_id=[2, config.vocab_size])
    with pytest.raises(ValueError, match=rf"--eos_id names \[{config.vocab_size}\], outside the vocabulary"):
        resolve_eos_token_ids(args, config)
    assert resolve_eos_token_ids(argparse.Namespace(eos_id=[2, 2, 3]), config) == [2, 3]
    assert resolve_eos_token_ids(argparse.Namespace(eos_id=None), config) == config.eos_token_ids
    config.eos_token_ids.append(-1)
    with pytest.raises(ValueError, match="the checkpoint's eos_token_id"):
        resolve_eos_token_ids(argparse.Namespace(eos_id=None), config)
