"""The engine end to end on a tiny random V4.1 checkpoint: batching, chunking, prefix hits
(exact and bounded replay), preemption, aborts and seeds."""

from __future__ import annotations

import random

import pytest
import torch

from dsv4.engine.engine import LLMEngine
from dsv4.engine.sampling_params import SamplingParams
from dsv4.model.make_tiny import write_tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "v41", "v41", seed=3)


def make(tiny, **kw):
    opts = dict(block_size=16, kv_cache_memory=32 << 20, max_num_seqs=8, max_num_batched_tokens=512, swa_bounded_replay=False)
    opts.update(kw)
    return LLMEngine(tiny, progress=False, **opts)


def run(engine, prompts, params=GREEDY, ids=None):
    ids = ids or [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[r] for r in ids]


def tokens_and_logprobs(out):
    return out.token_ids, [lp.logprob for lp in out.outputs[0].logprobs]


def prompts(n, length, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(100, 120000) for _ in range(length + 7 * i)] for i in range(n)]


def test_batched_greedy_equals_each_alone(tiny):
    ps = prompts(4, 30)
    batched = run(make(tiny), ps)
    for p, out in zip(ps, batched):
        alone = run(make(tiny), [p])[0]
        assert tokens_and_logprobs(alone) == tokens_and_logprobs(out)


@pytest.mark.parametrize("bounded", [False, True])
def test_chunked_prefill_equals_unchunked(tiny, bounded):
    ps = prompts(2, 70)
    whole = run(make(tiny, swa_bounded_replay=bounded), ps)
    chunked = run(make(tiny, swa_bounded_replay=bounded, max_num_batched_tokens=13), ps)
    assert [tokens_and_logprobs(o) for o in whole] == [tokens_and_logprobs(o) for o in chunked]


def test_exact_prefix_hit_is_bit_identical_to_cold(tiny):
    base = prompts(1, 150, seed=5)[0]
    longer = base + prompts(1, 20, seed=6)[0]
    eng = make(tiny)
    run(eng, [base])
    hit = run(eng, [longer], ids=["hit"])[0]
    assert hit.num_cached_tokens == 144  # 9 full blocks of 16
    assert eng.stats()["prefix_hits_tokens"] >= 144
    cold = run(make(tiny, enable_prefix_caching=False), [longer])[0]
    assert cold.num_cached_tokens == 0
    assert tokens_and_logprobs(hit) == tokens_and_logprobs(cold)


def test_bounded_replay_hit_within_one_window_is_identical(tiny):
    base = prompts(1, 7, seed=1)[0]  # 7 + 1 = 8 tokens = one window
    eng = make(tiny, swa_bounded_replay=True, block_size=4)
    run(eng, [base])
    hit = run(eng, [base + [42]], ids=["hit"])[0]
    assert hit.num_cached_tokens == 4
    cold = run(make(tiny, swa_bounded_replay=True, block_size=4, enable_prefix_caching=False), [base + [42]])[0]
    assert tokens_and_logprobs(hit) == tokens_and_logprobs(cold)


def test_bounded_replay_hit_beyond_the_window_stays_close(tiny):
    """Approximate by design (MODEL.md section 3): measured and bounded, see docs/architecture.md."""
    base = prompts(1, 150, seed=5)[0]
    longer = base + prompts(1, 20, seed=6)[0]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=20)
    eng = make(tiny, swa_bounded_replay=True)
    run(eng, [base], params)
    hit = run(eng, [longer], params, ids=["hit"])[0]
    assert hit.num_cached_tokens == 144
    cold = run(make(tiny, swa_bounded_replay=True, enable_prefix_caching=False), [longer], params)[0]
    top_hit = dict(hit.outputs[0].logprobs[0].top)
    top_cold = dict(cold.outputs[0].logprobs[0].top)
    common = set(top_hit) & set(top_cold)
    assert len(common) >= 15
    distance = max(abs(top_hit[t] - top_cold[t]) for t in common)
    assert distance < 0.05, f"bounded-replay logprob distance {distance:.3f}"  # measured 0.007


def test_preemption_under_tiny_memory_gives_identical_outputs(tiny):
    ps = prompts(6, 40, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    roomy = run(make(tiny), ps, params)
    tight = make(tiny, kv_cache_memory=_budget_for_blocks(tiny, 12), max_num_seqs=6, max_model_len=160)
    small = run(tight, ps, params)
    assert tight.stats()["preemptions"] > 0
    assert [tokens_and_logprobs(o) for o in roomy] == [tokens_and_logprobs(o) for o in small]
    assert tight.stats()["blocks_used"] == 0 and tight.stats()["slots_free"] == 6


def _budget_for_blocks(tiny, blocks):
    from dsv4.cache.manager import CacheSizes
    from dsv4.config import load_config

    sizes = CacheSizes.for_config(load_config(tiny), 16, torch.float32)
    return blocks * sizes.block_bytes + 6 * sizes.slot_bytes_total


@pytest.mark.parametrize("async_scheduling", [False, True])  # (async: aborts land while a step is in flight)
def test_random_add_abort_finish_stress_leaks_nothing(tiny, async_scheduling):
    rng = random.Random(0)
    eng = make(tiny, kv_cache_memory=_budget_for_blocks(tiny, 14), max_num_seqs=6, max_model_len=200, swa_bounded_replay=True,
               async_scheduling=async_scheduling)
    shared = prompts(3, 40, seed=2)
    live: set[str] = set()
    for i in range(60):
        op = rng.random()
        if op < 0.45:
            p = list(rng.choice(shared)[: rng.randrange(5, 40)]) + [rng.randrange(100, 1000) for _ in range(rng.randrange(0, 20))]
            rid = f"s{i}"
            eng.add_request(rid, p, SamplingParams(temperature=0.8, max_tokens=rng.randrange(1, 20), seed=i, n=rng.choice([1, 1, 2])))
            live.add(rid)
        elif op < 0.6 and live:
            rid = rng.choice(sorted(live))
            eng.abort_request(rid)
            live.discard(rid)
        for out in eng.step():
            if out.finished:
                live.discard(out.request_id)
            assert all(t >= 0 for c in out.outputs for t in c.token_ids), "a placeholder reached an output"
        eng.manager.check_invariants()
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                live.discard(out.request_id)
    stats = eng.stats()
    assert not live
    assert stats["blocks_used"] == 0 and stats["slots_free"] == 6 and stats["running"] == 0 and stats["waiting"] == 0


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=1234, ignore_eos=True)
    p = prompts(1, 20, seed=4)[0]
    alone = run(make(tiny), [p], params)[0]
    others = prompts(3, 25, seed=8)
    mixed = run(make(tiny), others + [p], params)[-1]
    assert alone.token_ids == mixed.token_ids


def test_n_samples_share_the_prompt_and_differ(tiny):
    eng = make(tiny)
    p = prompts(1, 40, seed=11)[0]
    out = run(eng, [p], SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=7, ignore_eos=True))[0]
    assert len(out.outputs) == 3 and len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert eng.stats()["prefix_hits_tokens"] >= 32  # samples 2 and 3 reuse the first one's prompt blocks


def test_bad_requests_are_rejected_with_the_field(tiny):
    eng = make(tiny, max_model_len=64)
    with pytest.raises(ValueError, match="prompt"):
        eng.add_request("a", [], GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request("b", [5] * 64, GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        eng.add_request("c", [5, 10**7], GREEDY)
    eng.add_request("d", [5, 6], GREEDY)
    with pytest.raises(ValueError, match="request_id"):
        eng.add_request("d", [5, 6], GREEDY)
    eng.abort_request("d")
    assert eng.stats()["blocks_used"] == 0 and not eng.has_unfinished_requests()


def test_llm_generate_rejects_a_bad_prompt_without_leaking(tiny):
    from dsv4.llm import LLM

    llm = LLM(tiny, block_size=16, kv_cache_memory=32 << 20, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5, 6, 7], [5] * 100], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate(["hello"], GREEDY, use_tqdm=False)[0]
    assert len(out.token_ids) == 8 and llm.cache_stats()["blocks_used"] == 0
