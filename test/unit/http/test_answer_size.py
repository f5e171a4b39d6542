"""Large whole answers are built on a worker thread (the event loop serves every other connection);
the answer is the same either way."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from api_fakes import FakeManager, completion
from lightllm.common.sampling import SamplingParams
from lightllm.server.http.openai import answer_size
from lightllm.server.http.openai.answer_size import OFF_LOOP_ENTRIES, answer_entries, large_answer
from lightllm.server.http.generation.fanout import ChoiceJob


def _job(prompt_len: int, logprobs: int | None = None, prompt_logprobs: int | None = None) -> ChoiceJob:
    params = SamplingParams(max_new_tokens=4, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    return ChoiceJob(0, 0, list(range(prompt_len)), params)


def test_entries_count_tokens_alternatives_and_prompt_positions() -> None:
    assert answer_entries([[object()] * 10], [_job(5)]) == 10
    assert answer_entries([[object()] * 10], [_job(5, logprobs=4)]) == 50
    # 16 choices of a 4,085-token prompt with 20 prompt alternatives: the 98 MB answer measured.
    jobs = [_job(4085, prompt_logprobs=20)] * 16
    assert answer_entries([[object()]] * 16, jobs) == 16 + 16 * 4085 * 21 and large_answer([[object()]] * 16, jobs)
    assert not large_answer([[object()] * 100], [_job(50, logprobs=5)])
    assert OFF_LOOP_ENTRIES > 600


def _stable(answer: dict) -> dict:
    return {key: value for key, value in answer.items() if key not in ("id", "created")}


@pytest.mark.parametrize("fields", [dict(n=3, logprobs=2), dict(prompt_logprobs=2, echo=True, logprobs=1)])
def test_an_answer_built_off_the_loop_is_the_one_built_on_it(client: TestClient, manager: FakeManager,
                                                              monkeypatch: pytest.MonkeyPatch, fields: dict) -> None:
    on_loop = completion(client, prompt="a b c", temperature=0, **fields)
    assert on_loop.status_code == 200
    monkeypatch.setattr(answer_size, "OFF_LOOP_ENTRIES", 0)
    off_loop = completion(client, prompt="a b c", temperature=0, **fields)
    assert off_loop.status_code == 200 and _stable(off_loop.json()) == _stable(on_loop.json())
