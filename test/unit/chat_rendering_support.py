"""A fake manager that renders chats for real: a real tokenizer and the server's encode_chat_messages."""

from __future__ import annotations

from typing import Any

from api_fakes import FakeManager, FakeServed
from lightllm.server.served_model import encode_chat_messages


class RenderingServed(FakeServed):
    """The fake served model, rendering chats with a real tokenizer and the server's encode_chat_messages."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__()
        self.chat_tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.max_req_total_len = 512

    def encode_chat(self, messages: list[dict[str, Any]], within: int | None = None,
                    **template_options: Any) -> list[int]:
        return encode_chat_messages(self.chat_tokenizer, messages, within=within, **template_options)


class RenderingManager(FakeManager):
    """The fake manager serving a :class:`RenderingServed` over ``tokenizer``."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(RenderingServed(tokenizer))
