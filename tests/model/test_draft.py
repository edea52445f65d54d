"""Draft modules (V4 MTP, V4.1 DSpark) on tiny release-format checkpoints: they load, run on
the target's captured states, and have the structure MODEL.md 2.7 / 8 describes (bidirectional
block attention, no reads of the ring past p, a sequential Markov head). Also: the capture hook
leaves the target's forward bitwise unchanged."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dsv4.cache.storage import KVCacheStorage
from dsv4.config import load_config
from dsv4.model.batch import ForwardBatch
from dsv4.model.draft import DSparkDraft, MTPDraft, build_draft
from dsv4.model.make_tiny import write_tiny_checkpoint
from dsv4.model.model import Model
from dsv4.model.tokenizer import engram_token_map, load_tokenizer
from dsv4.model.weights import LoadedWeights, load_weights
from dsv4.ops.mhc import hc_head
from dsv4.ops.norm import rms_norm

SHARED = Path(os.environ.get("DSV4_SHARED", Path(__file__).resolve().parents[2] / ".." / "shared"))
DTYPE = torch.float32
PROMPT = torch.randint(1000, 120000, (12,), generator=torch.Generator().manual_seed(7)).tolist()


class Setup:
    def __init__(self, folder: Path):
        self.cfg = cfg = load_config(folder)
        self.weights = load_weights(folder, cfg, dtype=DTYPE, progress=False)
        token_map = engram_token_map(load_tokenizer(folder)) if cfg.engram_layer_ids else None
        self.model = Model(cfg, self.weights.tensors, dtype=DTYPE, token_map=token_map)
        self.storage = KVCacheStorage(cfg, num_slots=1, num_blocks=4, block_size=16, dtype=DTYPE)

    def forward(self, ids: list[int], capture: dict | None = None) -> torch.Tensor:
        batch = ForwardBatch(
            input_ids=torch.tensor(ids), positions=torch.arange(len(ids)), start_pos=[0], num_tokens=[len(ids)],
            slots=[0], block_tables=torch.arange(4).unsqueeze(0), prev_tokens=torch.full((1, 3), -1), capture=capture,
        )
        return self.model.forward(batch, self.storage)


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    return Setup(write_tiny_checkpoint(tmp_path_factory.mktemp("v4"), "v4"))


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("v41"), "v41", config_overrides={"num_nextn_predict_layers": 3})
    return Setup(folder)


# ------------------------------------------------------------------------------ capture


@pytest.mark.parametrize("arch", ["v4", "v41"])
def test_capture_leaves_forward_bitwise_unchanged(arch, request):
    s = request.getfixturevalue(arch)
    plain = s.forward(PROMPT)
    capture: dict = {}
    captured = s.forward(PROMPT, capture)
    assert torch.equal(plain, captured)
    streams = capture["final_streams"]
    assert streams.shape == (len(PROMPT), s.cfg.hc_mult, s.cfg.hidden_size)
    if arch == "v4":  # the captured streams are exactly what the final hc_head collapses
        fn, base, scale = s.model.hc_head
        final = rms_norm(hc_head(streams, fn, base, scale, s.cfg.hc_eps, s.cfg.rms_norm_eps), s.model.final_norm, s.cfg.rms_norm_eps, True)
        assert torch.equal(final, plain)
        assert "dspark" not in capture
    else:
        assert sorted(capture["dspark"]) == sorted(s.cfg.dspark_target_layer_ids)
        assert all(m.shape == (len(PROMPT), s.cfg.hidden_size) for m in capture["dspark"].values())


# ------------------------------------------------------------------------------ V4 MTP


def test_v4_mtp_runs_on_the_target_streams(v4):
    draft = build_draft(v4.cfg, v4.weights, v4.model.rope, DTYPE)
    assert isinstance(draft, MTPDraft)
    capture: dict = {}
    v4.forward(PROMPT, capture)
    n = len(PROMPT) - 1  # position t reads token t+1
    ids, pos, streams = torch.tensor(PROMPT[1:]), torch.arange(n), capture["final_streams"][:n]

    logits = draft.forward(ids, pos, streams, [0], [n], [0])
    assert logits.shape == (n, v4.cfg.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert torch.equal(draft.forward(ids, pos, streams, [0], [n], [0]), logits)

    # its own ring: the same positions in two chunks give the same logits
    k = 5
    first = draft.forward(ids[:k], pos[:k], streams[:k], [0], [k], [0])
    rest = draft.forward(ids[k:], pos[k:], streams[k:], [k], [n - k], [0])
    assert torch.equal(torch.cat([first, rest]), logits)

    # the target's streams are an input: changing them at the last position changes its logits
    moved = streams.clone()
    moved[-1] += torch.randn(moved[-1].shape, generator=torch.Generator().manual_seed(1))
    other = draft.forward(ids, pos, moved, [0], [n], [0])
    assert torch.equal(other[:-1], logits[:-1]) and not torch.allclose(other[-1], logits[-1])


# ------------------------------------------------------------------------------ V4.1 DSpark


@pytest.fixture(scope="module")
def dspark(v41):
    draft = build_draft(v41.cfg, v41.weights, v41.model.rope, DTYPE, num_slots=2)
    assert isinstance(draft, DSparkDraft) and len(draft.stages) == 3
    capture: dict = {}
    hidden = v41.forward(PROMPT, capture)
    main_x = draft.main_x(capture["dspark"])
    anchor = int(v41.model.logits(hidden[-1:]).argmax())
    return draft, main_x, anchor


def test_dspark_draft_shapes_and_determinism(v41, dspark):
    draft, main_x, anchor = dspark
    n, b = len(PROMPT), v41.cfg.dspark_block_size
    assert main_x.shape == (n, v41.cfg.hidden_size)
    draft.prefill(main_x, torch.arange(n))
    out = draft.draft(anchor, n - 1, main_x[-1])
    assert out.tokens.shape == (b,) and out.tokens.dtype == torch.long
    assert out.confidence.shape == (b,) and out.confidence.dtype == torch.float32
    assert out.logits.shape == (b, v41.cfg.vocab_size) and torch.isfinite(out.logits).all()
    assert torch.isfinite(out.confidence).all()
    again = draft.draft(anchor, n - 1, main_x[-1])
    assert all(torch.equal(x, y) for x, y in zip(out, again))
    assert torch.equal(out.tokens, out.logits.argmax(-1))


def test_dspark_block_attention_is_bidirectional(v41, dspark):
    draft, main_x, anchor = dspark
    p = len(PROMPT) - 1
    draft.prefill(main_x, torch.arange(p + 1))
    ids = draft.block_ids(anchor)
    base = draft.block_hidden(ids, p, main_x[p])
    changed = ids.clone()
    changed[-1] = 4242  # the last noise slot
    other = draft.block_hidden(changed, p, main_x[p])
    assert not torch.allclose(other[0], base[0])  # slot 0 sees the last slot


def test_dspark_never_reads_ring_entries_past_p(v41, dspark):
    """Slot 0's ring also holds positions p+1, p+2 (window 8 > 6 positions: nothing aliases);
    slot 1's ring stops at p-1. The draft at p must not see the difference."""
    draft, main_x, anchor = dspark
    p = 3
    draft.prefill(main_x[:6], torch.arange(6), slot=0)
    draft.prefill(main_x[:p], torch.arange(p), slot=1)
    a = draft.draft(anchor, p, main_x[p], slot=0)
    b = draft.draft(anchor, p, main_x[p], slot=1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    # while the ring at or below p does matter (kv_norm makes a plain rescale invisible)
    draft.prefill(main_x[4:6], torch.arange(1, p), slot=1)
    assert not torch.equal(draft.draft(anchor, p, main_x[p], slot=1).logits, a.logits)


def test_dspark_markov_head_is_sequential(v41, dspark):
    """Drafted token j feeds slot j+1's Markov correction: rewriting token 0's Markov embedding
    to point at a chosen token X makes draft token 1 = X and leaves slot 0 alone."""
    draft, main_x, anchor = dspark
    p = len(PROMPT) - 1
    draft.prefill(main_x, torch.arange(p + 1))
    out = draft.draft(anchor, p, main_x[p])
    tok0 = int(out.tokens[0])
    if tok0 == anchor:
        pytest.skip("token 0 repeats the anchor; slot 0 would see the edit too")
    x = int(draft.markov_head.norm(dim=-1).argmax())  # largest head row: wins by Cauchy-Schwarz
    saved = draft.markov_embed
    try:
        draft.markov_embed = saved.clone()
        draft.markov_embed[tok0] = draft.markov_head[x] * 1e4
        edited = draft.draft(anchor, p, main_x[p])
    finally:
        draft.markov_embed = saved
    assert int(edited.tokens[0]) == tok0 and torch.equal(edited.logits[0], out.logits[0])
    assert torch.equal(edited.confidence[0], out.confidence[0])
    assert int(edited.tokens[1]) == x and edited.confidence[1] != out.confidence[1]


def test_dspark_sampling_uses_the_generator(v41, dspark):
    draft, main_x, anchor = dspark
    p = len(PROMPT) - 1
    draft.prefill(main_x, torch.arange(p + 1))
    a = draft.draft(anchor, p, main_x[p], greedy=False, generator=torch.Generator().manual_seed(3))
    b = draft.draft(anchor, p, main_x[p], greedy=False, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.tokens, b.tokens)


# ------------------------------------------------------------------------------ loading


def test_golden_v41_sets_have_no_draft():
    folder = SHARED / "golden" / "v41-tiny-a"
    if not folder.is_dir():
        pytest.skip("golden sets not found (set DSV4_SHARED)")
    cfg = load_config(folder)
    weights = load_weights(folder, cfg, dtype=DTYPE, progress=False)
    assert weights.draft_stages == 0
    assert build_draft(cfg, weights, None, DTYPE) is None


def test_partial_dspark_stages_give_no_draft(v41):
    partial = LoadedWeights(v41.weights.tensors, draft_stages=2)
    with pytest.warns(UserWarning, match="2 of 3 DSpark stages"):
        assert build_draft(v41.cfg, partial, v41.model.rope, DTYPE) is None
