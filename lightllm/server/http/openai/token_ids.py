"""vLLM's ``return_token_ids``: the prompt's and each choice's token ids beside the text.

:class:`TokenIdShaper` wraps the shaper of an OpenAI endpoint (completions, chat, chat with tool
calls) and adds the ids to what that shaper builds, so the text, logprobs and tool-call logic stay
where they are.  Where the fields go follows vLLM 0.32's response models:

* ``token_ids`` is on every choice (whole responses) and on every streamed choice, holding the
  tokens that chunk adds: concatenated over a stream they equal the whole response's list.
* ``prompt_token_ids`` is on each choice for completions (each prompt of a batch has its own) and
  at the top level for chat (one prompt per request).  A stream sends it once per choice: on the
  choice's first chunk (completions, ``null`` on its later ones as in vLLM) or at the top level of its role chunk (chat).

The ids are those generated, as the model rank sampled them: the tokens whose text a stop string
trimmed (or held back while a stop string could still begin) are included, and so is the stop
token or EOS that ended the choice, whose text is left out; ``usage.completion_tokens`` counts the
same tokens.  Echoed prompt tokens are not among ``token_ids`` (they are ``prompt_token_ids``), and
with completions' ``echo`` and ``max_tokens: 0`` the token generated to finish the prefill is
dropped from both the text and ``token_ids``.
"""

from __future__ import annotations

from typing import Any

from lightllm.server.http.openai.response_shaper import ResponseShaper


class TokenIdShaper:
    """A :class:`ResponseShaper` that adds ``token_ids`` and ``prompt_token_ids`` to another's output.

    The wrapped shaper must be built with ``every_token=True``, so that a token whose text is
    still held back (a partial UTF-8 character, a possible stop string) gets a chunk to carry its
    id rather than being skipped.
    """

    def __init__(self, inner: ResponseShaper, prompts: list[list[int]], n: int, *, prompt_in_choice: bool) -> None:
        """``prompts``: the token ids each prompt ran with (after truncation), by prompt index; choice
        ``i`` belongs to prompt ``i // n``.  ``prompt_in_choice``: completions' placement of
        ``prompt_token_ids`` (on the choice), else chat's (top level)."""
        self._inner = inner
        self._prompts = prompts
        self._n = n
        self._prompt_in_choice = prompt_in_choice
        # Choices whose prompt ids a stream already carried (vLLM sends them once per choice).
        self._prompt_sent: set[int] = set()
        self.id_prefix = inner.id_prefix
        self.object_name = inner.object_name
        self.chunk_object_name = inner.chunk_object_name
        self.counts_completion = inner.counts_completion

    def _prompt_ids(self, index: int) -> list[int]:
        return self._prompts[index // self._n]

    def _generated(self, events: list[Any]) -> list[int]:
        """The output token ids of ``events``: none when the output is dropped (echo, ``max_tokens`` 0);
        finish markers (negative ids) carry no token."""
        if not self.counts_completion:
            return []
        return [event.token_id for event in events if event.token_id >= 0]

    def opening_choices(self, indices: list[int]) -> list[dict[str, Any]]:
        """The wrapped shaper's (chat's role and echo chunks carry no generated token)."""
        return self._inner.opening_choices(indices)

    def stream_choices(self, index: int, event: Any) -> list[dict[str, Any]]:
        """The wrapped shaper's chunks for ``event``; the first carries its token, any later one
        (a tool-call answer's separate finish chunk) an empty list."""
        choices = self._inner.stream_choices(index, event)
        for position, choice in enumerate(choices):
            if self._prompt_in_choice:
                # vLLM sends the key on every completions chunk: null after the choice's first.
                choice["prompt_token_ids"] = None if index in self._prompt_sent else self._prompt_ids(index)
                self._prompt_sent.add(index)
            choice["token_ids"] = self._generated([event]) if position == 0 else []
        return choices

    def final_choice(self, index: int, events: list[Any]) -> dict[str, Any]:
        """The wrapped shaper's whole choice with its ids."""
        choice = self._inner.final_choice(index, events)
        if self._prompt_in_choice:
            choice["prompt_token_ids"] = self._prompt_ids(index)
        choice["token_ids"] = self._generated(events)
        return choice

    def response_extras(self, collected: dict[int, list[Any]]) -> dict[str, Any]:
        """The wrapped shaper's top-level fields, with chat's ``prompt_token_ids``."""
        extras = self._inner.response_extras(collected)
        if self._prompt_in_choice:
            return extras
        return {**extras, "prompt_token_ids": self._prompts[0]}

    def chunk_fields(self, choice: dict[str, Any]) -> dict[str, Any]:
        """The wrapped shaper's chunk fields, with chat's ``prompt_token_ids`` on each choice's first chunk."""
        fields = self._inner.chunk_fields(choice)
        index = choice["index"]
        if not self._prompt_in_choice and index not in self._prompt_sent:
            fields = {**fields, "prompt_token_ids": self._prompt_ids(index)}
            self._prompt_sent.add(index)
        return fields
