"""LIGHTLLM_API_KEY / LIGHTLLM_ADMIN_API_KEY without a key and LIGHTLLM_TORCH_THREADS beyond its bound are refused."""

from __future__ import annotations

import os

import pytest

from lightllm.server.http.server_options import AuthPolicy
from lightllm.utils.envs_utils import api_keys_from_env, max_torch_threads, torch_threads_override

from server_args_support import server_args

KEY_VARS = ("LIGHTLLM_API_KEY", "LIGHTLLM_ADMIN_API_KEY")


@pytest.mark.parametrize("name", KEY_VARS)
@pytest.mark.parametrize("value", [",", " ", ",,", " , ", "\t"])
def test_a_value_holding_no_key_is_refused_naming_the_variable(monkeypatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as info:
        api_keys_from_env(name)
    message = str(info.value)
    assert message.startswith(f"{name} holds no key: ") and "must be non-empty" in message
    assert "\n" not in message and "value not shown" in message


def test_keys_are_read_and_unset_or_empty_means_none(monkeypatch) -> None:
    monkeypatch.setenv("LIGHTLLM_API_KEY", " k1 ,, k2,")  # a key is there: empty entries are dropped
    assert api_keys_from_env("LIGHTLLM_API_KEY") == ["k1", "k2"]
    monkeypatch.setenv("LIGHTLLM_API_KEY", "")
    assert api_keys_from_env("LIGHTLLM_API_KEY") == []
    monkeypatch.delenv("LIGHTLLM_API_KEY")
    assert api_keys_from_env("LIGHTLLM_API_KEY") == []


@pytest.mark.parametrize("name", KEY_VARS)
def test_the_auth_policy_refuses_the_value_at_start(monkeypatch, name: str) -> None:
    monkeypatch.setenv(name, ",")
    args = server_args(api_key=None, admin_api_key=None, allow_public_priority=False, run_mode="normal")
    with pytest.raises(ValueError, match=f"^{name} holds no key"):
        AuthPolicy.from_args(args)
    # A flag given replaces its variable, which is then not read.
    given = server_args(api_key=["k"], admin_api_key=["a"], allow_public_priority=False, run_mode="normal")
    assert AuthPolicy.from_args(given).requires_key


@pytest.mark.parametrize("name", ["LIGHTLLM_TORCH_THREADS", "LIGHTLLM_PREFILL_TORCH_THREADS"])
def test_thread_counts_are_bounded_by_the_cpu_count(monkeypatch, name: str) -> None:
    bound = max_torch_threads()
    assert bound == 4 * (os.cpu_count() or 1)
    monkeypatch.setenv(name, str(bound))
    assert torch_threads_override(name) == bound
    for value in ("99999", str(bound + 1)):
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError) as info:
            torch_threads_override(name)
        assert str(info.value).startswith(f"{name} must be an integer from 1 to {bound} (")
        assert str(info.value).endswith(f"got '{value}'")
    monkeypatch.setenv(name, "0")
    with pytest.raises(ValueError, match=f"^{name} must be an integer from 1 to {bound}"):
        torch_threads_override(name)
