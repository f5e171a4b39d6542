"""Tool calling on ``/v1/chat/completions`` (OpenAI function tools, as vLLM serves them).

* :mod:`.request`: the ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` fields and tool-call
  history in messages, checked, and the :class:`~.request.ToolPlan` of a request;
* :mod:`.parsers`: the output formats of ``--tool_call_parser`` (``hermes``, ``llama3_json``);
* :mod:`.json_scan`: reading a call object incrementally (name, raw arguments text);
* :mod:`.extraction`: calls of a whole text (non-streaming responses);
* :mod:`.streaming`: the ``tool_calls`` deltas of a stream;
* :mod:`.shaper`: the chat choices that carry them.
"""
