"""vLLM's ``POST /tokenize`` and ``POST /detokenize``, and LightLLM's ``/tokens``: the served model's tokenizer over HTTP.

``tokenize_models`` (the request schemas, a chat checked as ``/v1/chat/completions`` checks it) and
``tokenize_routes`` (the endpoints, which encode a prompt as the generation endpoints do).
"""
