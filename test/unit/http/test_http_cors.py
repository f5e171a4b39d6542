"""CORS: browser clients of the API, as vLLM and LightLLM serve them by default (--allowed_origins)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from api_fakes import MODEL, FakeManager
from lightllm.server.argument_error import ArgumentError
from lightllm.server.http.app import create_app
from lightllm.server.http.server_options import AuthPolicy, HttpServerOptions
from lightllm.server.launch.arg_parser import make_argument_parser
from lightllm.server.launch.args_check import validate_args

PAGE = "https://app.example.com"
PREFLIGHT = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}
BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


def _client(manager: FakeManager, origins: tuple[str, ...], **policy) -> TestClient:
    options = HttpServerOptions(auth=AuthPolicy(**policy), allowed_origins=origins)
    return TestClient(create_app(manager, options), raise_server_exceptions=False)


def test_any_origin_by_default_preflight_without_a_key_and_headers_on_refusals(manager: FakeManager) -> None:
    assert HttpServerOptions.from_args(make_argument_parser().parse_args(["--model_dir", "m"])).allowed_origins == ("*",)
    client = _client(manager, ("*",), api_keys=frozenset({"k"}))
    preflight = client.options("/v1/completions", headers=PREFLIGHT)
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    refused = client.post("/v1/completions", json=BODY, headers={"Origin": PAGE})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"
    served = client.post("/v1/completions", json=BODY, headers={"Origin": PAGE, "Authorization": "Bearer k"})
    assert served.status_code == 200 and served.headers["access-control-allow-origin"] == "*"


def test_listed_origins_only_and_none_at_all(manager: FakeManager) -> None:
    listed = _client(manager, (PAGE,))
    assert listed.options("/v1/completions", headers=PREFLIGHT).headers["access-control-allow-origin"] == PAGE
    other = listed.options("/v1/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    # In the API's error shape, like every other refusal (Starlette answers in plain text).
    assert other.json()["error"]["code"] == "cors_preflight_refused"
    assert "the origin is not in --allowed_origins" in other.json()["error"]["message"]
    off = _client(manager, ())
    assert off.options("/v1/completions", headers=PREFLIGHT).status_code == 405
    assert "access-control-allow-origin" not in off.post("/v1/completions", json=BODY, headers={"Origin": PAGE}).headers


@pytest.mark.parametrize(("values", "message"), [
    (["*", PAGE], "'\\*' already allows every origin"),
    (["https://app.example.com/"], "is not an origin"),
    (["app.example.com"], "is not an origin"),
])
def test_bad_origins_are_refused_at_start(values: list[str], message: str) -> None:
    args = make_argument_parser().parse_args(["--model_dir", "m", "--allowed_origins", *values])
    with pytest.raises(ArgumentError, match=f"--allowed_origins: .*{message}"):
        validate_args(args)


def test_a_pd_node_refuses_the_flag_the_master_serves() -> None:
    args = make_argument_parser().parse_args(["--model_dir", "m", "--run_mode", "prefill", "--allowed_origins", PAGE])
    with pytest.raises(ArgumentError, match="--allowed_origins configures the public API"):
        validate_args(args)


def test_the_pd_master_takes_the_flag_and_a_node_sends_no_cors_headers() -> None:
    from lightllm.server.launch.pd_master import check_master_flags

    master = make_argument_parser().parse_args(["--model_dir", "m", "--run_mode", "pd_master", "--allowed_origins", PAGE])
    validate_args(master)
    check_master_flags(master)  # the master serves the public API: the flag is its own
    assert HttpServerOptions.from_args(master).allowed_origins == (PAGE,)
    node = make_argument_parser().parse_args(["--model_dir", "m", "--run_mode", "decode"])
    assert HttpServerOptions.from_args(node).allowed_origins == ()  # its endpoints serve the master alone
