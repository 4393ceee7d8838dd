"""SamplingParams: vLLM's defaults, normalisation, and every validation error naming its field."""

import math

import pytest

from pagedllm.sampling_params import RequestOutputKind, SamplingParams, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.max_tokens == 16 and p.min_tokens == 0 and p.seed is None
    assert p.stop == [] and p.stop_token_ids == [] and p.ignore_eos is False
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.skip_special_tokens is True and p.spaces_between_special_tokens is True
    assert p.include_stop_str_in_output is False and p.logit_bias is None
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    assert p.sampling_type is SamplingType.RANDOM


def test_normalisation():
    p = SamplingParams(stop="###", top_k=-1, seed=-1, logprobs=True, logit_bias={"5": 2})
    assert p.stop == ["###"] and p.top_k == 0 and p.seed is None and p.logprobs == 1
    assert p.logit_bias == {5: 2.0}
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(seed=7, temperature=0.5).sampling_type is SamplingType.RANDOM_SEED
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA


def test_greedy_resets_other_knobs():
    p = SamplingParams(temperature=0.0, top_p=0.3, top_k=5, min_p=0.2)
    assert p.sampling_type is SamplingType.GREEDY
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    # below the greedy threshold is greedy too; 1e-4 is not (it is sampled, in float32)
    assert SamplingParams(temperature=1e-6).sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=1e-4).sampling_type is SamplingType.RANDOM


def test_accepted_edge_values():
    SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=5.0, top_p=1.0, min_p=1.0)
    SamplingParams(top_k=9_999_999, max_tokens=0, min_tokens=0, logprobs=-1, prompt_logprobs=0)
    SamplingParams(max_tokens=None, min_tokens=100)
    SamplingParams(max_tokens=5, min_tokens=5)


BAD = [
    ("n", dict(n=0)),
    ("n", dict(n=1.5)),
    ("presence_penalty", dict(presence_penalty=2.5)),
    ("presence_penalty", dict(presence_penalty=-2.01)),
    ("frequency_penalty", dict(frequency_penalty=-3)),
    ("repetition_penalty", dict(repetition_penalty=0.0)),
    ("repetition_penalty", dict(repetition_penalty=-1.0)),
    ("repetition_penalty", dict(repetition_penalty=math.inf)),
    ("repetition_penalty", dict(repetition_penalty=1e-60)),  # 0 in float32: the sampler's logits would be inf
    ("repetition_penalty", dict(repetition_penalty=1e31)),
    ("allowed_token_ids", dict(allowed_token_ids=[])),
    ("allowed_token_ids", dict(allowed_token_ids=[3, -1])),
    ("truncate_prompt_tokens", dict(truncate_prompt_tokens=0)),
    ("truncate_prompt_tokens", dict(truncate_prompt_tokens=-2)),
    ("temperature", dict(temperature=-1)),
    ("temperature", dict(temperature=math.nan)),
    ("temperature", dict(temperature="hot")),
    ("top_p", dict(top_p=0)),
    ("top_p", dict(top_p=1.5)),
    ("top_k", dict(top_k=-2)),
    ("top_k", dict(top_k=2.5)),
    ("min_p", dict(min_p=-0.1)),
    ("min_p", dict(min_p=1.1)),
    ("seed", dict(seed=1.5)),
    ("seed", dict(seed=2**64)),
    ("max_tokens", dict(max_tokens=-5)),
    ("max_tokens", dict(max_tokens="16")),
    ("min_tokens", dict(min_tokens=-1)),
    ("min_tokens", dict(min_tokens=17, max_tokens=16)),
    ("logprobs", dict(logprobs=-2)),
    ("prompt_logprobs", dict(prompt_logprobs=-5)),
    ("stop", dict(stop=["ok", ""])),
    ("stop", dict(stop=[3])),
    ("stop", dict(stop="x", detokenize=False)),
    ("stop_token_ids", dict(stop_token_ids=[-1])),
    ("stop_token_ids", dict(stop_token_ids=["a"])),
    ("logit_bias", dict(logit_bias={1: math.nan})),
    ("logit_bias", dict(logit_bias={"x": 1.0})),
    ("logit_bias", dict(logit_bias=[1, 2])),
    ("logit_bias", dict(logit_bias={-3: 1.0})),
    ("ignore_eos", dict(ignore_eos="false")),
    ("skip_special_tokens", dict(skip_special_tokens=1)),
    ("include_stop_str_in_output", dict(include_stop_str_in_output=None)),
    ("output_kind", dict(output_kind=7)),
]


@pytest.mark.parametrize("field,kwargs", BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD)])
def test_invalid_value_names_field(field, kwargs):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert str(err.value).startswith(field), str(err.value)


def test_verify_for_vocab():
    SamplingParams(logit_bias={99: 1.0}, stop_token_ids=[99], logprobs=100).verify_for_vocab(100)
    for field, kwargs in [
        ("logit_bias", dict(logit_bias={100: 1.0})),
        ("stop_token_ids", dict(stop_token_ids=[5, 100])),
        ("logprobs", dict(logprobs=101)),
        ("prompt_logprobs", dict(prompt_logprobs=1000)),
    ]:
        with pytest.raises(ValueError) as err:
            SamplingParams(**kwargs).verify_for_vocab(100)
        assert str(err.value).startswith(field)


def test_clone_is_deep():
    p = SamplingParams(stop=["a"], stop_token_ids=[1], logit_bias={1: 1.0})
    q = p.clone()
    q.stop.append("b")
    q.stop_token_ids.append(2)
    q.logit_bias[2] = 3.0
    assert p.stop == ["a"] and p.stop_token_ids == [1] and p.logit_bias == {1: 1.0}
