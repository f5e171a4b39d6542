"""The scheduling core: plain Python, no torch, driven by injected dependencies.

One step of a rank is :class:`~.step_engine.StepEngine`'s phases (filter, classify, order, select
under budget, allocate, forward, post-process) over the live requests of its base,
:class:`~.request_membership.RequestMembership` (joining, pausing, leaving); the model and the KV
cache are reached only through the :class:`~.model_executor.ModelExecutor` and
:class:`~.kv_view.KvView` protocols, so the server's ranks and the scheduling simulator run this
same code. A test imports every module here with torch blocked.
"""
