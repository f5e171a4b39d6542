"""Helpers shared by the simulator tests: a small step-cost profile, a command line's one-line refusal."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, List

import pytest

from lightllm.benchmark.simulator.cost_model import PROFILE_DIR, CostProfile


def make_profile(**overrides: float) -> CostProfile:
    """A cheap test profile (prefill and decode costs of a small model), with ``overrides`` applied."""
    values = dict(
        name="test",
        prefill_fixed_s=0.001,
        prefill_per_token_s=1e-5,
        prefill_attention_s=1e-9,
        decode_fixed_s=0.002,
        decode_per_req_s=1e-5,
        decode_per_kv_token_s=1e-8,
        max_total_token_num=1 << 20,
    )
    values.update(overrides)
    return CostProfile(**values)


def assert_refused_in_one_line(main: Callable[[List[str]], int], argv: List[str], message: str, capsys) -> None:
    """``main(argv)`` exits with status 2 and a last stderr line that names ``message``, no traceback."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in err and "Traceback" not in err


def bundled_profile_with_kv(directory: Path, name: str, kv_tokens: int) -> str:
    """The bundled H100 profile's file with a KV cache of ``kv_tokens`` tokens, written under ``directory``."""
    profile = json.loads((PROFILE_DIR / "h100_qwen_0p8b.json").read_text())
    profile.update(name=name, max_total_token_num=kv_tokens)
    path = directory / f"{name}.json"
    path.write_text(json.dumps(profile))
    return str(path)
