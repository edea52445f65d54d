import pytest

from dsv4.engine.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.seed is None and p.stop == [] and p.stop_token_ids == []
    assert (p.max_tokens, p.min_tokens, p.ignore_eos) == (16, 0, False)
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.skip_special_tokens is True and p.include_stop_str_in_output is False
    assert not p.is_greedy and not p.top_k_enabled


def test_shorthands_are_normalised():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_greedy_and_top_k_flags():
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=0.1).is_greedy
    assert not SamplingParams(top_k=-1).top_k_enabled
    assert SamplingParams(top_k=5).top_k_enabled


@pytest.mark.parametrize(
    "field,value,expected",
    [
        ("n", 0, "n: must be >= 1, got 0"),
        ("n", 129, "n: must be <= 128, got 129"),
        ("n", 1.5, "n: must be an integer"),
        ("temperature", -0.1, "temperature: must be >= 0.0, got -0.1"),
        ("temperature", float("nan"), "temperature: must be a finite number"),
        ("temperature", "hot", "temperature: must be a finite number"),
        ("top_p", 0.0, "top_p: must be > 0.0, got 0.0"),
        ("top_p", 1.01, "top_p: must be <= 1.0, got 1.01"),
        ("top_k", -2, "top_k: must be >= -1, got -2"),
        ("top_k", 2.0, "top_k: must be an integer"),
        ("top_k", True, "top_k: must be an integer"),
        ("min_p", -0.01, "min_p: must be >= 0.0"),
        ("min_p", 1.5, "min_p: must be <= 1.0"),
        ("repetition_penalty", 0.0, "repetition_penalty: must be > 0.0, got 0.0"),
        ("repetition_penalty", float("inf"), "repetition_penalty: must be a finite number"),
        ("presence_penalty", -2.5, "presence_penalty: must be >= -2.0"),
        ("presence_penalty", 2.5, "presence_penalty: must be <= 2.0"),
        ("frequency_penalty", -3, "frequency_penalty: must be >= -2.0"),
        ("frequency_penalty", 2.01, "frequency_penalty: must be <= 2.0"),
        ("seed", 1.5, "seed: must be an integer"),
        ("seed", "42", "seed: must be an integer"),
        ("stop", [""], "stop: must be non-empty strings"),
        ("stop", ["ok", 3], "stop: must be non-empty strings"),
        ("stop_token_ids", [-1], "stop_token_ids: must be >= 0, got -1"),
        ("stop_token_ids", ["1"], "stop_token_ids: must be an integer"),
        ("max_tokens", 0, "max_tokens: must be >= 1, got 0"),
        ("max_tokens", 2.0, "max_tokens: must be an integer"),
        ("min_tokens", -1, "min_tokens: must be >= 0, got -1"),
        ("logprobs", -1, "logprobs: must be >= 0, got -1"),
        ("logprobs", 21, "logprobs: must be <= 20, got 21"),
        ("prompt_logprobs", 21, "prompt_logprobs: must be <= 20, got 21"),
        ("prompt_logprobs", 0.5, "prompt_logprobs: must be an integer"),
        ("ignore_eos", 1, "ignore_eos: must be a bool"),
        ("skip_special_tokens", None, "skip_special_tokens: must be a bool"),
        ("include_stop_str_in_output", "yes", "include_stop_str_in_output: must be a bool"),
    ],
)
def test_bad_field_is_named(field, value, expected):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    assert str(info.value).startswith(expected)


def test_min_tokens_cannot_exceed_max_tokens():
    with pytest.raises(ValueError, match=r"min_tokens: must be <= max_tokens \(4\), got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=None, min_tokens=100).min_tokens == 100


def test_boundary_values_are_accepted():
    SamplingParams(
        n=128, temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0, repetition_penalty=0.01,
        presence_penalty=-2.0, frequency_penalty=2.0, seed=0, logprobs=20, prompt_logprobs=0,
        max_tokens=1,
    )


def test_validate_after_mutation():
    p = SamplingParams()
    p.top_p = 0.0
    with pytest.raises(ValueError, match="top_p"):
        p.validate()
