"""How a PD node turns its manager's generation events into stream events (``stream_translation.translate``).

A finish can reach the node in a read with no new token (the detokenizer took the last token
before rank 0 set the finish status). It must still go out, as a token-less finish the master
reads as the end of the request: dropped, the node's stream ended "without a result" and the
master failed a request that had finished (seen in CI on a decode node's last segment).
"""

from __future__ import annotations

from typing import Optional

from lightllm.server.pd.node.stream_translation import translate
from lightllm.server.pd.protocol.stream_lines import event_fields, token_from_line
from lightllm.server.request_manager import GenerationEvent


def _event(token_id: int, finish: Optional[str]) -> GenerationEvent:
    return GenerationEvent(request_id=3, token_id=token_id, text="" if token_id < 0 else "x", logprob=0.0 if token_id < 0 else -0.5,
                           finish_reason=finish, prompt_tokens=32, cached_tokens=0, completion_tokens=5)


def _translated(event: GenerationEvent):
    return translate(event, 3, {}, False)


def test_a_token_less_client_finish_goes_out_as_a_finishing_token_line():
    for reason in ("length", "stop"):
        (out,) = _translated(_event(-1, reason))
        assert out.kind == "token" and out.token.token_id == -1 and out.token.finish_reason == reason
        line = event_fields(out)
        assert line["event"] == "token" and line["token_id"] == -1 and line["finish_reason"] == reason
        # The master reads it back as a token-less finish.
        back = token_from_line(line, 3, 32, 5)
        assert back.token_id == -1 and back.finish_reason == reason


def test_tokens_and_segment_ends_are_unchanged():
    (plain,) = _translated(_event(11, None))
    assert plain.kind == "token" and plain.token.token_id == 11 and plain.token.finish_reason is None
    (last,) = _translated(_event(12, "length"))
    assert last.kind == "token" and last.token.finish_reason == "length"
    token_line, end = _translated(_event(13, "segment_limit"))
    assert token_line.kind == "token" and token_line.token.finish_reason is None
    assert end.kind == "segment_end"
    (only_end,) = _translated(_event(-1, "segment_limit"))
    assert only_end.kind == "segment_end"


def test_a_request_the_rank_failed_alone_is_a_generation_failure_and_an_abort_stays_internal():
    (failed,) = _translated(_event(-1, "error"))
    assert (failed.kind, failed.error_kind) == ("error", "generation_failed")
    (grammar,) = _translated(_event(-1, "grammar_failed"))
    assert (grammar.kind, grammar.error_kind) == ("error", "grammar_failed")
    (aborted,) = _translated(_event(-1, "abort"))
    assert (aborted.kind, aborted.error_kind) == ("error", "internal")
