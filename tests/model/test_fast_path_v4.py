"""V4-Flash on the fast path (device metadata and fixed shapes, dsv4.model.step) against the
golden reference and the reference path. On CPU the fast path runs its ops' torch code (tests/ops
checks the kernels against it), so this checks V4's fast-path logic: its unquantised caches,
the HCA selections (every visible entry), the overlapping, position-biased compressors and
their overlap state and tails across steps, chunk edges and prefix hits, padded decode
buckets."""

from __future__ import annotations

import pytest
import torch

from dsv4.cache.storage import QTensor
from dsv4.engine.cuda_graphs import DecodeGraphs
from dsv4.llm import LLM
from dsv4.model.model import fast_path_unsupported
from dsv4.ops import compressor as compressor_ops
from tests.model.test_fast_path import GREEDY, SHARED, _decode_batch, _prefill, golden_data, golden_llm

FOLDER = SHARED / "golden" / "v4-tiny-a"


def _llm(fast: bool | None, **options) -> LLM:
    return golden_llm(FOLDER, fast, **options)


@pytest.fixture(scope="module")
def ref():
    return golden_data(FOLDER)


@pytest.fixture(scope="module")
def fast():
    return _llm(True)


def _prompts(ref) -> list[list[int]]:
    return [ref[f"prompt{i}.input_ids"].tolist() for i in range(5)]


def test_the_golden_prompts_reach_every_v4_layer_kind(fast, ref):
    """The checks below mean something: the model has window, CSA and HCA layers, and the
    longest prompt completes many HCA entries and overlapping CSA windows."""
    cfg = fast.engine.model.cfg
    assert {r.kind for r in cfg.roles} >= {"window", "csa", "hca"}
    hca = max(r.compress_ratio for r in cfg.roles if r.kind == "hca")
    assert max(len(p) for p in _prompts(ref)) // hca >= 8


def test_prompt_logits_match_golden_and_reference_path(fast, ref):
    assert fast.engine.model.fast
    reference = _llm(False)
    assert not reference.engine.model.fast
    mine, theirs = fast.prompt_logits(_prompts(ref)), reference.prompt_logits(_prompts(ref))
    for i, (lg, other) in enumerate(zip(mine, theirs)):
        golden = ref[f"prompt{i}.prefill.logits"]
        assert (lg[:, ref["vocab_ids"]] - golden).abs().max() <= 5e-4, f"prompt{i} vs golden"
        assert (lg - other).abs().max() <= 5e-4, f"prompt{i} vs the reference path"
        assert torch.equal(lg.argmax(-1), ref[f"prompt{i}.prefill.argmax"]), f"prompt{i}: argmax differs"


def test_greedy_matches_golden_through_padded_decode(fast, ref):
    outs = fast.generate(_prompts(ref), GREEDY, use_tqdm=False)
    for i, out in enumerate(outs):
        assert out.token_ids == ref[f"prompt{i}.greedy.tokens"].tolist(), f"prompt{i}"
    assert fast.cache_stats()["blocks_used"] == 0


@pytest.mark.parametrize("bounded", [False, True])
def test_chunked_prefill_and_prefix_hits_match_the_reference_path(ref, bounded):
    """13-token chunks (compressor groups, tails and the overlap state cross chunk edges),
    then the same prompts again (prefix hits: the replay recomputes groups below the hit
    without rewriting them) — token for token what the reference path generates."""
    prompts = [ref["prompt4.input_ids"].tolist(), ref["prompt3.input_ids"].tolist()]
    options = dict(swa_bounded_replay=bounded, max_num_batched_tokens=13)
    runs = []
    for fast in (True, False):
        llm = _llm(fast, **options)
        first = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        again = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert llm.cache_stats()["prefix_hit_rate"] > 0
        runs.append((first, again))
    assert runs[0] == runs[1]
    assert runs[0][0] == [ref["prompt4.greedy.tokens"].tolist(), ref["prompt3.greedy.tokens"].tolist()]


def test_padded_bucket_equals_the_unpadded_step(fast, ref):
    """Decode rows padded to a bucket with capacity-wide block tables (HCA tables as wide as
    the capacity): the real rows' logits are those of the plain step."""
    eng = fast.engine
    seqs = [ref[f"prompt{i}.input_ids"].tolist() for i in (1, 2, 4)]
    _prefill(fast, seqs)
    batch = _decode_batch(fast, seqs)
    runner = DecodeGraphs(eng.model, eng.storage, max_blocks=40, sizes=(2, 8), use_graphs=False)
    assert runner.fits(batch) and runner.bucket(3) == 8
    padded = runner.run(batch)
    _prefill(fast, seqs)  # the decode step advanced the rings, tails and overlap state: rebuild them
    plain = eng.model.logits(eng.model.forward(batch, eng.storage))
    assert padded.shape == plain.shape
    assert (padded - plain).abs().max() <= 1e-4
    assert torch.equal(padded.argmax(-1), plain.argmax(-1))


def test_v4_takes_the_fast_path_by_default_where_it_can():
    """V4's config is one the fast path serves; the default picks it on CUDA in bf16 only."""
    llm = _llm(None)
    assert fast_path_unsupported(llm.engine.model.cfg) is None
    assert llm.engine.model.fast == (llm.engine.model.device.type == "cuda" and llm.engine.model.dtype == torch.bfloat16)


def test_v4_pooling_arguments_are_checked():
    r, w, rows = 4, 8, 3
    kv = torch.zeros(rows, 2 * w)
    tails = torch.zeros(2, r, 2 * w)
    meta = (torch.zeros(rows, dtype=torch.int32), torch.arange(rows), torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.int32),
            torch.ones(rows, dtype=torch.bool), torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), torch.zeros(1, 4, dtype=torch.int32))
    ckv = QTensor(values=torch.zeros(4, 4, w))
    call = lambda v4, ckv=ckv: compressor_ops.compress_entries(kv, kv.clone(), tails, tails.clone(), *meta, torch.ones(w), 1e-6,
                                                               torch.ones(rows, 2), torch.zeros(rows, 2), ckv, r, 16, torch.float32, v4=v4)
    prev = torch.zeros(2, r, w)
    with pytest.raises(ValueError, match="ape must be"):
        call(compressor_ops.V4Pooling(torch.zeros(r, w), True, prev, prev.clone(), torch.tensor([rows])))
    with pytest.raises(ValueError, match="prev_gate must be"):
        call(compressor_ops.V4Pooling(torch.zeros(r, 2 * w), True, prev, None, torch.tensor([rows])))
    with pytest.raises(ValueError, match="row count"):
        call(compressor_ops.V4Pooling(torch.zeros(r, 2 * w), True, prev, prev.clone(), None))
    with pytest.raises(ValueError, match="8-channel entries"):
        call(compressor_ops.V4Pooling(torch.zeros(r, 2 * w), True, prev, prev.clone(), torch.tensor([rows])),
             ckv=QTensor(values=torch.zeros(4, 4, 2 * w)))
    latent, _, _ = call(compressor_ops.V4Pooling(torch.zeros(r, 2 * w), True, prev, prev.clone(), torch.tensor([rows])))
    assert latent.shape == (rows, w)
