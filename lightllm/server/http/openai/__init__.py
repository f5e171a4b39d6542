"""The OpenAI-compatible endpoints: ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``.

* Request models: ``openai_models`` (the fields both endpoints share, and the completions request),
  ``chat_completion_request``, ``chat_message`` (one entry of ``messages``), ``openai_fields``
  (OpenAI platform fields and vLLM extras), ``vllm_text_fields``, ``request_id_header``.
* The chat template's view of a chat: ``chat_content_format``, ``developer_role``.
* Routes: ``openai_routes``; ``grammar_thread`` (the one thread structured-output checks run on,
  which the native endpoints use too; it sits here because it also checks the grammars of
  :mod:`.tool_calls`).
* Response shapes: ``response_shaper`` (the shaper interface), ``openai_shapes``, ``logprob_formatter``, ``token_ids``,
  ``token_bytes``, ``token_strings``, ``text_offsets``, ``answer_size`` (when a whole answer is built off the loop).
* :mod:`.tool_calls`: tool calling on chat completions.
"""
