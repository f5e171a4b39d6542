"""The model rank process: one per tensor-parallel rank, the only process that holds torch tensors.

* ``scheduling/`` -- the pure step engine, planner, strategies and request lifecycle (no torch;
  the scheduling simulator runs this same code);
* ``execution/`` -- the torch side: the model executor, forward threads, row sampling;
* ``kv_cache/`` -- KV slots and the radix prefix cache behind the scheduling core's ``KvView``;
* ``rank_process`` -- the process loop (``ModelRank``): read commands, hand them to the
  backend's hooks, step, publish (``step_publisher``);
* ``rank_assembly`` -- the composition root (``build_model_rank``) and the process's entry point;
* ``pd_transfer/`` -- the KV hand-off of a PD node's rank (a prefill and a decode side), carried by
  its backend as its intake; ``pd_backend_settings`` builds the side of the node's role.
"""
