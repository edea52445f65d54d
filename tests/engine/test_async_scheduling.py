"""Async scheduling (`EngineConfig.async_scheduling`): step N+1 is launched before step N's
tokens are read, with placeholders resolved on the device. Every request must come out
exactly as under synchronous scheduling: tokens, logprobs, finish reasons, prompt logprobs,
and nothing leaked, whatever stops, aborts or preempts it while a step is in flight."""

from __future__ import annotations

import torch

from dsv4.engine.runner import PendingTokens, pending_token
from dsv4.engine.sampling_params import SamplingParams
from tests.engine.test_engine import _budget_for_blocks, make, prompts, run, tiny  # noqa: F401 (tiny: fixture)


def outputs(outs):
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs or []], o.outputs[0].finish_reason) for o in outs]


def both(tiny, ps, params, **kw):
    sync_eng, async_eng = make(tiny, async_scheduling=False, **kw), make(tiny, async_scheduling=True, **kw)
    assert not sync_eng.async_scheduling and async_eng.async_scheduling
    return run(sync_eng, ps, params), run(async_eng, ps, params), async_eng


def test_default_is_off_without_cuda_graphs(tiny):
    assert not make(tiny).async_scheduling  # CPU: the reference path, no graphs to overlap


def test_pending_tokens_resolve_only_placeholders():
    pending = PendingTokens(4, torch.device("cpu"))
    pending.record([2, 0], torch.tensor([111, 222]))
    ids = torch.tensor([5, pending_token(2), -1, pending_token(0), 0])
    pending.resolve(ids)
    assert ids.tolist() == [5, 111, -1, 222, 0]  # -1 ("no token" in look-backs) is not a placeholder


def test_greedy_with_different_lengths_and_eos_matches_sync(tiny):
    ps = prompts(5, 20, seed=3)
    params = [SamplingParams(temperature=0.0, max_tokens=m, logprobs=2) for m in (1, 2, 5, 9, 3)]
    sync_eng, async_eng = make(tiny, async_scheduling=False), make(tiny, async_scheduling=True)
    for eng in (sync_eng, async_eng):
        for i, (p, sp) in enumerate(zip(ps, params)):
            eng.add_request(f"r{i}", p, sp)
    def drain(eng):
        done = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[f"r{i}"] for i in range(len(ps))]
    a, b = drain(sync_eng), drain(async_eng)
    assert outputs(a) == outputs(b)
    for o, sp in zip(b, params):  # the step launched after a request's last token changed nothing
        n, reason = len(o.outputs[0].token_ids), o.outputs[0].finish_reason
        assert (reason == "length" and n == sp.max_tokens) or (reason == "stop" and n <= sp.max_tokens)
    stats = async_eng.stats()
    assert stats["blocks_used"] == 0 and stats["slots_free"] == 8 and stats["generation_tokens"] == sync_eng.stats()["generation_tokens"]


def test_seeded_sampling_penalties_and_n_match_sync(tiny):
    params = SamplingParams(temperature=0.9, top_k=50, max_tokens=7, seed=11, n=2, ignore_eos=True,
                            repetition_penalty=1.3, frequency_penalty=0.5, logprobs=1)
    a, b, _ = both(tiny, prompts(3, 25, seed=5), params)
    assert [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in a] == [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in b]


def test_prompt_logprobs_and_chunked_prefill_match_sync(tiny):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=3, logprobs=0)
    a, b, _ = both(tiny, prompts(2, 40, seed=7), params, max_num_batched_tokens=13)
    assert outputs(a) == outputs(b)
    flat = lambda o: [(lp.token_id, lp.logprob, lp.rank, lp.top) for lp in o.prompt_logprobs[1:]]
    assert [flat(o) for o in a] == [flat(o) for o in b]


def test_prefix_hits_see_the_resolved_tokens(tiny):
    """Blocks are committed with real tokens only: a later request with the first one's
    prompt and output as its prompt hits them and computes the same continuation."""
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=0)
    eng = make(tiny, async_scheduling=True)
    first = run(eng, prompts(1, 30, seed=2), params)[0]
    longer = first.prompt_token_ids + first.outputs[0].token_ids
    hit = run(eng, [longer], params, ids=["hit"])[0]
    assert hit.num_cached_tokens == 48  # 3 full blocks of 16 of the 50 tokens
    cold = run(make(tiny, async_scheduling=False, enable_prefix_caching=False), [longer], params)[0]
    assert outputs([hit]) == outputs([cold])


def test_preemption_while_in_flight_matches_sync(tiny):
    ps = prompts(6, 40, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    a, b, eng = both(tiny, ps, params, kv_cache_memory=_budget_for_blocks(tiny, 12), max_num_seqs=6, max_model_len=160)
    assert eng.stats()["preemptions"] > 0
    assert outputs(a) == outputs(b)
    assert eng.stats()["blocks_used"] == 0 and eng.stats()["slots_free"] == 6


class _CountingGrammar:
    """A structured-output matcher that allows one token per step (a fixed sequence), ends
    after it, and checks that every mask is asked for after the previous token was accepted
    (async scheduling must not build step N+1's mask before step N's token is known)."""

    def __init__(self, sequence, vocab):
        self.sequence, self.vocab, self.accepted, self.masks = sequence, vocab, [], 0

    def allowed_mask(self, device):
        assert self.masks == len(self.accepted), "mask asked for before the previous token was accepted"
        self.masks += 1
        mask = torch.zeros(self.vocab, dtype=torch.bool, device=device)
        mask[self.sequence[len(self.accepted)]] = True
        return mask

    def accept(self, token):
        assert token == self.sequence[len(self.accepted)]
        self.accepted.append(token)
        return True

    def is_terminated(self):
        return len(self.accepted) == len(self.sequence)


def test_structured_output_masks_follow_the_accepted_tokens(tiny):
    eng = make(tiny, async_scheduling=True)
    vocab = eng.model_config.vocab_size
    seq = [101, 202, 303, 404]
    grammars = []
    def grammar():
        grammars.append(_CountingGrammar(seq, vocab))
        return grammars[-1]
    eng.add_request("g", prompts(1, 12, seed=1)[0], SamplingParams(temperature=0.7, max_tokens=50, seed=3), grammar=grammar)
    eng.add_request("free", prompts(1, 15, seed=2)[0], SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert done["g"].outputs[0].token_ids == seq and done["g"].outputs[0].finish_reason == "stop"
    assert len(done["free"].outputs[0].token_ids) == 9
    assert eng.stats()["blocks_used"] == 0
