"""A profile whose numbers would make the simulator print nan or write invalid JSON is refused.

An outside pass set ``"prefill_per_token_s": 1e300`` (finite, so it passed the check): the
simulator printed nan and wrote JSON with NaN and Infinity, which no JSON reader takes.  A
``"description": 7`` was accepted too.
"""

from __future__ import annotations

import json
import math

import pytest
from simulator_test_support import assert_refused_in_one_line, make_profile

from lightllm.benchmark.output_writing import strict_json
from lightllm.benchmark.simulator import __main__ as simulator_cli
from lightllm.benchmark.simulator.cost_model import PROFILE_DIR

_CELL = ["--scenario", "long_first", "--modes", "normal", "--budget", "1024", "--strategies", "default"]


def _profile_file(tmp_path, **changes) -> str:
    data = json.loads((PROFILE_DIR / "h100_qwen_0p8b.json").read_text())
    coefficients = {k: changes.pop(k) for k in list(changes) if k in data["coefficients"]}
    data["coefficients"].update(coefficients)
    data.update(changes)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("changes, message", [
    ({"prefill_per_token_s": 1e300}, "prefill_per_token_s must be at most 3600 s, got 1e+300"),
    ({"decode_fixed_s": 1e200}, "decode_fixed_s must be at most 3600 s"),
    ({"description": 7}, "description must be a string, got 7"),
    ({"max_total_token_num": 10**200}, "max_total_token_num must be within [1, 1099511627776]"),
])
def test_a_profile_that_cannot_be_simulated_is_refused_naming_it(tmp_path, changes, message, monkeypatch, capsys):
    monkeypatch.setattr(simulator_cli, "run_matrix", lambda *a, **k: pytest.fail("simulated a bad profile"))
    path = _profile_file(tmp_path, **changes)
    for argv in ([*_CELL], ["--soak-hours", "0.01"]):
        assert_refused_in_one_line(simulator_cli.main, ["--profile", path, *argv], f"profile {path!r}: {message}",
                                   capsys)


def test_the_largest_coefficients_allowed_still_give_finite_times():
    profile = make_profile(prefill_per_token_s=3600.0, prefill_attention_s=3600.0, max_total_token_num=1 << 40)
    step = profile.prefill_seconds([(1 << 40, 1 << 40)])
    assert math.isfinite(step) and math.isfinite(step * step * 1e6)  # a sum of squares over a million requests


def test_json_outputs_refuse_nan_and_infinity():
    with pytest.raises(ValueError, match="NaN or infinity"):
        strict_json({"ttft": float("nan")})
    with pytest.raises(ValueError, match="NaN or infinity"):
        strict_json([float("inf")])
    assert json.loads(strict_json({"ttft": 1.5})) == {"ttft": 1.5}
