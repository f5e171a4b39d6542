"""Test support for logprob ``bytes`` and ``text_offset``: small real tokenizers of each kind and a
request manager that generates scripted token ids with their text from the real detokenizer.

The tokenizers are built here from the Hugging Face ``tokenizers`` library (nothing downloaded):
byte-fallback as Llama 2 / Mistral have it (``▁`` word marks, ``<0xNN>`` byte tokens; marked by the
normalizer, or by a ``Metaspace`` pre-tokenizer as transformers 5 loads Llama's), metaspace without
byte tokens, and BERT-style WordPiece.  The byte-level BPE one is the suite's ``tokenizer`` fixture (conftest.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, AsyncIterator

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from api_fakes import FakeEvent, FakeManager, FakeServed, GenerateCall
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.detokenization.incremental_decoder import request_decoder

CORPUS = ["the quick brown fox jumps over the lazy dog ok hello world"] * 20
SPECIALS = ["<unk>", "<s>", "</s>"]


def byte_fallback_tokenizer(directory: Path) -> Any:
    """A SentencePiece-style BPE tokenizer: word-start marks, characters outside the vocabulary as
    ``<0xNN>`` byte tokens, BOS added, and Llama 2's decoder (which strips the space of the first mark)."""
    marks = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    return _byte_fallback_bpe(directory, normalizer=marks)


def sentencepiece_tokenizer(directory: Path) -> Any:
    """A Llama-style byte-fallback tokenizer as transformers 5 loads Llama's: the word marks come from
    a ``Metaspace`` pre-tokenizer (not the normalizer), ``<0xNN>`` byte tokens, BOS added, and the
    decoder that strips the space of a first mark (``▁hello`` alone decodes to ``hello``)."""
    return _byte_fallback_bpe(directory, pre_tokenizer=pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first"))


def _byte_fallback_bpe(directory: Path, normalizer: Any = None, pre_tokenizer: Any = None) -> Any:
    """A BPE trained on CORPUS with ``<0xNN>`` byte tokens, its word marks made by ``normalizer`` or
    ``pre_tokenizer`` (the two ways Llama-style tokenizer files spell them)."""
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, limit_alphabet=60, show_progress=False)
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    if normalizer is not None:
        trained.normalizer = normalizer
    if pre_tokenizer is not None:
        trained.pre_tokenizer = pre_tokenizer
    trained.train_from_iterator(CORPUS, trainer)
    learned = trained.get_vocab()
    vocab = {token: index for index, token in enumerate(SPECIALS + [f"<0x{b:02X}>" for b in range(256)])}
    for token in sorted(learned, key=learned.get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(merge) for merge in json.loads(trained.to_str())["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    if normalizer is not None:
        tok.normalizer = trained.normalizer
    if pre_tokenizer is not None:
        tok.pre_tokenizer = trained.pre_tokenizer
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    return _saved(tok, directory)


def wordpiece_tokenizer(directory: Path) -> Any:
    """A BERT-style tokenizer: lowercasing normalizer, a pre-tokenizer that drops whitespace, WordPiece
    pieces (``##`` continues a word: a word outside the vocabulary is ``l ##e ##a ...``), ``[CLS]`` first."""
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=200, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A", special_tokens=[("[CLS]", 2)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="[CLS]", eos_token="[SEP]", unk_token="[UNK]",
                                   pad_token="[PAD]")
    fast.save_pretrained(directory)
    return AutoTokenizer.from_pretrained(str(directory))


def metaspace_tokenizer(directory: Path) -> Any:
    """A metaspace BPE tokenizer without byte tokens (``▁`` marks; characters it knows whole)."""
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS + ["語 😀 字 你好 🎉"] * 5, trainer)
    return _saved(tok, directory)


def _saved(tok: Tokenizer, directory: Path) -> Any:
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(directory)
    return AutoTokenizer.from_pretrained(str(directory))


class ScriptedTextServed(FakeServed):
    """The served model of :class:`ScriptedTextManager`: a real tokenizer, chats as their contents joined."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.max_req_total_len = 512
        self.eos_token_ids = [tokenizer.eos_token_id]

    def encode_prompt(self, text: str, add_special_tokens: bool = True, within: int | None = None) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def encode_chat(self, messages: list[dict[str, Any]], within: int | None = None,
                    **template_options: Any) -> list[int]:
        return self.encode_prompt(" ".join(message["content"] for message in messages))


class ScriptedTextManager(FakeManager):
    """A request manager on a real tokenizer: every generation yields the token ids of ``script``
    (then EOS when ``end_with_eos``), each with the text the real detokenizer releases for it.

    Every token carries top logprobs: itself first, then the tokens of ``alternatives``; the first one
    carries the prompt's logprobs (each prompt token alone) when the request asks for them.
    """

    def __init__(self, tokenizer: Any, script: list[int], alternatives: list[int] = (),
                 end_with_eos: bool = False) -> None:
        super().__init__(ScriptedTextServed(tokenizer))
        self.script = list(script) + ([tokenizer.eos_token_id] if end_with_eos else [])
        self.alternatives = list(alternatives)

    async def generate(self, spec: RequestSpec, *, request: Any = None) -> AsyncIterator[FakeEvent]:
        prompt_ids, params = list(spec.prompt_ids), spec.params
        self.calls.append(GenerateCall(prompt_ids, params, spec.priority.high_priority_request, request, spec))
        decoder = request_decoder(self.served.tokenizer, prompt_ids, params, self.served.eos_token_ids)
        ids = self.script[:params.max_new_tokens]
        for position, token_id in enumerate(ids):
            text = decoder.add(token_id)
            last = position == len(ids) - 1 or decoder.stopped
            if last and not decoder.stopped:
                text += decoder.flush()  # as the detokenizer adds held text to a finishing token
            top = None
            if params.logprobs:
                top = {alt: -1.0 - rank for rank, alt in enumerate(self.alternatives[:params.logprobs - 1])}
                top[token_id] = -0.5
            finish = ("stop" if decoder.stopped or token_id in self.served.eos_token_ids else "length") if last else None
            event = FakeEvent(len(self.calls), token_id, text, -0.5, finish, len(prompt_ids), 0, position + 1, top,
                              decoder.stop_reason if last else None)
            if position == 0 and params.prompt_logprobs is not None:
                # Prompt positions 1.. as the request manager gives them: (id, logprob, top, rank).
                event.prompt_logprobs = [(prompt_id, -0.5, {prompt_id: -0.5}, 1) for prompt_id in prompt_ids[1:]]
            yield event
            if last:
                return
