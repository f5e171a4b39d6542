"""Decoding and checking a request body, before any endpoint reads it.

``body`` (UTF-8 JSON, structural limits, then the endpoint's pydantic model), ``base_models`` (the
strict base every request schema shares, and helpers for declaring its fields),
``validation_errors`` (what a pydantic error tells the client) and ``json_text`` (JSON sent inside
a string field, read under the body's rules).

The error bodies themselves are :mod:`lightllm.server.http.errors`; the endpoints' schemas are with
their endpoints (:mod:`lightllm.server.http.openai`, :mod:`lightllm.server.http.tokenize`,
:mod:`lightllm.server.http.native_models`).
"""
