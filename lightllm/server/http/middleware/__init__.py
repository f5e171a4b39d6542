"""The ASGI layers :func:`~lightllm.server.http.app.create_app` stacks between uvicorn and the routes.

``absolute_form`` (a request target in absolute form routed by its path), ``auth`` (API keys and
the admission-priority rule), ``cors`` (the one CORS policy, also used by the front door),
``client_share`` (a per-client limit on requests being prepared), ``request_guard`` (a request's
method, content type, headers and body limits), ``unread_body`` (an answer before the body was read
closes the connection) and ``in_flight`` (requests taken but not yet handed to the manager, for the
drain and the admission gate).

The layers under them, before uvicorn parses a request, are in :mod:`lightllm.server.http.transport`.
"""
