"""Structured output: a request's constraint turned into an llguidance grammar, checked before admission.

``response_format`` (OpenAI's ``response_format``), ``structured_params`` and
``structured_options`` (vLLM's ``structured_outputs`` and ``guided_*`` parameters), ``lark_json``
(the JSON schemas inside a Lark grammar), and the rules a JSON schema is held to:
``schema_positions`` (where a schema holds other schemas), ``closed_objects`` (objects take no
undeclared keys), ``number_bounds`` and ``schema_cost`` (what the compiler would not keep or takes
too long to build), ``guidance_options`` (a schema's own ``x-guidance``).

The thread these checks run on is :mod:`lightllm.server.http.openai.grammar_thread`, beside the tool
calls whose grammars it also checks; the model rank applies the grammars
(:mod:`lightllm.server.model_rank.execution.structured_output`).
"""
