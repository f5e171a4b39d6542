"""Byte-level BPE tokenizer for the demo checkpoint, trained locally in well under a second.

The tokenizer behaves like a Llama tokenizer where it matters to a server: encoding adds
``<s>`` at the start, decoding is lossless for any UTF-8 text, and a ChatML-style chat
template marks turns with ``<|im_start|>`` / ``<|im_end|>``.  The template itself emits
``<s>``, so a rendered chat prompt must be encoded with ``add_special_tokens=False``
(which is what ``apply_chat_template(..., tokenize=True)`` does) to get exactly one BOS.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from lightllm.utils.demo_corpus import load_corpus
from lightllm.utils.demo_json import write_json

# 256 byte symbols plus the special tokens must fit, with room left for real merges.
MIN_VOCAB_SIZE = 300
MAX_VOCAB_SIZE = 65536

# Word split before byte-level BPE: contractions, letter runs with one leading non-letter,
# single digits, punctuation runs, newlines and other whitespace.
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class DemoSpecialTokens:
    """Special token strings; their position in :meth:`ordered` is their token id."""

    pad: str = "<pad>"
    bos: str = "<s>"
    eos: str = "</s>"
    im_start: str = "<|im_start|>"
    im_end: str = "<|im_end|>"

    def ordered(self) -> List[str]:
        """All special tokens in id order (pad=0, bos=1, eos=2, im_start=3, im_end=4)."""
        return [self.pad, self.bos, self.eos, self.im_start, self.im_end]

    def id_of(self, token: str) -> int:
        """Token id of one of the special token strings."""
        return self.ordered().index(token)

    @property
    def pad_id(self) -> int:
        """Token id of the padding token."""
        return self.id_of(self.pad)

    @property
    def bos_id(self) -> int:
        """Token id of the beginning-of-sequence token."""
        return self.id_of(self.bos)

    @property
    def eos_id(self) -> int:
        """Token id of the end-of-sequence token."""
        return self.id_of(self.eos)

    @property
    def im_end_id(self) -> int:
        """Token id of ``<|im_end|>``, which ends a chat turn."""
        return self.id_of(self.im_end)


SPECIAL_TOKENS = DemoSpecialTokens()


def build_chat_template(special: DemoSpecialTokens = SPECIAL_TOKENS) -> str:
    """Jinja chat template: BOS, then one ChatML block per message, with Qwen2-style tool calling.

    ``content`` may be a string, a list of OpenAI-style parts (only ``text`` parts are
    rendered) or null (rendered empty).  With ``tools`` a system block lists them as JSON and
    asks for calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the format
    of ``--tool_call_parser hermes``); an assistant message's ``tool_calls`` are rendered that
    way, and ``tool`` messages as ``<tool_response>`` blocks of a user turn.  Any other role
    raises, so a caller passing an unsupported role learns it instead of getting a silently
    wrong prompt.
    """
    start, end = special.im_start, special.im_end
    tools_intro = (
        "You can call these functions. Each one is described by a JSON object inside <tools></tools>:\\n<tools>"
    )
    tools_outro = (
        "\\n</tools>\\n\\nTo call a function, answer with a JSON object holding its name and arguments "
        "inside tool_call tags:\\n<tool_call>\\n{\"name\": <function name>, \"arguments\": <JSON object>}\\n</tool_call>"
    )
    return (
        "{{- bos_token }}"
        "{%- if tools %}"
        "{{- '" + start + "system\\n' }}"
        "{%- if messages and messages[0]['role'] == 'system' and messages[0]['content'] is string %}"
        "{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
        "{{- '" + tools_intro + "' }}"
        "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
        "{{- '" + tools_outro + end + "\\n' }}"
        "{%- endif %}"
        "{%- for message in messages %}"
        "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
        "{{- raise_exception('demo chat template supports roles system, user, assistant and tool, got ' + message['role']|string) }}"
        "{%- endif %}"
        "{%- if tools and loop.first and message['role'] == 'system' and message['content'] is string %}"
        "{%- elif message['role'] == 'tool' %}"
        "{%- if loop.first or loop.previtem['role'] != 'tool' %}{{- '" + start + "user' }}{%- endif %}"
        "{{- '\\n<tool_response>\\n' }}{{- message['content'] }}{{- '\\n</tool_response>' }}"
        "{%- if loop.last or loop.nextitem['role'] != 'tool' %}{{- '" + end + "\\n' }}{%- endif %}"
        "{%- else %}"
        "{{- '" + start + "' + message['role'] + '\\n' }}"
        "{%- if message['content'] is string %}{{- message['content'] }}"
        "{%- elif message['content'] is iterable %}"
        "{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}{%- endfor %}"
        "{%- endif %}"
        "{%- if message['role'] == 'assistant' and message['tool_calls'] %}"
        "{%- for call in message['tool_calls'] %}"
        "{%- if (loop.first and message['content']) or not loop.first %}{{- '\\n' }}{%- endif %}"
        "{{- '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
        "{{- call['function']['arguments'] | tojson }}{{- '}\\n</tool_call>' }}"
        "{%- endfor %}"
        "{%- endif %}"
        "{{- '" + end + "\\n' }}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '" + start + "assistant\\n' }}{%- endif %}"
    )


def train_demo_tokenizer(
    vocab_size: int,
    texts: Optional[Sequence[str]] = None,
    special: DemoSpecialTokens = SPECIAL_TOKENS,
) -> Tokenizer:
    """Train a byte-level BPE tokenizer that prepends BOS when encoding.

    Args:
        vocab_size: total vocabulary size including byte symbols and special tokens.
        texts: training text; defaults to the standard-library corpus.
        special: special token strings (ids follow :meth:`DemoSpecialTokens.ordered`).

    Raises:
        ValueError: if ``vocab_size`` is out of range or the corpus is too small to
            reach it.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise ValueError(f"vocab_size must be an int, got {vocab_size!r}")
    if not MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be in [{MIN_VOCAB_SIZE}, {MAX_VOCAB_SIZE}], got {vocab_size}")
    corpus = load_corpus() if texts is None else list(texts)

    tokenizer = Tokenizer(models.BPE())
    # The same normaliser and pre-tokenizer transformers 5 rebuilds for model_type qwen2
    # (it ignores tokenizer.json's pipeline there), so every loader splits text alike.
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special.ordered(),
        # Every byte gets a symbol so no input ever needs an unknown token.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(
            f"corpus too small: BPE training reached {tokenizer.get_vocab_size()} tokens, vocab_size={vocab_size} requested"
        )
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{special.bos} $A",
        pair=f"{special.bos} $A {special.bos} $B",
        special_tokens=[(special.bos, special.bos_id)],
    )
    return tokenizer


def tokenizer_config(model_max_length: int, special: DemoSpecialTokens = SPECIAL_TOKENS) -> Dict[str, object]:
    """Contents of ``tokenizer_config.json``, readable by transformers 4.x and 5.x."""
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "additional_special_tokens": [special.im_start, special.im_end],
        "bos_token": special.bos,
        "chat_template": build_chat_template(special),
        "clean_up_tokenization_spaces": False,
        "eos_token": special.eos,
        "model_max_length": model_max_length,
        "pad_token": special.pad,
        # The generic fast-tokenizer class loads tokenizer.json verbatim; a model-specific
        # class (LlamaTokenizer) would rebuild its own SentencePiece-style pipeline.
        "tokenizer_class": "PreTrainedTokenizerFast",
        # Byte-level BPE never needs an unknown token; an explicit null also stops
        # transformers' Qwen2Tokenizer from appending its default <|endoftext|>.
        "unk_token": None,
    }


def special_tokens_map(special: DemoSpecialTokens = SPECIAL_TOKENS) -> Dict[str, object]:
    """Contents of ``special_tokens_map.json``."""
    return {
        "additional_special_tokens": [special.im_start, special.im_end],
        "bos_token": special.bos,
        "eos_token": special.eos,
        "pad_token": special.pad,
    }


def write_tokenizer_files(
    out_dir: Path,
    tokenizer: Tokenizer,
    model_max_length: int,
    special: DemoSpecialTokens = SPECIAL_TOKENS,
) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``."""
    out = Path(out_dir)
    (out / "tokenizer.json").write_bytes((tokenizer.to_str(pretty=True) + "\n").encode("utf-8"))
    write_json(out / "tokenizer_config.json", tokenizer_config(model_max_length, special))
    write_json(out / "special_tokens_map.json", special_tokens_map(special))
