"""``TRITON_INTERPRET`` is read by one rule (lightllm/utils/triton_interpret.py): the launcher's refusal of
``--attention_backend triton`` on CPU and the rank's kernel launchers agree, and both agree with triton."""

from __future__ import annotations

import pytest

from lightllm.common.basemodel.attention.selection import attention_device_problem
from lightllm.common.basemodel.triton_kernel.launch_utils import interpreting
from lightllm.utils.triton_interpret import triton_interpret_requested, true_values

# What triton's getenv_bool takes as true (any case, nothing stripped) and what it does not.
TRUE = ["1", "true", "TRUE", "True", "on", "ON", "yes", "y", "Y", "tRuE"]
FALSE = ["0", "", "false", "off", "no", "2", "t", " 1", "1 ", " true"]


@pytest.mark.parametrize("value, expected", [(v, True) for v in TRUE] + [(v, False) for v in FALSE])
def test_every_reader_takes_the_same_spellings(monkeypatch, value: str, expected: bool) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert triton_interpret_requested() is expected
    assert interpreting() is expected
    # The launcher lets triton on CPU through exactly when the rank's kernels will interpret.
    assert (attention_device_problem("triton", "cpu") is None) is expected
    assert triton_interpret_requested({"TRITON_INTERPRET": value}) is expected


def test_unset_is_false(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not triton_interpret_requested() and not interpreting()


@pytest.mark.parametrize("value", TRUE + FALSE)
def test_the_rule_is_the_installed_triton_s(monkeypatch, value: str) -> None:
    triton = pytest.importorskip("triton")
    knobs = getattr(triton, "knobs", None)
    if knobs is None:
        pytest.skip("triton before 3.4 has no knobs (it compared the variable to '1')")
    monkeypatch.setenv("TRITON_INTERPRET", value)
    # Read on every access (test_triton_backend.py relies on the same).
    assert bool(knobs.runtime.interpret) is triton_interpret_requested()


@pytest.mark.parametrize("version, value, expected", [
    ("3.1.0", "1", True), ("3.3.1", "1", True), ("3.2.0", "true", False), ("3.3.1", "yes", False),
    ("3.4.0", "true", True), ("3.9.0", "Y", True), ("4.0.0", "on", True), (None, "true", True),
])
def test_a_triton_before_3_4_reads_only_1(version, value: str, expected: bool) -> None:
    """Triton 3.1-3.3 (requirements-gpu.txt allows them) compared the variable to "1": there ``true``
    must not count, or the launcher would let a CPU server through to kernels that compile."""
    assert (value.lower() in true_values(version)) is expected
