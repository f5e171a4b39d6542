"""A PD node rank's side of the KV transfer, carried by the rank's mode backend as its intake.

* ``base`` -- :class:`~.base.PdRankTransfer`: what both sides share (one handle per pair,
  intake bookkeeping, polling, notices, aborts);
* ``outcomes`` -- :class:`~.outcomes.TransferOutcome` and the rule by which the TP ranks agree
  on one;
* ``prefill`` -- :class:`~.prefill.PrefillRankTransfer`: serves the pairs' store and sends
  each handed-off request's KV after its step;
* ``decode`` -- :class:`~.decode.DecodeRankTransfer`: reserves KV (or answers busy) and
  receives each request's prompt KV, then admits it with its first token.

The rank picks the side of its node's role once, where it builds its backend settings
(``model_rank/pd_backend_settings.py``).
"""
