"""The wildcard spellings of ``--host``: how each is bound and how a local client reaches it."""

from __future__ import annotations

import pytest

from lightllm.utils.wildcard_hosts import bind_host, is_wildcard, loopback_for


@pytest.mark.parametrize("host, bound, local", [
    ("", "0.0.0.0", "127.0.0.1"),
    ("0.0.0.0", "0.0.0.0", "127.0.0.1"),
    ("::", "::", "::1"),
    ("[::]", "::", "::1"),
    # Other spellings of the unspecified addresses: once advertised by a PD node as its address.
    ("::0", "::", "::1"),
    ("0::", "::", "::1"),
    ("0:0:0:0:0:0:0:0", "::", "::1"),
    ("[0:0::0]", "::", "::1"),
    ("127.0.0.2", "127.0.0.2", "127.0.0.2"),
    ("::1", "::1", "::1"),
    ("::ffff:0.0.0.0", "::ffff:0.0.0.0", "::ffff:0.0.0.0"),
    ("node-a.example", "node-a.example", "node-a.example"),
])
def test_each_host_is_bound_and_reached_as_its_family_wants(host, bound, local):
    assert is_wildcard(host) is (bound in ("0.0.0.0", "::"))
    assert bind_host(host) == bound and loopback_for(host) == local
