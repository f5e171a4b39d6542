"""The detokenizer reads a step's tokens no further than that step published, so a request's last
token and its finish status reach it together and the text its decoder held back is never lost.

Real shared memory, real tokenizer, the real DetokenizationManager; the rank's writes are made
through the same ShmReqBuffer methods rank 0 uses.
"""

from __future__ import annotations

import uuid

import zmq

from lightllm.common.sampling import SamplingParams
from lightllm.server.core.objs.finish_status import FINISH_LENGTH
from lightllm.server.core.objs.io_messages import DetokenizedOutput, StepOutput, StepTexts
from lightllm.server.core.objs.shm_req_buffer import ShmReqBuffer
from lightllm.server.core.objs.request_spec import RequestSpec

from detokenizer_test_support import detokenizer_rig


def _texts(http: zmq.Socket) -> list[DetokenizedOutput]:
    step = http.recv_pyobj()
    assert isinstance(step, StepTexts)
    return [message for message in step.messages if isinstance(message, DetokenizedOutput)]


def test_a_finish_published_after_the_read_step_waits_for_its_own_message_with_its_token(tiny_llama_dir, tmp_path) -> None:
    with detokenizer_rig(tiny_llama_dir, tmp_path, 1) as rig:
        shm, manager, http = rig.shm, rig.manager, rig.http
        tokenizer = manager.tokenizer
        first, second = tokenizer.encode("hello world", add_special_tokens=False)[:2]
        held = tokenizer.decode([first, second])[len(tokenizer.decode([first])):]
        assert held.strip()
        # A stop string that starts with the second token's text: the decoder holds that text
        # back until it knows the stop string does not follow.
        params = SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True, stop_sequences=[held + "!"])
        shm.write_request(0, 1, RequestSpec([5, 6], params))
        assert shm.publish_token(0, 1, first, -0.5) == 1  # step 1, message (1, 0, 1) on its way
        # Step 2 runs before the detokenizer reads step 1's message: the last token and the status.
        assert shm.publish_token(0, 1, second, -0.5) == 2
        assert shm.set_finish_status(0, 1, FINISH_LENGTH)
        assert shm.published_output_len(0, 1) == 2

        manager.handle(StepOutput([(1, 0, 1)]))
        (step1,) = _texts(http)
        assert [event.token_id for event in step1.tokens] == [first] and step1.finish_reason is None
        manager.handle(StepOutput([(1, 0, 2)], [(1, 0)]))
        (step2,) = _texts(http)
        assert [event.token_id for event in step2.tokens] == [second] and step2.finish_reason == "length"
        text = "".join(event.text for message in (step1, step2) for event in message.tokens)
        assert text == tokenizer.decode([first, second])  # the held-back text came with the finish


def test_read_output_stops_at_the_named_length_and_hides_a_status_that_belongs_later() -> None:
    shm = ShmReqBuffer(f"lightllm_test_{uuid.uuid4().hex[:12]}", 1, 64, create=True)
    try:
        shm.write_request(0, 3, RequestSpec([5], SamplingParams(temperature=0, max_new_tokens=3)))
        for token in (7, 8, 9):
            shm.publish_token(0, 3, token, -1.0)
        shm.set_finish_status(0, 3, FINISH_LENGTH)
        early = shm.read_output(0, 3, 0, 2)
        assert (early.token_ids, early.output_len, early.finish_status) == ([7, 8], 2, 0)
        last = shm.read_output(0, 3, 2, 3)
        assert (last.token_ids, last.output_len, last.finish_status) == ([9], 3, FINISH_LENGTH)
        whole = shm.read_output(0, 3, 0)
        assert (whole.token_ids, whole.finish_status) == ([7, 8, 9], FINISH_LENGTH)
        assert shm.published_output_len(0, 4) == 0  # not this slot's request
    finally:
        shm.close()
        shm.unlink()


def _lead_byte_token(tokenizer) -> int:
    """The byte-level token of 0xE4, a byte that starts a three-byte character and ends nothing."""
    return next(token_id for token_id in range(len(tokenizer))
                if tokenizer.convert_ids_to_tokens(token_id) == "ä")


def test_a_stop_string_completed_by_the_end_of_an_unfinished_character_ends_as_a_stop(tiny_llama_dir, tmp_path) -> None:
    # The last token starts a character the length limit leaves unfinished: the flush lets its
    # byte out as U+FFFD, which completes the stop string "\ufffd". The text is cut there, so the
    # request ended on that stop string: finish "stop", stop_reason the string (it said "length").
    with detokenizer_rig(tiny_llama_dir, tmp_path, 1) as rig:
        shm, manager, http = rig.shm, rig.manager, rig.http
        tokenizer = manager.tokenizer
        words = tokenizer.encode("plain words", add_special_tokens=False)
        ids = words + [_lead_byte_token(tokenizer)]
        params = SamplingParams(temperature=0, max_new_tokens=len(ids), ignore_eos=True, stop_sequences=["\ufffd"])
        shm.write_request(0, 1, RequestSpec([5, 6], params))
        for token_id in ids:
            shm.publish_token(0, 1, token_id, -0.5)
        assert shm.set_finish_status(0, 1, FINISH_LENGTH)
        manager.handle(StepOutput([(1, 0, len(ids))], [(1, 0)]))
        (output,) = _texts(http)
        assert (output.finish_reason, output.stop_reason) == ("stop", "\ufffd")
        assert "".join(event.text for event in output.tokens) == tokenizer.decode(words)
