"""OpenAI-compatible endpoints: a prompt and completion against the context length (refusals, and
the max_tokens cut to the room a prompt leaves)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from api_fakes import FakeManager, assert_error, chat, completion


def test_context_length_errors(client: TestClient, manager: FakeManager) -> None:
    long_prompt = " ".join(["word"] * 70)
    error = assert_error(completion(client, prompt=long_prompt, max_tokens=4), 400, "prompt",
                         "context_length_exceeded")
    assert error["message"] == ("This model's maximum context length is 64 tokens. However, the prompt holds 71 "
                                "tokens, which leaves no room for a completion. Please reduce the length of the prompt.")
    # max_tokens above the whole context is refused; one that only does not fit beside the
    # prompt is cut to the room left (vLLM 0.34), below.
    error = assert_error(completion(client, prompt="a b", max_tokens=65), 400, "max_tokens", "context_length_exceeded")
    assert error["message"] == ("This model's maximum context length is 64 tokens. However, you requested 65 "
                                "completion tokens (max_tokens), more than the whole context. Please reduce max_tokens.")
    # A prompt that fills the context, with no max_tokens asked for: no invented completion length.
    error = assert_error(chat(client, messages=[{"role": "user", "content": long_prompt}]), 400, "messages",
                         "context_length_exceeded")
    assert "However, the messages hold" in error["message"] and "leaves no room for a completion" in error["message"]
    assert_error(chat(client, max_tokens=65), 400, "max_tokens", "context_length_exceeded")
    assert_error(client.post("/generate", json={"inputs": long_prompt}), 400, "inputs")
    # The native endpoint keeps LightLLM's rule: prompt plus max_new_tokens must fit.
    assert_error(client.post("/generate", json={"inputs": "a b", "parameters": {"max_new_tokens": 62}}), 400,
                 "parameters.max_new_tokens", "context_length_exceeded")


def test_errors_name_which_of_several_prompts_is_at_fault(client: TestClient) -> None:
    long_prompt = " ".join(["word"] * 70)
    error = assert_error(completion(client, prompt=["a b", long_prompt], max_tokens=4), 400, "prompt",
                         "context_length_exceeded")
    assert "However, the prompt 1 holds 71 tokens" in error["message"], error["message"]
    error = assert_error(completion(client, prompt=[[1, 2], [3, 100]], max_tokens=4), 400, "prompt")
    assert error["message"] == "prompt 1: token id 100 is outside the vocabulary [0, 100)"
    error = assert_error(completion(client, prompt=["a", "b c", long_prompt], max_tokens=0, echo=True), 400, "prompt")
    assert "so the prompt 2 may hold at most 63 tokens" in error["message"], error["message"]
    # One prompt (or one in a list) is named as before.
    error = assert_error(completion(client, prompt=[long_prompt], max_tokens=4), 400, "prompt")
    assert "However, the prompt holds 71 tokens" in error["message"]


def test_max_tokens_cut_to_the_room_the_prompt_leaves(client: TestClient, manager: FakeManager) -> None:
    manager.reply_len = 100
    prompt_len = len(manager.served.encode_prompt("a b"))
    for max_tokens in (64 - prompt_len, 64 - prompt_len + 1, 64):
        data = completion(client, prompt="a b", max_tokens=max_tokens).json()
        assert manager.calls[-1].params.max_new_tokens == 64 - prompt_len
        assert data["choices"][0]["finish_reason"] == "length"
        assert data["usage"]["completion_tokens"] == 64 - prompt_len
    response = chat(client, max_completion_tokens=64)
    assert response.status_code == 200, response.text
    assert manager.calls[-1].params.max_new_tokens == 64 - len(manager.calls[-1].prompt_ids)
    # Each prompt of a list gets its own room.
    completion(client, prompt=["a", "a b c d"], max_tokens=64)
    assert sorted(len(call.prompt_ids) + call.params.max_new_tokens for call in manager.calls[-2:]) == [64, 64]
    # min_tokens the room cannot hold is refused, naming min_tokens.
    error = assert_error(completion(client, prompt="a b", max_tokens=64, min_tokens=64 - prompt_len + 1), 400,
                         "min_tokens", "context_length_exceeded")
    assert f"room for {64 - prompt_len} completion tokens" in error["message"]
    assert completion(client, prompt="a b", max_tokens=64, min_tokens=64 - prompt_len).status_code == 200
    # Without max_tokens the default length is cut to the room too: the refusal names min_tokens
    # and the room, not a max_tokens the client never sent ("must be <= max_tokens (10)").
    prompt = " ".join(["word"] * 50)
    room = 64 - len(manager.served.encode_prompt(prompt))
    assert 0 < room < 16
    for response, param in [(completion(client, prompt=prompt, min_tokens=room + 1), "min_tokens"),
                            (client.post("/generate", json={"inputs": prompt, "parameters": {"min_new_tokens": room + 1}}),
                             "parameters.min_new_tokens")]:
        error = assert_error(response, 400, param, "context_length_exceeded")
        assert f"leaves room for {room} completion tokens, fewer than {param} ({room + 1})" in error["message"]
    assert completion(client, prompt=prompt, min_tokens=room).status_code == 200
    # Even a min_tokens above the whole context is about the room, and names min_tokens.
    assert_error(completion(client, prompt=prompt, min_tokens=65), 400, "min_tokens", "context_length_exceeded")
