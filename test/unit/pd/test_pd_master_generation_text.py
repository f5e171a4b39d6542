"""The master's text of a PD generation ends on a stop string the way a normal server's does."""

from __future__ import annotations

from transformers import AutoTokenizer

from lightllm.common.sampling import SamplingParams
from lightllm.server.pd.master.generation_text import GenerationText
from lightllm.server.request_manager import GenerationEvent


def _event(token_id: int, finish_reason: str | None = None) -> GenerationEvent:
    return GenerationEvent(1, token_id, "", -0.5, finish_reason, 2, 0, 1)


def test_a_stop_string_completed_by_the_flush_of_an_unfinished_character_ends_as_a_stop(tiny_llama_dir) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    words = tokenizer("plain words", add_special_tokens=False)["input_ids"]
    lead = next(token_id for token_id in range(len(tokenizer)) if tokenizer.convert_ids_to_tokens(token_id) == "ä")
    for stop, finish, expected in ((["\ufffd"], "length", ("stop", "\ufffd")), ([], "length", ("length", None)),
                                   (["\ufffd"], "abort", ("abort", None))):
        text = GenerationText(tokenizer, [5, 6], SamplingParams(temperature=0, stop_sequences=stop), [])
        events = [_event(token_id) for token_id in words] + [_event(lead, finish)]
        for event in events:
            text.apply(event)
        assert (events[-1].finish_reason, events[-1].stop_reason) == expected, (stop, finish)
        decoded = "".join(event.text for event in events)
        assert decoded == tokenizer.decode(words + ([] if stop else [lead])), (stop, finish)
