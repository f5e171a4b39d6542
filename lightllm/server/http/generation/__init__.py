"""From a checked request to the request manager's generations, shared by the native and OpenAI endpoints.

``completion_prompt`` (the forms of a prompt: text, token ids, or a list of either),
``prompt_encoding`` (tokenizing off the event loop, after a character pre-check),
``special_tokens`` (``add_special_tokens`` on a rendered chat), ``planning`` (sampling parameters
under the client's field names, the context checks, one job per choice), ``fanout`` (the choices
run concurrently, and server-sent events) and ``client_presence`` (waiting on behalf of a client
that may leave).
"""
