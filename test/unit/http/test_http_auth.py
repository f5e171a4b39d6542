"""API keys and the admission-priority rule on the real app (scripted request manager behind it)."""

from __future__ import annotations

import argparse

import pytest
from fastapi.testclient import TestClient

from api_fakes import MODEL, FakeManager, assert_error
from lightllm.server.argument_error import ArgumentError
from lightllm.server.launch.args_check import validate_args
from lightllm.server.launch.environment_check import unread_variable_warnings
from lightllm.server.launch.arg_parser import make_argument_parser
from lightllm.server.http.app import create_app
from lightllm.server.http.middleware.auth import KeySet, bearer_token
from lightllm.server.http.server_options import AuthPolicy, HttpServerOptions

USER, ADMIN = "user-key-1", "admin-key-1"


def _client(manager: FakeManager, key: str | None = None, **policy) -> TestClient:
    options = HttpServerOptions(auth=AuthPolicy(**policy))
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return TestClient(create_app(manager, options), headers=headers, raise_server_exceptions=False)


def test_key_set_matches_only_its_keys() -> None:
    keys = KeySet(["alpha", "beta"])
    assert keys.contains("alpha") and keys.contains("beta")
    assert not keys.contains("alph") and not keys.contains("alphaa") and not keys.contains(None)
    assert not KeySet([]) and not KeySet([]).contains("alpha")


@pytest.mark.parametrize(
    ("value", "token"),
    [("Bearer abc", "abc"), ("bearer  abc ", "abc"), ("Basic abc", None), ("Bearer", None), ("abc", None),
     # RFC 7235: the scheme is case-insensitive; a tab separates it as well as a space.
     ("BEARER abc", "abc"), ("bEaReR abc", "abc"), ("bearer\tabc", "abc"), (" Bearer \t abc", "abc"),
     ("Bearer  ", None), ("Bearerabc", None), ("Bearer abc def", "abc def"),
     # Only spaces and tabs separate, and only they are stripped: a no-break space, a Latin-1
     # "next line" or a control character read from the header bytes is part of a word.
     ("Bearer\xa0abc", None), ("Bearer\x85abc", None), ("Bearer\x1cabc", None), ("\xa0Bearer abc", None),
     ("Bearer abc\xa0", "abc\xa0"), ("Bearer \x1cabc", "\x1cabc")],
)
def test_bearer_token_parsing(value: str, token: str | None) -> None:
    assert bearer_token({"headers": [(b"authorization", value.encode("latin-1"))]}) == token


@pytest.mark.parametrize("path", ["/v1/models", "/metrics", "/openapi.json", f"/v1/models/{MODEL}"])
def test_every_endpoint_but_health_needs_a_key(manager: FakeManager, path: str) -> None:
    anonymous = _client(manager, api_keys=(USER,), admin_keys=(ADMIN,))
    missing = anonymous.get(path)
    assert_error(missing, 401, code="missing_api_key")
    assert missing.headers["www-authenticate"] == 'Bearer realm="lightllm"'
    wrong = _client(manager, "nope", api_keys=(USER,)).get(path)
    assert_error(wrong, 401, code="invalid_api_key")
    assert 'error="invalid_token"' in wrong.headers["www-authenticate"]
    assert _client(manager, USER, api_keys=(USER,)).get(path).status_code == 200
    assert _client(manager, ADMIN, api_keys=(USER,), admin_keys=(ADMIN,)).get(path).status_code == 200
    assert anonymous.get("/health").status_code == 200
    assert anonymous.head("/health").status_code == 200
    if path != "/openapi.json":  # a HEAD asks what a GET would answer, so it needs the key too
        assert anonymous.head(path).status_code == 401
        assert _client(manager, USER, api_keys=(USER,)).head(path).status_code == 200


def test_a_repeated_authorization_header_is_refused_whatever_the_order(manager: FakeManager) -> None:
    client = _client(manager, api_keys=(USER,))
    for first, second in ((USER, "nope"), ("nope", USER)):
        response = client.get("/v1/models", headers=[("authorization", f"Bearer {first}"),
                                                     ("authorization", f"Bearer {second}")])
        assert_error(response, 400, code="invalid_http_request")
        assert "'authorization' 2 times" in response.json()["error"]["message"]


def test_refused_requests_never_reach_the_manager(manager: FakeManager) -> None:
    response = _client(manager, api_keys=(USER,)).post("/generate", json={"inputs": "hi"})
    assert_error(response, 401, code="missing_api_key")
    assert manager.calls == []


def test_without_api_keys_any_bearer_token_is_accepted(manager: FakeManager) -> None:
    # OpenAI clients always send some key; an open server must not care which.
    response = _client(manager, "whatever").post("/generate", json={"inputs": "hi"})
    assert response.status_code == 200


@pytest.mark.parametrize("path", ["/generate", "/generate_stream"])
def test_priority_is_refused_to_untrusted_clients(manager: FakeManager, path: str) -> None:
    body = {"inputs": "hi", "high_priority_request": True}
    for client in (_client(manager), _client(manager, USER, api_keys=(USER,), admin_keys=(ADMIN,)),
                   _client(manager, "not-the-admin-key", admin_keys=(ADMIN,))):
        error = assert_error(client.post(path, json=body), 403, "high_priority_request", "priority_not_allowed")
        assert error["type"] == "permission_error" and "--admin_api_key" in error["message"]
    assert manager.calls == []
    # Asking for no priority is always fine.
    assert _client(manager).post(path, json={**body, "high_priority_request": False}).status_code == 200


def test_priority_from_admin_key_or_public_flag(manager: FakeManager) -> None:
    body = {"inputs": "hi", "high_priority_request": True}
    assert _client(manager, ADMIN, api_keys=(USER,), admin_keys=(ADMIN,)).post("/generate", json=body).status_code == 200
    assert _client(manager, ADMIN, admin_keys=(ADMIN,)).post("/generate", json=body).status_code == 200
    assert _client(manager, USER, api_keys=(USER,), allow_public_priority=True).post("/generate", json=body).status_code == 200
    assert _client(manager, allow_public_priority=True).post("/generate", json=body).status_code == 200
    assert [call.high_priority for call in manager.calls] == [True] * 4


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "Bearer\t", "bEARER "])
def test_the_auth_scheme_is_case_insensitive_for_every_kind_of_key(manager: FakeManager, scheme: str) -> None:
    def client(key: str, **policy: object) -> TestClient:
        options = HttpServerOptions(auth=AuthPolicy(**policy))
        return TestClient(create_app(manager, options), headers={"authorization": f"{scheme} {key}"},
                          raise_server_exceptions=False)

    assert client(USER, api_keys=(USER,)).get("/v1/models").status_code == 200
    assert client(ADMIN, api_keys=(USER,), admin_keys=(ADMIN,)).get("/v1/models").status_code == 200
    body = {"inputs": "hi", "high_priority_request": True}
    assert client(ADMIN, api_keys=(USER,), admin_keys=(ADMIN,)).post("/generate", json=body).status_code == 200
    assert manager.calls[-1].high_priority
    # The cluster key opens the cluster's paths (none is routed in this app: 404, not 401).
    assert client("cluster", api_keys=(USER,), cluster_key="cluster").get("/pd/nodes").status_code == 404
    assert_error(client("wrong", api_keys=(USER,)).get("/v1/models"), 401, code="invalid_api_key")


def test_the_front_door_reads_the_scheme_as_the_app_does() -> None:
    # The accept thread decides from the raw head whether a keyed client may pass a full server.
    from lightllm.server.http.transport.probe_parsing import head_headers

    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nauthorization: bearer the-key\r\n\r\n"
    assert bearer_token({"headers": head_headers(head)}) == "the-key"


def _parse(argv: list[str]) -> argparse.Namespace:
    return make_argument_parser().parse_args(["--model_dir", "m", *argv])


def test_keys_come_from_flags_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTLLM_API_KEY", " k1, k2 ,,")
    monkeypatch.setenv("LIGHTLLM_ADMIN_API_KEY", "a1")
    from_env = HttpServerOptions.from_args(_parse([]))
    assert from_env.auth.api_keys == ("k1", "k2") and from_env.auth.admin_keys == ("a1",)
    from_flags = HttpServerOptions.from_args(_parse(["--api_key", "x", "y", "--admin_api_key", "z"]))
    assert from_flags.auth.api_keys == ("x", "y") and from_flags.auth.admin_keys == ("z",)
    monkeypatch.delenv("LIGHTLLM_API_KEY")
    monkeypatch.delenv("LIGHTLLM_ADMIN_API_KEY")
    assert not HttpServerOptions.from_args(_parse([])).auth.requires_key


@pytest.mark.parametrize(
    "argv",
    [["--api_key", " padded "], ["--admin_api_key", ""], ["--api_key", "k\u0113y"], ["--admin_api_key", "a\nb"],
     ["--http_header_timeout", "0"],
     ["--http_body_timeout", "-1"], ["--max_request_body_bytes", "0"], ["--http_max_connections", "0"],
     ["--prompt_chars_per_token", "-2"], ["--http_keep_alive_timeout", "0"]],
)
def test_bad_http_flags_are_refused(argv: list[str]) -> None:
    with pytest.raises(ArgumentError, match=argv[0]) as err:
        validate_args(_parse(argv), cuda_device_count=0)
    if argv[0].endswith("api_key") and argv[1].strip() == argv[1] != "":
        assert argv[1] not in str(err.value) and "(the key): character 2 of the key is a" in str(err.value)


@pytest.mark.parametrize(("value", "position", "kind"), [("k\u0113y", 2, "character beyond Latin-1"),
                                                           ("ok,b\x7fd", 2, "control character")])
def test_a_key_no_client_can_send_is_refused_from_the_environment(monkeypatch: pytest.MonkeyPatch, value: str,
                                                                   position: int, kind: str) -> None:
    monkeypatch.setenv("LIGHTLLM_API_KEY", value)
    which = "key 2 of 2" if "," in value else "the key"
    with pytest.raises(ValueError, match=f"^LIGHTLLM_API_KEY \\({which}\\): character {position} of the key is a {kind}") as err:
        HttpServerOptions.from_args(_parse([]))
    assert value.split(",")[-1] not in str(err.value)


def test_keys_that_some_clients_can_send_are_taken_and_named_in_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    # A tab and a Latin-1 letter travel in a header (requests and curl send Latin-1 bytes), and
    # matched before: refusing them would stop servers that worked.  httpx cannot send the letter.
    monkeypatch.setenv("LIGHTLLM_API_KEY", "plain,k\u00e9y")
    options = HttpServerOptions.from_args(_parse(["--admin_api_key", "a\tb"]))
    assert options.auth.api_keys == ("plain", "k\u00e9y") and options.auth.admin_keys == ("a\tb",)
    assert options.auth.key_warnings() == [
        "LIGHTLLM_API_KEY (key 2 of 2) holds a character beyond ASCII: clients that encode headers as Latin-1 "
        "(Python's requests and http.client) can send it, but curl sends it as typed (UTF-8 from most terminals, "
        "which does not match) and httpx, so the openai package, cannot send it (value not shown)"]
    validate_args(_parse(["--api_key", "k\u00e9y", "a\tb"]), cuda_device_count=0)
    keys = KeySet(["k\u00e9y", "a\tb"])
    assert keys.contains(bearer_token({"headers": [(b"authorization", b"Bearer k\xe9y")]}))
    assert keys.contains(bearer_token({"headers": [(b"authorization", b"Bearer a\tb")]}))


def test_vllm_api_key_alone_stops_the_start_and_beside_a_key_is_only_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LIGHTLLM_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    # Ignored, the server would serve without authentication although the operator set a key.
    with pytest.raises(ValueError, match="^VLLM_API_KEY is set, but this server reads its API keys from --api_key") as err:
        HttpServerOptions.from_args(_parse([]))
    assert "from-vllm" not in str(err.value)
    assert unread_variable_warnings(_parse([])) == []  # the refusal says it
    assert HttpServerOptions.from_args(_parse(["--api_key", "ours"])).auth.api_keys == ("ours",)
    assert unread_variable_warnings(_parse(["--api_key", "ours"])) == [
        "VLLM_API_KEY is set but not read: the API keys are those of --api_key"]
    # A PD node serves no public API: the variable is only named there, with or without keys.
    for node in ("prefill", "decode"):
        assert not HttpServerOptions.from_args(_parse(["--run_mode", node])).auth.requires_key
        assert unread_variable_warnings(_parse(["--run_mode", node])) == [
            f"VLLM_API_KEY is set but not read: a PD {node} node serves no public API (its /pd/ paths take the "
            "cluster key)"]
    monkeypatch.setenv("LIGHTLLM_API_KEY", "ours")
    assert HttpServerOptions.from_args(_parse([])).auth.api_keys == ("ours",)
    assert unread_variable_warnings(_parse([])) == [
        "VLLM_API_KEY is set but not read: the API keys are those of LIGHTLLM_API_KEY"]
    monkeypatch.delenv("LIGHTLLM_API_KEY")
    monkeypatch.setenv("VLLM_API_KEY", "")  # empty: unset, as every reader treats it
    assert not HttpServerOptions.from_args(_parse([])).auth.requires_key
