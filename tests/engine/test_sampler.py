import math

import pytest
import torch

from dsv4.engine import sampler as sampler_module
from dsv4.engine.sampler import (
    Sampler,
    SamplingBatch,
    compute_prompt_logprobs,
    make_generator,
)
from dsv4.engine.sampling_params import SamplingParams

# Five tokens with clear gaps between cumulative masses, so nucleus boundaries are exact.
PROBS5 = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05], dtype=torch.float64)
DRAWS = 20_000


def build(params, *, vocab_size, prompts=None, outputs=None, **kwargs):
    rows = len(params)
    return SamplingBatch.build(
        params,
        vocab_size=vocab_size,
        device="cpu",
        prompt_token_ids=prompts if prompts is not None else [[] for _ in range(rows)],
        output_token_ids=outputs if outputs is not None else [[] for _ in range(rows)],
        **kwargs,
    )


def draw(logits_row, params, draws=DRAWS, seed=0):
    """Sample ``draws`` independent tokens from one logits row (as a batch of copies)."""
    logits = logits_row.float().expand(draws, -1).contiguous()
    batch = build([params] * draws, vocab_size=logits.shape[1])
    sampler = Sampler(generator=torch.Generator().manual_seed(seed))
    return sampler.sample(logits, batch).sampled_token_ids


def assert_frequencies(tokens, expected, vocab_size):
    """Pearson chi-square against ``expected`` (zeros must never occur), at ~1e-6 significance."""
    expected = torch.as_tensor(expected, dtype=torch.float64)
    counts = torch.bincount(tokens, minlength=vocab_size).double()
    impossible = expected == 0
    assert counts[impossible].sum() == 0, f"sampled a token with zero probability: {counts}"
    n = counts.sum()
    e = expected[~impossible] * n
    chi2 = ((counts[~impossible] - e) ** 2 / e).sum().item()
    dof = int((~impossible).sum()) - 1
    # mean dof, sd sqrt(2 dof); 5 sd above the mean plus slack is far beyond chance.
    assert chi2 < dof + 5 * math.sqrt(2 * dof) + 10, f"chi2={chi2:.1f} dof={dof} counts={counts}"


def renormalised(probs, keep):
    kept = torch.where(torch.as_tensor(keep), probs, torch.zeros_like(probs))
    return kept / kept.sum()


# ---------------------------------------------------------------- greedy and determinism


def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(8, 1000)
    out = Sampler().sample(logits, build([SamplingParams(temperature=0.0)] * 8, vocab_size=1000))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None


def test_greedy_ignores_top_k_top_p_and_mixed_batch():
    torch.manual_seed(1)
    logits = torch.randn(6, 300)
    params = [
        SamplingParams(temperature=0.0, top_k=1, top_p=0.1, min_p=0.9),
        SamplingParams(temperature=0.8, seed=3),
    ] * 3
    out = Sampler().sample(logits, build(params, vocab_size=300))
    assert torch.equal(out.sampled_token_ids[0::2], logits[0::2].argmax(-1))


def test_input_logits_are_not_modified():
    torch.manual_seed(2)
    logits = torch.randn(3, 50)
    before = logits.clone()
    params = [SamplingParams(repetition_penalty=1.5, presence_penalty=1.0, top_k=5, top_p=0.5)] * 3
    batch = build(params, vocab_size=50, prompts=[[1, 2]] * 3, outputs=[[3, 3]] * 3,
                  allowed_token_masks=[torch.arange(50) < 25, None, None])
    Sampler().sample(logits, batch)
    assert torch.equal(logits, before)


def _run_seeded(rows_params, target_row, steps, vocab=500, logits_seed=7):
    """Tokens of ``target_row`` over several steps; every row's generator lives across steps."""
    gens = [make_generator(p.seed, "cpu") if p.seed is not None else None for p in rows_params]
    sampler = Sampler(generator=torch.Generator().manual_seed(99))
    logits_gen = torch.Generator().manual_seed(logits_seed)
    tokens = []
    for _ in range(steps):
        # Same logits for the target whatever the batch looks like; other rows get noise.
        target_logits = torch.randn(vocab, generator=logits_gen)
        logits = torch.randn(len(rows_params), vocab)
        logits[target_row] = target_logits
        batch = build(rows_params, vocab_size=vocab, generators=gens)
        tokens.append(int(sampler.sample(logits, batch).sampled_token_ids[target_row]))
    return tokens


def test_seeded_request_ignores_batch_composition_and_position():
    target = SamplingParams(temperature=1.3, top_p=0.9, top_k=100, seed=1234)
    alone = _run_seeded([target], 0, steps=12)
    others = [
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(seed=5, temperature=0.7),
        SamplingParams(top_k=3),
    ]
    first = _run_seeded([target, *others], 0, steps=12)
    middle = _run_seeded([others[0], others[1], target, others[2], others[3]], 2, steps=12)
    last = _run_seeded([*others, target], 4, steps=12)
    assert alone == first == middle == last
    different_seed = SamplingParams(temperature=1.3, top_p=0.9, top_k=100, seed=4321)
    assert _run_seeded([different_seed], 0, steps=12) != alone


# ---------------------------------------------------------------- distributions


def test_plain_sampling_matches_softmax():
    logits = PROBS5.log()
    assert_frequencies(draw(logits, SamplingParams()), PROBS5, 5)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scaling(temperature):
    logits = PROBS5.log()
    expected = torch.softmax(logits / temperature, dim=0)
    assert_frequencies(draw(logits, SamplingParams(temperature=temperature)), expected, 5)


def test_top_k_never_leaves_the_top_k():
    torch.manual_seed(3)
    logits = torch.randn(40, dtype=torch.float64)
    top = logits.topk(7).indices
    keep = torch.zeros(40, dtype=torch.bool)
    keep[top] = True
    tokens = draw(logits, SamplingParams(top_k=7))
    assert keep[tokens].all()
    assert_frequencies(tokens, renormalised(logits.softmax(0), keep), 40)


@pytest.mark.parametrize(
    "top_p,nucleus",
    [(0.35, 1), (0.69, 2), (0.75, 3), (0.86, 4), (0.99, 5), (1.0, 5)],
)
def test_top_p_keeps_the_minimal_nucleus(top_p, nucleus):
    # Shuffle so the nucleus is not simply a prefix of the vocabulary.
    perm = torch.tensor([3, 0, 4, 1, 2])
    probs = torch.empty(5, dtype=torch.float64)
    probs[perm] = PROBS5
    keep = torch.zeros(5, dtype=torch.bool)
    keep[perm[:nucleus]] = True
    tokens = draw(probs.log(), SamplingParams(top_p=top_p), draws=10_000)
    assert_frequencies(tokens, renormalised(probs, keep), 5)


def test_min_p_threshold():
    # min_p 0.3 -> threshold 0.12: 0.4, 0.3, 0.15 survive, 0.1 and 0.05 do not.
    tokens = draw(PROBS5.log(), SamplingParams(min_p=0.3))
    assert_frequencies(tokens, renormalised(PROBS5, [True, True, True, False, False]), 5)


def test_top_k_then_top_p_then_min_p():
    # top_k 4 renormalises to 0.421, 0.316, 0.158, 0.105; top_p 0.9 then keeps all four
    # (mass before the 4th is 0.895); min_p 0.3 drops the 4th (0.105 < 0.126).
    params = SamplingParams(top_k=4, top_p=0.9, min_p=0.3)
    tokens = draw(PROBS5.log(), params)
    assert_frequencies(tokens, renormalised(PROBS5, [True, True, True, False, False]), 5)
    tokens = draw(PROBS5.log(), SamplingParams(top_k=4, top_p=0.9))
    assert_frequencies(tokens, renormalised(PROBS5, [True, True, True, True, False]), 5)


def test_per_row_settings_in_one_batch():
    groups = [
        (SamplingParams(top_k=2), [True, True, False, False, False], 1.0),
        (SamplingParams(top_p=0.75), [True, True, True, False, False], 1.0),
        (SamplingParams(min_p=0.3), [True, True, True, False, False], 1.0),
        (SamplingParams(temperature=0.5), [True] * 5, 0.5),
    ]
    per_group = 5_000
    params = [g[0] for g in groups for _ in range(per_group)]
    logits = PROBS5.log().float().expand(len(params), -1).contiguous()
    out = Sampler(generator=torch.Generator().manual_seed(4)).sample(logits, build(params, vocab_size=5))
    for i, (_, keep, temperature) in enumerate(groups):
        expected = renormalised(torch.softmax(PROBS5.log() / temperature, 0), keep)
        assert_frequencies(out.sampled_token_ids[i * per_group:(i + 1) * per_group], expected, 5)


# ---------------------------------------------------------------- penalties, masks, min_tokens


def reference_penalties(logits, params, prompt, output):
    out = logits.clone()
    for t in set(prompt) | set(output):
        if out[t] > 0:
            out[t] /= params.repetition_penalty
        else:
            out[t] *= params.repetition_penalty
    for t in set(output):
        out[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    return out


def test_penalties_match_direct_reference():
    torch.manual_seed(5)
    vocab = 60
    params = [
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2),
        SamplingParams(repetition_penalty=0.8),
        SamplingParams(presence_penalty=-1.0, frequency_penalty=1.5),
        SamplingParams(),
    ]
    prompts = [[1, 2, 3, 2], [4, 5], [6], []]
    outputs = [[3, 3, 7, 9, 3], [5, 10, 10], [6, 6, 11], [12]]
    logits = torch.randn(4, vocab) * 3
    batch = build(params, vocab_size=vocab, prompts=prompts, outputs=outputs)
    got = Sampler.apply_constraints_and_penalties(logits, batch)
    for row in range(4):
        ref = reference_penalties(logits[row], params[row], prompts[row], outputs[row])
        torch.testing.assert_close(got[row], ref)


def test_greedy_uses_penalised_logits():
    logits = torch.tensor([[5.0, 4.9, 0.0]])
    batch = build([SamplingParams(temperature=0.0, repetition_penalty=2.0)], vocab_size=3,
                  prompts=[[0]])
    assert Sampler().sample(logits, batch).sampled_token_ids.tolist() == [1]


def test_min_tokens_suppresses_eos_and_stop_tokens():
    eos, stop_tok = 1, 4
    logits = torch.zeros(3, 6)
    logits[:, eos] = 10.0
    logits[:, stop_tok] = 9.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop_tok])
    ignore = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)
    batch = build([params, params, ignore], vocab_size=6, eos_token_id=eos,
                  outputs=[[0, 0], [0, 0, 0], [0]])
    sampled = Sampler().sample(logits, batch).sampled_token_ids.tolist()
    # Row 0 is still short: both suppressed. Row 1 reached min_tokens. Row 2 ignores eos,
    # so eos is an ordinary token and stays allowed.
    assert sampled == [0, eos, eos]


def test_allowed_token_mask_and_logit_bias():
    torch.manual_seed(6)
    vocab = 30
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[[3, 17, 22]] = True
    params = [SamplingParams()] * 400 + [SamplingParams(temperature=0.0)] * 2
    masks = [allowed] * 400 + [None, None]
    logits = torch.randn(len(params), vocab)
    bias = torch.zeros(len(params), vocab)
    bias[-1, 29] = 100.0
    batch = build(params, vocab_size=vocab, allowed_token_masks=masks, logit_bias=bias)
    sampled = Sampler().sample(logits, batch).sampled_token_ids
    assert allowed[sampled[:400]].all()
    assert set(sampled[:400].tolist()) == {3, 17, 22}
    assert sampled[-2] == logits[-2].argmax()
    assert sampled[-1] == 29
    # The same mask as one [B, V] tensor.
    dense = torch.stack([m if m is not None else torch.ones(vocab, dtype=torch.bool) for m in masks])
    batch = build(params, vocab_size=vocab, allowed_token_masks=dense)
    assert allowed[Sampler().sample(logits, batch).sampled_token_ids[:400]].all()


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax():
    torch.manual_seed(7)
    vocab = 100
    logits = torch.randn(4, vocab) * 2
    params = [
        SamplingParams(logprobs=5, temperature=0.5, top_k=3, repetition_penalty=1.5),
        SamplingParams(logprobs=0),
        SamplingParams(),
        SamplingParams(logprobs=2, temperature=0.0),
    ]
    batch = build(params, vocab_size=vocab, prompts=[[0, 1, 2]] * 4)
    out = Sampler().sample(logits, batch)
    lp = out.logprobs
    ref = torch.log_softmax(logits, dim=-1)
    sampled = out.sampled_token_ids
    assert lp.token_ids.shape == (4, 6) and lp.logprobs.shape == (4, 6)
    assert torch.equal(lp.token_ids[:, 0], sampled)
    torch.testing.assert_close(lp.logprobs[:, 0], ref.gather(1, sampled[:, None])[:, 0])
    top = ref.topk(5, dim=-1)
    assert torch.equal(lp.token_ids[:, 1:], top.indices)
    torch.testing.assert_close(lp.logprobs[:, 1:], top.values)
    expected_ranks = (ref > ref.gather(1, sampled[:, None])).sum(-1) + 1
    assert torch.equal(lp.ranks, expected_ranks)
    assert lp.ranks[3] == 1  # greedy without penalties picks the top token


def test_prompt_logprobs_across_chunks(monkeypatch):
    monkeypatch.setattr(sampler_module, "PROMPT_LOGPROBS_CHUNK", 3)
    torch.manual_seed(8)
    prompt = torch.randint(0, 50, (9,))
    logits = torch.randn(9, 50)
    got = compute_prompt_logprobs(logits[:-1], prompt[1:], num_top=4)
    ref = torch.log_softmax(logits[:-1], dim=-1)
    assert torch.equal(got.token_ids[:, 0], prompt[1:])
    torch.testing.assert_close(got.logprobs[:, 0], ref.gather(1, prompt[1:, None])[:, 0])
    torch.testing.assert_close(got.logprobs[:, 1:], ref.topk(4, dim=-1).values)
    assert torch.equal(got.ranks, (ref > ref.gather(1, prompt[1:, None])).sum(-1) + 1)
    empty = compute_prompt_logprobs(logits[:0], prompt[:0], num_top=2)
    assert empty.token_ids.shape == (0, 3) and empty.ranks.shape == (0,)
    with pytest.raises(ValueError, match="target_token_ids"):
        compute_prompt_logprobs(logits, prompt[1:], num_top=1)
