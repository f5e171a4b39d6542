"""Prefill/decode (PD) disaggregation: the pieces that run on PD prefill and decode nodes."""
