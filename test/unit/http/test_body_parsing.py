"""Request-body decoding: UTF-8 only, field names for very deep nesting, and large bodies off the event loop.

Unit tests of :mod:`lightllm.server.http.validation.body` (the endpoints' answers to the same bodies are in
test_api_validation.py).
"""

from __future__ import annotations

import asyncio
import codecs
import json
import threading
import time
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict

from lightllm.server.http.validation import body as body_module
from lightllm.server.http.validation.body import (
    MAX_JSON_DEPTH,
    OFF_LOOP_BODY_BYTES,
    check_json_structure,
    deep_field,
    parse_body,
    parse_body_off_loop,
)
from lightllm.server.http.errors import APIError


class Prompt(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: Any = None
    x: Any = None


GOOD = {"prompt": "h\u00e9llo \U0001F600"}


def _error(raw: bytes) -> APIError:
    with pytest.raises(APIError) as caught:
        parse_body(raw, Prompt)
    assert caught.value.status_code == 400
    return caught.value


# ---------------------------------------------------------------- encodings


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"])
def test_utf16_and_utf32_bodies_are_refused(encoding: str) -> None:
    error = _error(json.dumps(GOOD).encode(encoding))
    assert "UTF-8" in error.message and "UTF-16 or UTF-32" in error.message


def test_invalid_utf8_is_refused_naming_the_byte() -> None:
    error = _error(b'{"prompt": "caf\xe9"}')  # latin-1
    assert "UTF-8" in error.message and "offset 15" in error.message


def test_utf8_with_and_without_a_byte_order_mark_is_accepted() -> None:
    text = json.dumps(GOOD, ensure_ascii=False).encode("utf-8")
    assert parse_body(text, Prompt).prompt == GOOD["prompt"]
    assert parse_body(codecs.BOM_UTF8 + text, Prompt).prompt == GOOD["prompt"]


def test_a_utf8_encoded_surrogate_is_not_valid_utf8() -> None:
    # CESU-style bytes for U+D800: refused while decoding, so no escape check can miss them.
    assert "UTF-8" in _error(b'{"prompt": "\xed\xa0\x80"}').message


# ---------------------------------------------------------------- nesting beyond json.loads


@pytest.mark.parametrize("depth", [2_000, 100_000])
def test_nesting_too_deep_for_the_json_reader_names_the_field(depth: int) -> None:
    raw = '{"prompt": "[[{ not brackets", "x": ' + "[" * depth + "]" * depth + "}"
    error = _error(raw.encode())
    assert error.param == "x" and f"more than {MAX_JSON_DEPTH} levels" in error.message


def test_deep_field_reads_keys_past_strings_and_escapes() -> None:
    deep = "[" * 40 + "]" * 40
    assert deep_field('{"a": {"b": "x\\"]}"}, "k\\"ey": ' + deep + "}") == 'k"ey'
    assert deep_field('{"a": [[1]], "b" : {"c": ' + deep + "}}") == "b"
    assert deep_field('{"a": [[1]]}') is None
    assert deep_field("[" * 100) is None  # no top-level object, no field


# ---------------------------------------------------------------- the structure walk


def test_paths_are_spelled_out_for_errors_only() -> None:
    data = {"prompt": [[1, 2], [3, {"v": float("inf")}]], "x": 1}
    with pytest.raises(APIError) as caught:
        check_json_structure(data)
    assert caught.value.param == "prompt.1.1.v"
    ids = [7] * 3 + ["a\ud800"]
    with pytest.raises(APIError) as caught:
        check_json_structure({"prompt": [ids]})
    assert caught.value.param == "prompt.0.3"
    with pytest.raises(APIError) as caught:
        check_json_structure({"prompt": [[]] * 3 + [{"\udfff": 1}]})
    assert caught.value.param == "prompt.3" and "object key" in caught.value.message


def test_a_million_token_ids_are_checked_quickly() -> None:
    # The walk used to build a path tuple per element: seconds for a body under the 8 MiB limit.
    data = {"prompt": [1] * 2_000_000}
    started = time.perf_counter()
    check_json_structure(data)
    assert time.perf_counter() - started < 1.0


# ---------------------------------------------------------------- off the event loop


def test_large_bodies_are_parsed_on_a_worker_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[threading.Thread] = []
    real = body_module.parse_body

    def recording(raw: bytes, model_cls: type) -> Any:
        threads.append(threading.current_thread())
        return real(raw, model_cls)

    monkeypatch.setattr(body_module, "parse_body", recording)
    small = json.dumps({"prompt": [1] * 10}).encode()
    large = json.dumps({"prompt": [1] * OFF_LOOP_BODY_BYTES}).encode()

    async def both() -> tuple[Prompt, Prompt]:
        return await parse_body_off_loop(small, Prompt), await parse_body_off_loop(large, Prompt)

    parsed_small, parsed_large = asyncio.run(both())
    assert len(parsed_large.prompt) == OFF_LOOP_BODY_BYTES and len(parsed_small.prompt) == 10
    assert threads[0] is threading.main_thread() and threads[1] is not threading.main_thread()


def test_errors_of_a_large_body_reach_the_caller() -> None:
    raw = b'{"prompt": [' + b"1," * OFF_LOOP_BODY_BYTES + b'1e999]}'
    with pytest.raises(APIError) as caught:
        asyncio.run(parse_body_off_loop(raw, Prompt))
    assert caught.value.param == f"prompt.{OFF_LOOP_BODY_BYTES}"


def test_the_event_loop_keeps_running_while_a_large_body_is_parsed() -> None:
    # About the default 8 MiB body limit of token ids: seconds of work that used to freeze the loop.
    raw = b'{"prompt": [' + b",".join([b"1"] * (4 << 20)) + b"]}"

    async def measure() -> tuple[float, float]:
        gaps: list[float] = []
        done = asyncio.Event()

        async def tick() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.002)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = asyncio.ensure_future(tick())
        started = time.perf_counter()
        await parse_body_off_loop(raw, Prompt)
        elapsed = time.perf_counter() - started
        done.set()
        await ticker
        return max(gaps), elapsed

    longest_gap, elapsed = asyncio.run(measure())
    # What remains is json.loads and pydantic, C code holding the GIL (~0.1-0.2 s here).
    assert longest_gap < 1.0, (longest_gap, elapsed)
