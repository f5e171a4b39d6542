"""The PD deployment guide lists every PD flag of the parser and every PD environment variable."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightllm.server.launch.arg_parser import make_argument_parser
from lightllm.utils.envs_utils import ENV_VARS

ROOT = Path(__file__).resolve().parents[3]


def _pd_flags() -> list[str]:
    parser = make_argument_parser()
    (group,) = [g for g in parser._action_groups if g.title == "PD disaggregation"]
    return ["--run_mode"] + [action.option_strings[0] for action in group._group_actions]


@pytest.mark.parametrize("lang", ["EN", "CN"])
def test_guide_documents_every_pd_flag_and_variable(lang):
    text = (ROOT / "docs" / lang / "pd_deployment.md").read_text()
    assert [flag for flag in _pd_flags() if f"| `{flag}` |" not in text] == []
    pd_vars = [name for name in ENV_VARS if name.startswith("LIGHTLLM_PD_")]
    assert pd_vars and [name for name in pd_vars if f"| `{name}` |" not in text] == []


@pytest.mark.parametrize("lang", ["EN", "CN"])
def test_guide_names_the_script_and_the_run_modes(lang):
    text = (ROOT / "docs" / lang / "pd_deployment.md").read_text()
    assert "scripts/start_1p1d.sh" in text and (ROOT / "scripts" / "start_1p1d.sh").exists()
    for mode in ("pd_master", "prefill", "decode"):
        assert f"--run_mode {mode}" in text
