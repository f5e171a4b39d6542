"""Prompt tokenization for the HTTP endpoints: a character pre-check, then the tokenizer off the event loop.

Tokenizing a 20 MB prompt takes seconds; done on the event loop it stalls every other client,
``/health`` included. :class:`PromptEncoder` therefore

1. refuses a prompt whose character count alone proves it cannot fit the context: no token of the
   tokenizer stands for more than ``chars_per_token`` characters, so a text longer than
   ``max_req_total_len * chars_per_token`` characters needs more tokens than a request may hold;
2. refuses a prompt a prefix of which already needs more tokens than the context holds, before
   tokenizing the rest (:mod:`lightllm.server.prompt_length_probe`): the character bound must
   allow the longest token, so ordinary text far too long for the context passes it;
3. runs the tokenizer and the chat template in a small pool of :data:`TOKENIZER_THREADS` daemon
   threads (:class:`DaemonWorkers`). The Rust tokenizer releases the GIL while it works, so the
   event loop keeps serving meanwhile; a second thread keeps one long prompt from delaying every
   other request's tokenization, and the pool stays small so prompts cannot take every core from
   the model.

The default ``chars_per_token`` is :data:`CHARS_PER_TOKEN_MARGIN` times the longest token text in
the vocabulary: the margin covers normalizers that merge characters before tokenizing (NFC turns
up to three code points of decomposed text into one). The bound assumes a tokenizer that keeps
every input character, as byte-level BPE and SentencePiece LLM tokenizers do; for a tokenizer that
drops text (e.g. collapses whitespace) set ``--prompt_chars_per_token`` or turn the check off with 0.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Dict, List, Optional, TypeVar

from lightllm.server.http.errors import APIError, INVALID_REQUEST
from lightllm.server.http.generation.special_tokens import SpecialTokenFrame, special_token_frame
from lightllm.server.http.generation.special_tokens import add_special_tokens as add_special_tokens_to
from lightllm.server.prompt_length_probe import PromptOverContextError, RenderedChatTooLongError
from lightllm.server.request_manager import RequestManager
from lightllm.utils.daemon_workers import DaemonWorkers

log = logging.getLogger(__name__)

T = TypeVar("T")

CHARS_PER_TOKEN_MARGIN = 4
TOKENIZER_THREADS = 2


# One pool per process: the HTTP server has one app, and tests build many.
_WORKERS = DaemonWorkers(TOKENIZER_THREADS, "lightllm-tokenize")


def longest_token_chars(tokenizer: Any) -> Optional[int]:
    """Characters of the longest token text in ``tokenizer``'s vocabulary (added tokens included), or None.

    The vocabulary's own spelling is never shorter than the text a token decodes to: byte-level BPE
    spells each byte as one character, SentencePiece spells a space as one character, and byte
    fallback tokens (``<0x41>``) are longer than the byte they stand for.
    """
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    try:
        vocab = get_vocab()
    except Exception:  # noqa: BLE001 - a tokenizer without a usable vocabulary just gets no pre-check
        log.warning("could not read the tokenizer's vocabulary", exc_info=True)
        return None
    return max((len(token) for token in vocab), default=None)


def text_chars(messages: List[dict]) -> int:
    """Characters of the message texts: each message's ``content``, a string or its text parts' ``text``.

    Only these, as docs/*/limits_and_auth.md says: roles, names, tool-call ids and part types are
    not text the client wrote as the prompt, and a template may render a role as one special token,
    so counting them could refuse a chat that fits.
    """
    total = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(part["text"]) for part in content
                         if isinstance(part, dict) and isinstance(part.get("text"), str))
    return total


class PromptEncoder:
    """Encodes prompts and chats for a request manager: pre-check on the loop, tokenizer in a worker thread.

    ``chars_per_token`` None derives the bound from the served model's tokenizer; 0 turns the pre-check off.
    """

    def __init__(self, manager: RequestManager, chars_per_token: Optional[float] = None) -> None:
        self._manager = manager
        if chars_per_token is None:
            longest = longest_token_chars(manager.served.tokenizer)
            if longest is None:
                log.warning("the tokenizer exposes no vocabulary: prompts are not length-checked before "
                            "tokenizing; set --prompt_chars_per_token to enable the check")
            chars_per_token = None if longest is None else float(CHARS_PER_TOKEN_MARGIN * longest)
        self.chars_per_token = chars_per_token or None
        limit = manager.served.max_req_total_len
        self.max_chars: Optional[int] = None if self.chars_per_token is None else int(limit * self.chars_per_token)
        self._frame: Optional[SpecialTokenFrame] = None
        self._frame_read = False

    def check_chars(self, chars: int, param: str, noun: str, counted: Optional[str] = None) -> None:
        """Raise 400 ``context_length_exceeded`` when ``chars`` characters cannot fit the context.

        ``counted``: what was counted, as the subject of "have" (default: "the ``noun`` has").
        """
        if self.max_chars is None or chars <= self.max_chars:
            return
        limit = self._manager.served.max_req_total_len
        counted = counted or f"the {noun} has"
        message = (
            f"This model's maximum context length is {limit} tokens, and {counted} {chars} characters: "
            f"more than {self.max_chars} characters ({limit} tokens at most {self.chars_per_token:g} characters "
            f"each) cannot fit. Please reduce the length of the {noun}."
        )
        raise APIError(400, message, INVALID_REQUEST, param, "context_length_exceeded")

    async def encode_prompt(self, text: str, param: str, keeps_end: bool = False, **options: Any) -> List[int]:
        """Token ids of a text prompt, refused with 400 naming ``param`` when it cannot fit the context.

        Refused from its characters (:meth:`check_chars`), or from a prefix's tokens before the
        whole prompt is tokenized (:mod:`lightllm.server.prompt_length_probe`), unless
        ``keeps_end``: the request keeps only the end of its prompt (``truncate_prompt_tokens``),
        so an over-long one is tokenized whole.  ``options`` (``add_special_tokens``) go to the
        served model's ``encode_prompt`` (``manager.served``) as given.
        """
        self.check_chars(len(text), param, "prompt")
        within = None if keeps_end else self._manager.served.max_req_total_len
        return await self._run(lambda: self._manager.served.encode_prompt(text, within=within, **options), param,
                               "prompt")

    async def encode_chat(self, messages: List[dict], param: str = "messages", add_special_tokens: bool = False,
                          keeps_end: bool = False, **template_options: Any) -> List[int]:
        """Token ids of a chat rendered by its template, refused like :meth:`encode_prompt`.

        ``template_options`` (``add_generation_prompt``, ``continue_final_message``,
        ``chat_template_kwargs``, ``implied_variables``, ``check_tools_read``) go to the served
        model's ``encode_chat`` as given.  It
        tokenizes the rendered text without the tokenizer's special tokens (the template writes
        them); ``add_special_tokens`` adds them as well, as vLLM's chat field of that name does.
        The character check counts the message texts (:func:`text_chars`); the prefix probe runs
        on the rendered chat, so a chat of many empty messages is refused from its template's text.
        With ``keeps_end`` (``/tokenize``, ``truncate_prompt_tokens``) the rendered chat may exceed
        the context but not the character bound, compared with the rendered text's characters
        before it is tokenized: a template can expand a short chat without limit (``{{ "x " *
        10000000 }}`` in a trusted request template was tokenized whole, 26 s and 4.5 GB), and
        200,000 empty messages rendered 5.6 M characters (the bound, passed as a token limit,
        let their 1.2 M tokens through: 14 s and 1.4 GB of the HTTP process).
        """
        self.check_chars(text_chars(messages), param, "messages", "the message texts have")
        limits: Dict[str, Any] = {"within": self._manager.served.max_req_total_len}
        if keeps_end:
            limits = {"within": None, **({"max_chars": self.max_chars} if self.max_chars is not None else {})}

        def encode() -> List[int]:
            ids = list(self._manager.served.encode_chat(messages, **limits, **template_options))
            if not add_special_tokens:
                return ids
            return add_special_tokens_to(self._special_token_frame(), ids, "add_special_tokens")

        return await self._run(encode, param, "messages")

    @staticmethod
    async def on_tokenizer_thread(job: Callable[[], T]) -> T:
        """``job()`` (another tokenizer call: decoding, token strings) run on the tokenizer threads.

        Such a call over a context's worth of ids takes milliseconds to tens of them: on the event
        loop it would delay every stream, and on a thread of its own it would compete with the
        prompts for the cores the pool is sized to leave to the model.
        """
        return await asyncio.wrap_future(_WORKERS.submit(job))

    async def special_token_frame(self) -> Optional[SpecialTokenFrame]:
        """The special tokens the tokenizer adds around a text (None when they depend on the text)."""
        return await asyncio.wrap_future(_WORKERS.submit(self._special_token_frame))

    def _special_token_frame(self) -> Optional[SpecialTokenFrame]:
        # Fixed for the tokenizer: read once (on a tokenizer thread), on the first request that needs it.
        if not self._frame_read:
            self._frame = special_token_frame(self._manager.served.tokenizer)
            self._frame_read = True
        return self._frame

    @staticmethod
    async def _run(encode: Callable[[], Any], param: str, noun: str) -> List[int]:
        """``encode()`` on a tokenizer thread; a limit it reaches is a 400 naming ``param``."""
        try:
            return await asyncio.wrap_future(_WORKERS.submit(lambda: list(encode())))
        except PromptOverContextError as exc:
            message = (f"This model's maximum context length is {exc.limit} tokens, and the {noun} cannot fit: "
                       f"its first {exc.prefix_chars} characters alone are {exc.prefix_tokens} tokens. "
                       f"Please reduce the length of the {noun}.")
        except RenderedChatTooLongError as exc:
            message = (f"The {noun} as the chat template renders them are {exc.chars} characters, longer than the "
                       f"{exc.limit} characters a prompt may have here (--prompt_chars_per_token). Please reduce the "
                       f"length of the {noun}.")
        raise APIError(400, message, INVALID_REQUEST, param, "context_length_exceeded") from None
