"""Prefill/decode (PD) disaggregation as a plug-in of the server.

* ``protocol/`` -- the contract between master and nodes (registration record, stream lines, events);
* ``master/`` -- the ``pd_master`` process: membership, placement, one request's segments;
* ``node/`` -- what a prefill or decode node adds to a normal server: the control API, metrics,
  registration with the master, KV transfer ports;
* ``kv_transfer/`` -- the KV transport between a prefill and a decode rank.
"""
