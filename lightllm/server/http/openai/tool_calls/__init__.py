"""Tool calling on ``/v1/chat/completions`` (OpenAI function tools, as vLLM serves them).

* :mod:`.request`: the ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` fields and tool-call
  history in messages, checked, and the :class:`~.request.ToolPlan` of a request;
* :mod:`.parsers`: the output formats of ``--tool_call_parser`` (``hermes``, ``llama3_json``): content
  and complete call blocks of a growing text;
* :mod:`.json_scan`: reading a call object (name, raw arguments text);
* :mod:`.extraction`: content and calls of a text, decided by one reader for streams and whole responses;
* :mod:`.streaming`: the ``tool_calls`` deltas of a stream (the same answer as the whole response);
* :mod:`.shaper`: the chat choices that carry them.
"""
