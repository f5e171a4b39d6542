"""The public HTTP surface of one server process: the native and OpenAI-compatible APIs, and vLLM's
tokenizer and service endpoints.

Request bodies are parsed and checked here, then handed to a
:class:`~lightllm.server.request_manager.RequestManager` (the normal server's ``httpserver`` manager
or the PD master's). Nothing in this package loads torch. Its rooms, from the top floor down (no
room imports one above it; ``test/unit/project/test_import_structure.py`` keeps them on floors):

* ``app``: the FastAPI application and the native ``/generate`` endpoints, wiring every layer and
  route below.
* :mod:`.tokenize`: vLLM's ``/tokenize`` and ``/detokenize``, and LightLLM's ``/tokens``.
* ``native_sampling``: a native body's ``parameters`` as checked sampling parameters (``/generate``
  and ``/tokens``); ``native_models``: the native endpoints' request schemas.
* :mod:`.openai`: the OpenAI-compatible endpoints: request models, routes, response shapes, tool
  calls, and the grammar thread the structured-output checks run on.
* :mod:`.transport`: the connection side under the app: the listening sockets, the front door that
  answers probes and caps connections, and uvicorn's h11 protocol with its limits.
* ``openapi``: request bodies, error responses and streams in the OpenAPI document.
* :mod:`.middleware`: the ASGI layers between uvicorn and the routes (API keys, CORS, request
  shape, per-client share, drain).
* :mod:`.structured`: structured output: JSON schemas, Lark grammars and vLLM's structured-output
  parameters turned into checked llguidance grammars.
* :mod:`.generation`: from a checked request to the manager's generations, shared by the native and
  OpenAI endpoints: the prompt and its encoding, sampling parameters and choice jobs, the fan-out.
* :mod:`.validation`: decoding a request body and the strict base every request schema shares.
* :mod:`.service`: the health probes and vLLM's ``/version`` and ``/ping``.
* ``errors`` (the error body of every failing response) and ``retry_after``, ``server_options``
  (the HTTP limits and keys read from the flags) and ``log_throttle``: what every room shares.
"""
