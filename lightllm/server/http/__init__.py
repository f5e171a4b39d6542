"""The public HTTP surface of one server process: the native and OpenAI-compatible APIs, and vLLM's
tokenizer and service endpoints (``tokenize_routes``, ``service_routes``).

Request bodies are parsed and checked here (``body``, ``planning``, the ``openai_*``, ``tokenize_models``
and ``native_models`` schemas), then handed to a :class:`~lightllm.server.request_manager.RequestManager`
(the normal server's ``httpserver`` manager or the PD master's). The connection side lives here
too: the h11 protocol with its limits (``protocol``, ``server_options``), the front door that
answers probes and caps connections (``front_door``, ``head_triage``, ``connection_book``, ``health``), and API keys
(``auth``). Nothing in this package loads torch.
"""
