"""``logit_bias``: validated like OpenAI's, carried through shared memory, added to the logits in the sampler."""

from __future__ import annotations

import json
import uuid

import pytest
import torch
from sampling_test_support import build
from transformers import SequenceBiasLogitsProcessor

from lightllm.common.sampling import MAX_LOGIT_BIAS, SamplingParamError, SamplingParams
from lightllm.common.sampling.logit_processors import apply_logit_bias
from lightllm.common.sampling.sampler import Sampler
from lightllm.server.core.objs.shm_req_buffer import ShmReqBuffer
from lightllm.server.core.objs.request_spec import RequestSpec


def test_bias_is_added_like_transformers_sequence_bias():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    biases = [{3: 5.0, 7: -100.0}, {}, {0: 0.5, 49: 100.0, 12: -2.25}]
    got = apply_logit_bias(logits, build([SamplingParams(logit_bias=b) for b in biases], vocab=50))
    for row, bias in enumerate(biases):
        if not bias:
            assert torch.equal(got[row], logits[row])
            continue
        # transformers' per-token bias processor, the reference for "add the bias to that logit".
        reference = SequenceBiasLogitsProcessor({(token_id,): value for token_id, value in bias.items()})
        expected = reference(torch.tensor([[1, 2]]), logits[row : row + 1].clone())[0]
        assert torch.allclose(got[row], expected)


def test_large_positive_bias_makes_greedy_pick_the_token_and_negative_bans_it():
    logits = torch.tensor([[4.0, 1.0, 0.0, -1.0]] * 3)
    params = [SamplingParams(temperature=0, logit_bias={2: 100.0}),
              SamplingParams(temperature=0, logit_bias={0: -100.0}),
              SamplingParams(temperature=0)]
    out = Sampler(0).sample(logits, build(params, vocab=4))
    assert out.next_token_ids.tolist() == [2, 1, 0]
    # The reported logprobs are those of the biased distribution.
    assert out.logprobs[0].item() == pytest.approx(torch.log_softmax(torch.tensor([4.0, 1.0, 100.0, -1.0]), 0)[2].item())


def test_sampled_rows_never_pick_a_banned_token():
    logits = torch.zeros(1, 6)
    params = [SamplingParams(temperature=1.0, seed=3, logit_bias={token: -100.0 for token in range(5)})]
    sampler = Sampler(0)
    picks = {sampler.sample(logits, build(params, vocab=6)).next_token_ids.item() for _ in range(20)}
    assert picks == {5}


@pytest.mark.parametrize(("bias", "message"), [
    ({-1: 1.0}, "outside the vocabulary"),
    ({1: 100.5}, r"must be in \[-100, 100\]"),
    ({1: float("inf")}, "must be finite"),
    ({"1": 1.0}, "must be token ids"),
    ({i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}, "at most 300 entries"),
])
def test_invalid_bias_is_refused(bias, message):
    with pytest.raises(SamplingParamError, match=message):
        SamplingParams(logit_bias=bias)


def test_token_ids_are_checked_against_the_vocabulary():
    with pytest.raises(SamplingParamError, match=r"outside the vocabulary \[0, 8\)"):
        SamplingParams(logit_bias={8: 1.0}).validate(vocab_size=8)


def test_bias_survives_json_and_shared_memory():
    params = SamplingParams(logit_bias={i: (i % 201) - 100.0 for i in range(MAX_LOGIT_BIAS)})
    assert SamplingParams.from_dict(json.loads(json.dumps(params.to_dict()))) == params
    shm = ShmReqBuffer(f"lightllm_test_{uuid.uuid4().hex[:12]}", 1, 64, create=True)
    try:
        shm.write_request(0, 5, RequestSpec([1, 2, 3], params))
        assert shm.read_request(0, 5).params.logit_bias == params.logit_bias
    finally:
        shm.close()
        shm.unlink()
