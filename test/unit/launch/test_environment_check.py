"""The start-up environment check: every LIGHTLLM_* variable set where nothing reads it is named."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from lightllm.server.launch import environment_check
from lightllm.server.launch.arg_parser import make_argument_parser
from lightllm.server.launch.environment_check import (
    ENV_VAR_READERS,
    SCRIPT_ENV_VARS,
    check_environment_values,
    cpu_only_variable_warnings,
    unread_variable_warnings,
)
from lightllm.utils.envs_utils import ENV_VARS, REPLACED_ENV_VARS
from lightllm.utils.free_ports import free_port

REPO = Path(__file__).resolve().parents[3]


def _args(*flags: str) -> argparse.Namespace:
    return make_argument_parser().parse_args(["--model_dir", "/nonexistent", *flags])


def test_every_variable_has_readers_and_every_name_in_the_code_is_listed() -> None:
    assert set(ENV_VAR_READERS) == set(ENV_VARS)
    names = set()
    for path in (REPO / "lightllm").rglob("*.py"):
        names.update(re.findall(r"\bLIGHTLLM_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    # A variable the code reads but the table misses would be warned about as unknown.
    # (LightLLM's names, FOREIGN_ENV_HINTS, appear in the code only to name the flag that replaces them.)
    known = set(ENV_VARS) | set(REPLACED_ENV_VARS) | set(SCRIPT_ENV_VARS) | set(getattr(environment_check, "FOREIGN_ENV_HINTS", {}))
    assert names <= known, names - set(ENV_VARS)
    for name in SCRIPT_ENV_VARS:
        assert name in (REPO / SCRIPT_ENV_VARS[name]).read_text()


def test_nothing_set_nothing_said() -> None:
    assert unread_variable_warnings(_args(), environ={"PATH": "/bin", "LIGHTLLM_TORCH_THREADS": ""}) == []


def test_a_misspelt_name_is_named_with_the_closest_known_one() -> None:
    [line] = unread_variable_warnings(_args(), environ={"LIGHTLLM_TORCH_THREAD": "2"})
    assert line.startswith("LIGHTLLM_TORCH_THREAD is set but no LIGHTLLM_* variable of that name is read")
    assert "did you mean LIGHTLLM_TORCH_THREADS?" in line
    [line] = unread_variable_warnings(_args(), environ={"LIGHTLLM_XYZZY": "1"})
    assert "did you mean" not in line


def test_lightllm_s_log_level_variable_names_the_flag() -> None:
    # It got only the generic "no LIGHTLLM_* variable of that name is read" line.
    [line] = unread_variable_warnings(_args(), environ={"LIGHTLLM_LOG_LEVEL": "debug"})
    assert line == ("LIGHTLLM_LOG_LEVEL is set but only LightLLM reads it, not this server: use --log_level "
                    "(debug, info, warning, error)")


def test_a_variable_of_another_role_is_named_with_its_readers() -> None:
    environ = {"LIGHTLLM_TORCH_THREADS": "2", "LIGHTLLM_PD_NODE_BUSY_RETRY_TIMEOUT_SECONDS": "5",
               "LIGHTLLM_PD_CLUSTER_KEY": "secret"}
    master = unread_variable_warnings(_args("--run_mode", "pd_master"), environ=environ)
    assert master == ["LIGHTLLM_TORCH_THREADS is set but a pd_master process does not read it "
                      "(read by: normal, prefill, decode); it has no effect here"]
    normal = unread_variable_warnings(_args(), environ=environ)
    assert [line.split(" ")[0] for line in normal] == ["LIGHTLLM_PD_CLUSTER_KEY",
                                                        "LIGHTLLM_PD_NODE_BUSY_RETRY_TIMEOUT_SECONDS"]
    assert all("a normal process does not read it" in line for line in normal)


def test_a_variable_a_given_flag_replaces_is_named() -> None:
    environ = {"LIGHTLLM_API_KEY": "k1", "LIGHTLLM_ADMIN_API_KEY": "a1"}
    assert unread_variable_warnings(_args(), environ=environ) == []
    assert unread_variable_warnings(_args("--api_key", "k2"), environ=environ) == [
        "LIGHTLLM_API_KEY is set but --api_key was given, which is used instead"]


def test_replaced_and_script_variables_are_left_to_their_own_handling() -> None:
    environ = {name: "1" for name in [*REPLACED_ENV_VARS, *SCRIPT_ENV_VARS]}
    assert unread_variable_warnings(_args(), environ=environ) == []


def test_uvicorn_s_forwarded_allow_ips_is_named_as_not_read() -> None:
    # The server never trusts X-Forwarded-For (proxy_headers off): the variable would be silently ignored.
    for mode in ("normal", "pd_master"):
        [line] = unread_variable_warnings(_args("--run_mode", mode), environ={"FORWARDED_ALLOW_IPS": "*"})
        assert line.startswith("FORWARDED_ALLOW_IPS is set but not read: this server never trusts X-Forwarded-For")


def test_cpu_thread_variables_are_named_on_cuda_only() -> None:
    environ = {"LIGHTLLM_TORCH_THREADS": "2", "LIGHTLLM_IDLE_MALLOC_TRIM": "5"}
    assert cpu_only_variable_warnings("normal", "cpu", environ) == []
    assert cpu_only_variable_warnings("normal", "cuda", environ) == [
        "LIGHTLLM_TORCH_THREADS is set but the model ranks run on cuda, where it is not read (CPU ranks only)"]
    assert cpu_only_variable_warnings("pd_master", "cuda", environ) == []


@pytest.mark.parametrize(("name", "value"), [("LIGHTLLM_IDLE_MALLOC_TRIM", "-1"), ("LIGHTLLM_STEP_TRACE", "/nonexistent/x.csv"),
                                             ("LIGHTLLM_API_KEY", ","), ("LIGHTLLM_LONG_DECODE_POSITIONS", "64")])
def test_bad_values_of_what_a_normal_server_reads_are_refused(monkeypatch: pytest.MonkeyPatch, name: str,
                                                               value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"^{name}"):
        check_environment_values("normal")


def test_a_variable_a_former_release_read_is_refused_naming_its_replacement(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTLLM_LONG_DECODE_POSITIONS", "1000")
    for run_mode in ("normal", "prefill", "decode", "pd_master"):
        with pytest.raises(ValueError, match="^LIGHTLLM_LONG_DECODE_POSITIONS is no longer read; use "
                                             "LIGHTLLM_WIDE_FORWARD_MS_PER_TOKEN"):
            check_environment_values(run_mode)


def test_a_bad_value_of_a_variable_the_role_does_not_read_is_not_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTLLM_IDLE_MALLOC_TRIM", "-1")  # the master runs no model rank
    check_environment_values("pd_master")


def _launch_master(env: Dict[str, str]) -> List[str]:
    clean = {key: value for key, value in os.environ.items() if not key.startswith("LIGHTLLM_")}
    # --model_dir does not exist: the master refuses it after the environment check, so the
    # warnings are visible without serving anything.
    proc = subprocess.run(
        [sys.executable, "-m", "lightllm.server.api_server", "--run_mode", "pd_master", "--model_dir",
         "/nonexistent/model", "--port", str(free_port())],
        capture_output=True, text=True, timeout=120, env={**clean, **env},
    )
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]


def test_a_started_server_logs_each_unread_variable_once() -> None:
    lines = _launch_master({"LIGHTLLM_TORCH_THREADS": "2", "LIGHTLLM_TORCH_THREAD": "2"})
    warned = [line for line in lines if "is set but" in line]
    assert len(warned) == 2, lines
    assert "LIGHTLLM_TORCH_THREAD is set but no LIGHTLLM_* variable" in warned[0]
    assert "LIGHTLLM_TORCH_THREADS is set but a pd_master process does not read it" in warned[1]
