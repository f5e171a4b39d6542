"""``add_special_tokens: true`` on chat adds exactly what the tokenizer adds to a text.

:func:`~lightllm.server.http.generation.special_tokens.special_token_frame` reads the ids a tokenizer puts around
a text; applied to a rendered chat tokenized without them it must give what vLLM gets by tokenizing
the rendered text with ``add_special_tokens=True``.  Checked on trained fast tokenizers with the
post-processors checkpoints use (Llama's BOS template, BERT's, RoBERTa's, none) and on the demo
checkpoint's tokenizer with its chat template.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from lightllm.server.http.errors import APIError
from lightllm.server.http.generation.special_tokens import SpecialTokenFrame, add_special_tokens, special_token_frame
from lightllm.utils.demo_model import generate_demo_model

TEXTS = ["", "a", "the quick brown fox", "<s> inside </s> the text", "<s>", "  spaces\n\nand lines  ", "你好世界 ünï"]


def _trained(post_processor: Any | None) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>", "[CLS]", "[SEP]"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([f"the quick brown fox {i} jumps" for i in range(50)], trainer)
    if post_processor is not None:
        tok.post_processor = post_processor(tok)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


POST_PROCESSORS = {
    "llama_bos": lambda tok: processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]),
    "bos_eos": lambda tok: processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", tok.token_to_id("<s>")), ("</s>", tok.token_to_id("</s>"))]),
    "bert": lambda tok: processors.BertProcessing(("[SEP]", tok.token_to_id("[SEP]")), ("[CLS]", tok.token_to_id("[CLS]"))),
    "roberta": lambda tok: processors.RobertaProcessing(("</s>", tok.token_to_id("</s>")), ("<s>", tok.token_to_id("<s>"))),
    "sequence": lambda tok: processors.Sequence([processors.ByteLevel(trim_offsets=False), processors.TemplateProcessing(
        single="[CLS] $A", special_tokens=[("[CLS]", tok.token_to_id("[CLS]"))])]),
    "none": None,
}


@pytest.mark.parametrize("kind", POST_PROCESSORS)
def test_frame_equals_tokenizing_with_special_tokens(kind: str) -> None:
    tokenizer = _trained(POST_PROCESSORS[kind])
    frame = special_token_frame(tokenizer)
    assert frame is not None
    for text in TEXTS:
        plain = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert frame.apply(plain) == tokenizer(text, add_special_tokens=True)["input_ids"], (kind, text)
    if kind == "none":
        assert frame == SpecialTokenFrame((), ())


@pytest.fixture(scope="module")
def demo_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path: Path = generate_demo_model(tmp_path_factory.mktemp("demo"), arch="llama", size="tiny", seed=0)
    return AutoTokenizer.from_pretrained(str(path))


def test_demo_chat_gets_a_second_bos_as_in_vllm(demo_tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "<s>Hi"}]
    text = demo_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    rendered = demo_tokenizer(text, add_special_tokens=False)["input_ids"]
    frame = special_token_frame(demo_tokenizer)
    assert frame == SpecialTokenFrame((demo_tokenizer.bos_token_id,), ())
    # vLLM: tokenize the rendered text with add_special_tokens=True (its template already wrote <s>).
    assert add_special_tokens(frame, rendered, "add_special_tokens") == \
        demo_tokenizer(text, add_special_tokens=True)["input_ids"]
    assert rendered[0] == demo_tokenizer.bos_token_id


class TextDependentTokenizer:
    """A tokenizer whose added tokens depend on the text (no fixed frame)."""

    def __call__(self, text: str, add_special_tokens: bool = True, verbose: bool = True) -> dict[str, list[int]]:
        ids = [ord(char) for char in text]
        return {"input_ids": ids + [len(ids)] * add_special_tokens}


def test_no_frame_means_a_400_naming_the_field() -> None:
    frame = special_token_frame(TextDependentTokenizer())
    assert frame is None
    with pytest.raises(APIError) as caught:
        add_special_tokens(frame, [5, 6], "add_special_tokens")
    assert caught.value.status_code == 400 and caught.value.param == "add_special_tokens"
