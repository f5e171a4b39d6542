"""The connection side of the HTTP server, under the ASGI app: sockets, the front door, the h11 protocol.

* Start-up and the port: ``listen_sockets`` (the sockets bound before anything loads, and the
  server's exit codes), ``uvicorn_config`` (the uvicorn config of the public port).
* The front door, one thread that accepts every connection before the event loop sees it:
  ``front_door`` (the thread and its selector), ``head_triage`` (what a connection meets, from the
  bytes of its head), ``probe_parsing`` and ``head_check`` (reading a head as the loop would),
  ``connection_book`` (the connection caps' ledger), ``lingering_sockets`` (answered sockets read
  until their client closes), ``accept_pause`` (out of file descriptors), ``fatal_thread`` (the
  thread's death is reported).
* uvicorn's HTTP/1.1 protocol with the guards a public endpoint needs: ``protocol``,
  ``head_limited_connection`` (the head size limit), ``guarded_transport`` (writes to a lost
  connection), ``send_deadline`` (a client that reads nothing).

What a request meets once uvicorn has parsed it is in :mod:`lightllm.server.http.middleware`.
"""
