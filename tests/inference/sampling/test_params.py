"""SamplingParams: defaults are valid, every invalid field fails with a ValueError naming it."""

import math

import pytest

from inference.sampling.params import MAX_LOGPROBS, LogprobsMode, SamplingParams


def test_defaults_are_valid_and_cheap_to_read():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_k, p.top_p, p.min_p) == (1, 1.0, 0, 1.0, 0.0)
    assert p.seed is None and p.stop_token_ids == [] and not p.ignore_eos
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.logprobs_mode is LogprobsMode.RAW
    assert not p.greedy and SamplingParams(temperature=0).greedy
    assert not hasattr(p, "__dict__")  # slots: created per request


def test_default_lists_are_not_shared():
    a, b = SamplingParams(), SamplingParams()
    a.stop_token_ids.append(3)
    assert b.stop_token_ids == []


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(n=8, temperature=0.0, top_k=-1, top_p=0.5, min_p=0.0),
        dict(temperature=2, top_k=1, top_p=1, min_p=0.99),
        dict(seed=0), dict(seed=2**64 - 1), dict(max_tokens=1),
        dict(stop_token_ids=[0, 2]), dict(ignore_eos=True),
        dict(logprobs=0, prompt_logprobs=MAX_LOGPROBS, logprobs_mode=LogprobsMode.PROCESSED),
        dict(repetition_penalty=1e-3, presence_penalty=-2, frequency_penalty=2.0),
        dict(max_tokens=4, min_tokens=4), dict(logit_bias={}), dict(logit_bias={0: -100, 7: 100.0}),
        dict(bad_words_token_ids=[], allowed_token_ids=[0]), dict(bad_words_token_ids=[[1], (2, 3)]),
        dict(cache_salt=""), dict(cache_salt="x" * 256),
    ],
)
def test_valid_edges(kwargs):
    SamplingParams(**kwargs)


def test_stop_token_ids_tuple_becomes_list():
    assert SamplingParams(stop_token_ids=(1, 2)).stop_token_ids == [1, 2]
    p = SamplingParams(bad_words_token_ids=((1,), (2, 3)), allowed_token_ids=(4,))
    assert p.bad_words_token_ids == [[1], [2, 3]] and p.allowed_token_ids == [4]


def test_uses_processors_only_when_one_is_on():
    assert not SamplingParams(logit_bias={}, bad_words_token_ids=[], cache_salt="s").uses_processors
    for on in (dict(repetition_penalty=0.9), dict(presence_penalty=0.1), dict(frequency_penalty=-0.1),
               dict(min_tokens=1), dict(logit_bias={1: 0.5}), dict(bad_words_token_ids=[[1]]),
               dict(allowed_token_ids=[1])):
        assert SamplingParams(**on).uses_processors, on


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0), ("n", 1.0), ("n", True),
        ("temperature", -0.1), ("temperature", math.inf), ("temperature", math.nan), ("temperature", "1"),
        ("temperature", 1e-40), ("temperature", 1e308),  # 1 / T overflows float32; T overflows it
        ("top_k", -2), ("top_k", 2.0), ("top_k", True), ("top_k", 2**63),
        ("top_p", 0.0), ("top_p", 1.01), ("top_p", math.nan), ("top_p", None),
        ("min_p", -0.01), ("min_p", 1.0), ("min_p", math.nan),
        ("seed", -1), ("seed", 2**64), ("seed", 1.5),
        ("max_tokens", 0), ("max_tokens", None),
        ("stop_token_ids", [1, -1]), ("stop_token_ids", [1.0]), ("stop_token_ids", 3), ("stop_token_ids", "ab"),
        ("ignore_eos", 1),
        ("logprobs", -1), ("logprobs", MAX_LOGPROBS + 1), ("logprobs", 2.0),
        ("prompt_logprobs", -1), ("prompt_logprobs", MAX_LOGPROBS + 1),
        ("logprobs_mode", "raw"), ("logprobs_mode", 0),
        ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
        ("repetition_penalty", math.nan), ("presence_penalty", 2.01), ("presence_penalty", math.nan),
        ("frequency_penalty", -2.5), ("frequency_penalty", True),
        ("min_tokens", -1), ("min_tokens", 17), ("min_tokens", 1.0),  # 17 > the default max_tokens
        ("logit_bias", [(1, 2.0)]), ("logit_bias", {-1: 1.0}), ("logit_bias", {"1": 1.0}),
        ("logit_bias", {1: 100.5}), ("logit_bias", {1: math.nan}),
        ("bad_words_token_ids", [[]]), ("bad_words_token_ids", [1, 2]), ("bad_words_token_ids", [[1, -2]]),
        ("bad_words_token_ids", "ab"),
        ("allowed_token_ids", []), ("allowed_token_ids", [True]), ("allowed_token_ids", 3),
        ("cache_salt", 5), ("cache_salt", "x" * 257),
    ],
)
def test_invalid_value_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field} "):
        SamplingParams(**{field: value})
