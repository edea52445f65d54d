"""The graph-safe indexer ops (`dsv4.ops.indexer`): torch references against a naive per-row
definition and against the model's current selection code, then the Triton kernels against
the references on random non-zero inputs at small shapes (on CPU in Triton's interpreter,
TRITON_INTERPRET=1 set by conftest.py; compiled with CUDA). Ragged lengths include 0, k beyond
the length, many exact ties (ReLU zeros, +-0), widths that are not a multiple of any tile, rows
of different requests; a row's result must be the same bits alone and in a batch. Scores are
checked with V4.1's FP4 keys (32 heads) and V4-Flash's bf16 keys (64 heads).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dsv4.model import quant
from dsv4.model.layers.attention import Attention, topk_lowest_index_on_ties
from dsv4.ops import indexer as ops

try:
    import triton  # noqa: F401

    from dsv4.ops.triton import indexer as tk
except ImportError:
    tk = None
needs_triton = pytest.mark.skipif(tk is None, reason="triton is not installed (pip install triton)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: tests/ops/conftest.py set TRITON_INTERPRET=1
REPO = Path(__file__).resolve().parents[2]
SCORE_TOL = 1e-5  # of the row's largest |score|: the kernel adds in another order


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _dev(*xs):
    return [x.to(DEVICE) if isinstance(x, torch.Tensor) else x for x in xs]


# ----------------------------------------------------------------------------------- scores


def _score_case(seed: int, *, heads: int, dk: int, per_block: int, entries_of: list[int], lengths: list[int], row_req: list[int], width: int,
                with_entries: bool, exponents: tuple[int, int] = (-3, 4), raw_keys: bool = False):
    """Random indexer keys in shuffled blocks, each 32-channel block's magnitude 2**e for e in
    `exponents`: FP4 (V4.1: codes, scale bytes about 125 + e, FP4-rounded queries) or with
    `raw_keys` bf16 (V4-Flash: the keys as codes, scales None, bf16 queries); `entries_of[b]`:
    entries request b holds. Returns the argument list of `index_scores` (entries None unless
    `with_entries`: then each row scores a random list of its request's entries, with repeats
    and -1 holes)."""
    g = _gen(seed)
    n_req = len(entries_of)
    max_blocks = max(-(-n // per_block) for n in entries_of)
    n_blocks = n_req * max_blocks + 3
    magnitude = torch.exp2(torch.randint(*exponents, (n_blocks, per_block, dk // 32), generator=g).float()).repeat_interleave(32, -1)
    keys = torch.randn(n_blocks, per_block, dk, generator=g) * magnitude
    codes, scales = (keys.bfloat16(), None) if raw_keys else quant.quantize_fp4(keys, 32, e4m3_scale=False)
    order = torch.randperm(n_blocks, generator=g)
    block_tables = order[: n_req * max_blocks].view(n_req, max_blocks).to(torch.int32)
    t = len(lengths)
    q = torch.randn(t, heads, dk, generator=g) * 2
    q = (q if raw_keys else quant.fake_quant_fp4(q, 32, e4m3_scale=False)).bfloat16()
    weights = torch.randn(t, heads, generator=g) * heads**-0.5
    req = torch.tensor(row_req)
    entries = None
    if with_entries:
        n_own = torch.tensor(entries_of)[req]
        entries = (torch.rand(t, width, generator=g) * n_own.unsqueeze(1)).long()
        entries = torch.where(torch.rand(t, width, generator=g) < 0.15, -1, entries)
    return [q, weights, codes, scales, block_tables, req, torch.tensor(lengths), per_block, width, entries]


def _naive_scores(q, weights, codes, scales, block_tables, row_req, lengths, per_block, width, entries):
    """Row by row from the definition, in float64: sum_h relu(q_h . key) * Dk**-0.5 * w_h."""
    t, _, dk = q.shape
    out = torch.full((t, width), float("-inf"), dtype=torch.float64)
    for r in range(t):
        n = min(int(lengths[r]), width)
        ent = torch.arange(n) if entries is None else entries[r, :n]
        ok = ent >= 0
        e = ent[ok]
        blocks = block_tables[int(row_req[r])].long()[e // per_block]
        if scales is None:  # bf16 keys
            keys = codes[blocks, e % per_block].double()
        else:
            keys = quant.dequantize_fp4(codes[blocks, e % per_block], scales[blocks, e % per_block], torch.float64, 32)
        per_head = (q[r].double() @ keys.T).relu() * dk**-0.5 * weights[r].double().unsqueeze(1)
        row = torch.full((n,), float("-inf"), dtype=torch.float64)
        row[ok] = per_head.sum(0)
        out[r, :n] = row
    return out


def _assert_scores_close(y, ref, lengths):
    """Columns < lengths: -inf in the same places, finite ones within SCORE_TOL of the row max."""
    y, ref = y.double().cpu(), ref.double().cpu()
    for r in range(ref.shape[0]):
        n = min(int(lengths[r]), ref.shape[1])
        a, b = y[r, :n], ref[r, :n]
        assert torch.equal(torch.isneginf(a), torch.isneginf(b)), f"row {r}: -inf columns differ"
        fin = torch.isfinite(b)
        if fin.any():
            scale = b[fin].abs().max().clamp_min(1e-30)
            assert (a[fin] - b[fin]).abs().max() <= SCORE_TOL * scale, f"row {r}"


def _row_alone(args, r):
    """The `index_scores` arguments of row r on its own (same cache and block tables)."""
    q, weights, codes, scales, block_tables, req, lengths, per_block, width, entries = args
    one = slice(r, r + 1)
    return [q[one], weights[one], codes, scales, block_tables, req[one], lengths[one], per_block, width, None if entries is None else entries[one]]


SCORE_CASES = {
    # three requests of different sizes; lengths 0, one column, around the 64-column tile, the
    # full width (not a multiple of 64); 12 heads (padded to 16), Dk 64 (two scale blocks);
    # blocks of 16 entries: a tile's keys are gathered entry by entry
    "ragged": dict(heads=12, dk=64, per_block=16, entries_of=[150, 70, 200], lengths=[0, 1, 63, 64, 65, 150, 70, 200, 129],
                   row_req=[0, 0, 0, 2, 2, 0, 1, 2, 2], width=200, with_entries=False),
    # blocks of 128 entries (two tiles): each tile reads one contiguous run of keys
    "contiguous": dict(heads=16, dk=128, per_block=128, entries_of=[190, 100], lengths=[190, 0, 64, 100, 129, 1],
                       row_req=[0, 1, 0, 1, 0, 1], width=190, with_entries=False),
    # each row scores its own list of entries (repeats, -1 holes), Dk 128 as in V4.1
    "entries": dict(heads=16, dk=128, per_block=32, entries_of=[300, 90], lengths=[130, 0, 77, 130, 5],
                    row_req=[0, 1, 1, 0, 0], width=130, with_entries=True),
    # a prefill chunk after two rows of another request: with 4 rows a program, rows 4-7 share
    # their key tiles, rows 0-3 (two requests) and 8-10 (past the end) are scored one by one;
    # causal lengths, 32 heads as in V4.1
    "prefill": dict(heads=32, dk=128, per_block=128, entries_of=[60, 300], lengths=[60, 1] + list(range(292, 301)),
                    row_req=[0, 0] + [1] * 9, width=300, with_entries=False),
    # scale bytes far above 128 and far below 127 (the exact two-multiply dequantisation)
    "scales": dict(heads=16, dk=128, per_block=64, entries_of=[130], lengths=[130, 77, 130, 129], row_req=[0, 0, 0, 0], width=130,
                   with_entries=False, exponents=(-100, 100)),
    # V4-Flash: bf16 keys, 64 heads, Dk 128, ratio 4's 64 entries a block (a tile spans two
    # blocks: gathered). Grouped, 64 heads stack 2 rows a program (N = 128, `scores_rows`): rows
    # 2-3 share their tiles, rows 0-1 and 4-5 (two requests) and 6 (past the end) go one by one
    "v4_prefill": dict(heads=64, dk=128, per_block=64, entries_of=[60, 200], lengths=[60, 190, 191, 192, 193, 1, 200],
                       row_req=[0, 1, 1, 1, 1, 0, 1], width=200, with_entries=False, raw_keys=True),
    # bf16 keys in blocks of 128 entries (a tile is one contiguous run); 40 heads (padded to 64)
    "v4_contiguous": dict(heads=40, dk=128, per_block=128, entries_of=[190, 100], lengths=[190, 0, 129, 100], row_req=[0, 1, 0, 1],
                          width=190, with_entries=False, raw_keys=True),
    # bf16 keys, each row its own list of entries (repeats, -1 holes)
    "v4_entries": dict(heads=64, dk=128, per_block=64, entries_of=[300, 90], lengths=[130, 0, 77, 5], row_req=[0, 1, 1, 0], width=130,
                       with_entries=True, raw_keys=True),
}


@pytest.mark.parametrize("case", SCORE_CASES)
def test_index_scores_reference_matches_definition(case):
    args = _score_case(1, **SCORE_CASES[case])
    ref = ops.index_scores_reference(*args)
    naive = _naive_scores(*args)
    assert ref.dtype == torch.float32 and ref.shape == naive.shape
    _assert_scores_close(ref, naive, args[6])
    assert torch.isneginf(ref[torch.arange(ref.shape[1]) >= args[6].unsqueeze(1)]).all()
    # the CPU dispatch is the reference, and a row alone has the bits it has in the batch
    assert torch.equal(ops.index_scores(*args), ref)
    for r in (2, len(args[6]) - 1):
        assert torch.equal(ops.index_scores_reference(*_row_alone(args, r))[0], ref[r])


@needs_triton
@pytest.mark.parametrize("grouped", [False, True], ids=["row_a_program", "rows_grouped"])
@pytest.mark.parametrize("case", SCORE_CASES)
def test_index_scores_kernel_matches_reference(case, grouped, monkeypatch):
    if grouped:  # the prefill path at these small T: 4 rows a program (2 at 64 heads), sharing tiles within a request
        monkeypatch.setattr(tk, "SCORES_CONFIG", dict(tk.SCORES_CONFIG, ROWS=4, ROWS_MIN_T=1))
    args = _score_case(1, **SCORE_CASES[case])
    ref = ops.index_scores_reference(*args)
    y = tk.index_scores(*_dev(*args))
    assert y.dtype == torch.float32 and y.shape == ref.shape
    _assert_scores_close(y, ref, args[6])
    # batch invariance: a row alone (one row: its columns split over more programs, no rows
    # sharing its tiles) has the bits it has in the batch
    for r in sorted({2, min(5, len(args[6]) - 1), len(args[6]) - 1}):
        n = int(args[6][r])
        alone = tk.index_scores(*_dev(*_row_alone(args, r)))
        assert torch.equal(alone[0, :n], y[r, :n])


@needs_triton
@pytest.mark.parametrize("raw_keys", [False, True], ids=["fp4_keys", "bf16_keys"])
def test_index_scores_kernel_fp32_query_and_int64_metadata(raw_keys):
    """fp32 q holding bf16 values and int64 tables give the bf16 / int32 result."""
    args = _score_case(2, **dict(SCORE_CASES["ragged"], lengths=[17, 200, 90], row_req=[1, 2, 0], raw_keys=raw_keys))
    y = tk.index_scores(*_dev(*args))
    wide = list(args)
    wide[0], wide[4] = args[0].float(), args[4].long()
    written = (torch.arange(args[8]) < args[6].unsqueeze(1)).to(DEVICE)  # the rest is unwritten
    assert torch.equal(tk.index_scores(*_dev(*wide))[written], y[written])


class _Launches:
    """Stands in for a kernel: records each launch's grid and constexprs, runs nothing."""

    def __init__(self):
        self.seen = []

    def __getitem__(self, grid):
        return lambda *args, **consts: self.seen.append((grid, consts))


@needs_triton
def test_index_scores_rows_a_program_keep_the_stacked_n_within_128(monkeypatch):
    """The rows a program stacks as the product's N (from ROWS_MIN_T rows, no entry lists) are
    as many as fit 128 columns of rows x heads padded to a power of two, at most ROWS, with
    either key format (a 128 x 256 fp32 accumulator spills on sm_90): V4.1's 32 heads keep 4
    rows, V4's 64 heads take 2. Launches are recorded, not run."""
    launches = _Launches()
    monkeypatch.setattr(tk, "_index_scores_kernel", launches)
    cfg = tk.SCORES_CONFIG
    t = cfg["ROWS_MIN_T"]
    stacked = {}
    for heads in (12, 32, 40, 64, 128):
        padded = max(16, 1 << (heads - 1).bit_length())
        stacked[heads] = max(r for r in (1, 2, 4, 8, 16) if r <= cfg["ROWS"] and r * padded <= 128)
        for raw_keys in (False, True):
            case = dict(SCORE_CASES["ragged"], heads=heads, dk=128, lengths=[1] * t, row_req=[0] * t, with_entries=True, raw_keys=raw_keys)
            with_entries = _score_case(5, **case)
            plain = with_entries[:9] + [None]
            fewer_rows = [a[1:] if i in (0, 1, 5, 6) else a for i, a in enumerate(plain)]
            for args, rows in ((plain, stacked[heads]), (fewer_rows, 1), (with_entries, 1)):
                tk.index_scores(*_dev(*args))
                grid, consts = launches.seen.pop()
                n_rows = len(args[6])
                assert (consts["ROWS"], grid[0], consts["BLOCK_H"], consts["RAW_KEYS"]) == (rows, -(-n_rows // rows), padded, raw_keys), \
                    (heads, raw_keys, n_rows, args[9] is not None)
    assert cfg["ROWS"] == 4 and stacked[32] == 4 and stacked[64] == 2


# ----------------------------------------------------------------------------------- block max


def _naive_block_max(scores, lengths, block):
    t, width = scores.shape
    out = torch.full((t, -(-width // block)), float("-inf"))
    for r in range(t):
        n = min(int(lengths[r]), width)
        for i in range(-(-n // block)):
            out[r, i] = float("inf") if i == (n - 1) // block else scores[r, i * block : min((i + 1) * block, n)].max()
    return out


def _tie_scores(seed: int, t: int, width: int) -> torch.Tensor:
    """Scores full of exact ties: ReLU-like zeros of both signs, a coarse grid of repeated
    values, a few -inf and +inf."""
    g = _gen(seed)
    s = torch.randn(t, width, generator=g)
    s = torch.where(torch.rand(t, width, generator=g) < 0.4, (s * 4).round() / 4, s)  # repeated values
    s = torch.where(s < -0.3, 0.0, s)
    s = torch.where(torch.rand(t, width, generator=g) < 0.1, -0.0, s)
    s = torch.where(torch.rand(t, width, generator=g) < 0.05, float("-inf"), s)
    return torch.where(torch.rand(t, width, generator=g) < 0.01, float("inf"), s)


BLOCK_LENGTHS = [0, 1, 8, 9, 300, 1000, 1021, 517]  # width 1021: not a multiple of 8 or of any tile


def test_block_max_reference_matches_definition_and_candidates():
    scores = _tie_scores(3, len(BLOCK_LENGTHS), 1021)
    lengths = torch.tensor(BLOCK_LENGTHS)
    ref = ops.block_max_reference(scores, lengths, 8)
    assert torch.equal(ref, _naive_block_max(scores, lengths, 8))
    assert torch.equal(ops.block_max(scores, lengths, 8), ref)
    # level one end to end: block_max + topk_ascending keep the blocks `Attention._candidates`
    # keeps (fed what `select` feeds it: -inf past the visible entries)
    n_keep = 20
    fake = SimpleNamespace(cfg=SimpleNamespace(candidate_block_size=8, candidate_topk_blocks=n_keep))
    visible = scores.masked_fill(torch.arange(1021) >= lengths.unsqueeze(1), float("-inf"))
    _, kept = Attention._candidates(fake, visible, torch.div(lengths - 1, 8, rounding_mode="floor"))
    expected = torch.where(kept >= 0, kept, 1 << 30).sort(-1).values
    expected = torch.where(expected < 1 << 30, expected, -1)
    picked = ops.topk_ascending_reference(ref, torch.div(lengths + 7, 8, rounding_mode="floor"), n_keep)
    assert torch.equal(picked.long(), expected)


@needs_triton
def test_block_max_kernel_matches_reference():
    scores = _tie_scores(3, len(BLOCK_LENGTHS), 1021)
    lengths = torch.tensor(BLOCK_LENGTHS)
    for block in (8, 32):
        ref = ops.block_max_reference(scores, lengths, block)
        y = tk.block_max(*_dev(scores, lengths), block).cpu()
        written = torch.arange(ref.shape[1]) < torch.div(lengths + block - 1, block, rounding_mode="floor").unsqueeze(1)
        assert torch.equal(y[written], ref[written])
        for r in (4, 6):
            alone = tk.block_max(*_dev(scores[r : r + 1], lengths[r : r + 1]), block).cpu()
            assert torch.equal(alone[0][written[r]], y[r][written[r]])


# ----------------------------------------------------------------------------------- top-k


def _naive_topk(scores, lengths, k):
    """Per row: columns ordered by (score descending, column ascending), -inf dropped, the
    first k, ascending, -1 padded."""
    out = torch.full((scores.shape[0], k), -1, dtype=torch.int32)
    for r in range(scores.shape[0]):
        row = scores[r, : min(int(lengths[r]), scores.shape[1])].tolist()
        cols = sorted((c for c, v in enumerate(row) if v > float("-inf")), key=lambda c: (-row[c], c))[:k]
        out[r, : len(cols)] = torch.tensor(sorted(cols), dtype=torch.int32)
    return out


def _model_topk(scores, lengths, k):
    """The selection `Attention.select` makes today on scores that are -inf past the visible
    entries: `topk_lowest_index_on_ties`, picks of -inf dropped, ascending, -1 padded."""
    t, width = scores.shape
    visible = scores.masked_fill(torch.arange(width) >= lengths.unsqueeze(1), float("-inf"))
    top = topk_lowest_index_on_ties(visible, min(k, width))
    picks = torch.where(top.values > float("-inf"), top.indices, width).sort(dim=-1).values
    picks = torch.where(picks < width, picks, -1)
    return torch.nn.functional.pad(picks, (0, k - picks.shape[1]), value=-1).to(torch.int32)


def _radix_scores(seed: int, t: int, width: int) -> torch.Tensor:
    """Rows whose values share their top 8, 16 or 24 bits (every radix pass decides), plus
    extremes: +-3e38, subnormals, negatives, -inf."""
    g = _gen(seed)
    base = torch.tensor([1.0, -2.0, 3e38, 1e-40])[torch.arange(t) % 4].unsqueeze(1)
    steps = torch.randint(0, 1 << 12, (t, width), generator=g, dtype=torch.int32)
    bits = base.view(torch.int32) + torch.where(torch.arange(t).unsqueeze(1) % 2 == 0, steps, steps >> 6)
    s = bits.view(torch.float32)
    s = torch.where(torch.rand(t, width, generator=g) < 0.05, -3e38, s)
    return torch.where(torch.rand(t, width, generator=g) < 0.05, float("-inf"), s)


TOPK_LENGTHS = [0, 5, 40, 41, 2500, 2000, 1500, 2500, 1]  # width 2500: 3 tiles of 1024, the last partial


@pytest.mark.parametrize("k", [1, 40, 700, 3000])
def test_topk_reference_matches_definition_and_model(k):
    lengths = torch.tensor(TOPK_LENGTHS)
    for scores in (_tie_scores(5, len(TOPK_LENGTHS), 2500), _radix_scores(6, len(TOPK_LENGTHS), 2500)):
        ref = ops.topk_ascending_reference(scores, lengths, k)
        assert ref.dtype == torch.int32 and ref.shape == (len(TOPK_LENGTHS), k)
        assert torch.equal(ref, _model_topk(scores, lengths, k))
        if k <= 40:  # the Python definition is slow on long rows
            assert torch.equal(ref, _naive_topk(scores, lengths, k))
        assert torch.equal(ops.topk_ascending(scores, lengths, k), ref)


def test_topk_naive_definition_on_short_rows():
    lengths = torch.tensor([0, 3, 17, 30, 30])
    for scores in (_tie_scores(7, 5, 30), _radix_scores(8, 5, 30)):
        for k in (1, 4, 17, 40):
            assert torch.equal(ops.topk_ascending_reference(scores, lengths, k), _naive_topk(scores, lengths, k))


# the two ways a program reads its columns: kept in registers through the passes (RESIDENT_MAX
# above the row), or re-read tile by tile each pass (0: never resident; BLOCK 1024 makes the
# 2500-column rows 3 tiles, the last partial); and digits of other widths than the default 5
# bits (whose last pass decides 2)
TOPK_READS = {"resident": {}, "streamed": {"RESIDENT_MAX": 0, "BLOCK": 1024}, "resident 8-bit": {"DIGIT_BITS": 8},
              "streamed 4-bit": {"RESIDENT_MAX": 0, "BLOCK": 1024, "DIGIT_BITS": 4}}


@needs_triton
@pytest.mark.parametrize("reads", TOPK_READS)
@pytest.mark.parametrize("k", [1, 40, 700, 3000])
def test_topk_kernel_matches_reference(monkeypatch, k, reads):
    monkeypatch.setattr(tk, "TOPK_CONFIG", dict(tk.TOPK_CONFIG, **TOPK_READS[reads]))
    monkeypatch.setattr(tk, "num_sms", lambda device: 16)  # a batch of 9 rows: one wave
    assert tk.topk_plan(len(TOPK_LENGTHS), 2500, k, torch.device(DEVICE)) == (2500, 1, reads.startswith("resident"))
    lengths = torch.tensor(TOPK_LENGTHS)
    for scores in (_tie_scores(5, len(TOPK_LENGTHS), 2500), _radix_scores(6, len(TOPK_LENGTHS), 2500)):
        ref = ops.topk_ascending_reference(scores, lengths, k)
        y = tk.topk_ascending(*_dev(scores, lengths), k)
        assert y.dtype == torch.int32 and torch.equal(y.cpu(), ref)
    for r in (4, 5):  # batch invariance (exact by construction: the result is a set)
        alone = tk.topk_ascending(*_dev(scores[r : r + 1], lengths[r : r + 1]), k)
        assert torch.equal(alone.cpu()[0], ref[r])


# split rows: chunks re-read each pass (CHUNK 512), or resident chunks of RESIDENT_MAX 1024
# where the merge fits one tile (k 1 and 40: 3 chunks; at k 700 the plan falls back to CHUNK)
TOPK_SPLITS = {"streamed": {"BLOCK": 256, "CHUNK": 512, "RESIDENT_MAX": 0},
               "resident": {"BLOCK": 256, "CHUNK": 2048, "RESIDENT_MAX": 1024}}


@needs_triton
@pytest.mark.parametrize("split", TOPK_SPLITS)
@pytest.mark.parametrize("chunk_per_k,k", [(2, 40), (0, 700)])
def test_topk_kernel_split_rows(monkeypatch, chunk_per_k, k, split):
    """Rows split into chunks (stage 1) and merged (stage 2): chunks longer than k, and chunks
    shorter than k (every pickable column of a chunk is a candidate)."""
    monkeypatch.setattr(tk, "TOPK_CONFIG", dict(tk.TOPK_CONFIG, CHUNK_PER_K=chunk_per_k, **TOPK_SPLITS[split]))
    monkeypatch.setattr(tk, "num_sms", lambda device: 1000)  # a "small" batch whatever its size
    lengths = torch.tensor(TOPK_LENGTHS)
    _, chunks, resident = tk.topk_plan(len(TOPK_LENGTHS), 2500, k, torch.device(DEVICE))
    assert chunks > 1 and resident == (split == "resident" and k == 40)
    for scores in (_tie_scores(9, len(TOPK_LENGTHS), 2500), _radix_scores(10, len(TOPK_LENGTHS), 2500)):
        ref = ops.topk_ascending_reference(scores, lengths, k)
        assert torch.equal(tk.topk_ascending(*_dev(scores, lengths), k).cpu(), ref)


@needs_triton
def test_topk_plan_resident_where_the_programs_fit_one_wave(monkeypatch):
    """Resident reads where the call's programs fit one wave: whole rows up to RESIDENT_MAX,
    or small batches split into RESIDENT_MAX chunks whose merge fits one tile too; else the
    tiles are re-read each pass (small batches in CHUNK columns). The selection is the same
    either way."""
    monkeypatch.setattr(tk, "num_sms", lambda device: 132)
    cpu = torch.device("cpu")
    assert tk.topk_plan(1, 8192, 512, cpu) == (8192, 1, True)  # batch-1 decode at 8K
    assert tk.topk_plan(1, 32768, 512, cpu) == (8192, 4, True)  # the merge: 2048 candidates
    assert tk.topk_plan(64, 16384, 512, cpu) == (8192, 2, True)  # 128 programs
    assert tk.topk_plan(64, 65536, 512, cpu) == (16384, 4, False)  # 512 programs: more than one wave
    assert tk.topk_plan(1, 524288, 512, cpu) == (16384, 32, False)  # a merge of 64 x 512 would not fit
    assert tk.topk_plan(1, 32768, 2048, cpu) == (16384, 2, False)  # CHUNK_PER_K x k is the longer
    assert tk.topk_plan(132, 8192, 512, cpu) == (8192, 1, False)  # a row a program fills the SMs
    assert tk.topk_tiles(8192, True) == {"BLOCK": 8192, "RESIDENT": True, "num_warps": 16}  # 16 columns a thread
    assert tk.topk_tiles(1000, True) == {"BLOCK": 2048, "RESIDENT": True, "num_warps": 8}
    assert tk.topk_tiles(8192, False) == {"BLOCK": 2048, "RESIDENT": False, "num_warps": 8}
    monkeypatch.setattr(tk, "TOPK_CONFIG", dict(tk.TOPK_CONFIG, BLOCK=256, CHUNK=2048, CHUNK_PER_K=2, RESIDENT_MAX=1024))
    monkeypatch.setattr(tk, "num_sms", lambda device: 1000)
    lengths = torch.tensor(TOPK_LENGTHS)
    assert tk.topk_plan(len(TOPK_LENGTHS), 2500, 40, torch.device(DEVICE)) == (1024, 3, True)
    for scores in (_tie_scores(12, len(TOPK_LENGTHS), 2500), _radix_scores(13, len(TOPK_LENGTHS), 2500)):
        assert torch.equal(tk.topk_ascending(*_dev(scores, lengths), 40).cpu(), ops.topk_ascending_reference(scores, lengths, 40))


@pytest.mark.parametrize("k", [1, 40, 700])
def test_topk_labels_are_the_picked_columns_labels(k):
    """labels: each pick's label instead of its column, the -1 padding kept (kernel: one
    program per row and split rows)."""
    lengths = torch.tensor(TOPK_LENGTHS)
    scores = _radix_scores(11, len(TOPK_LENGTHS), 2500)
    labels = (torch.arange(2500) * 3 + 7).int().expand(len(TOPK_LENGTHS), -1) + torch.arange(len(TOPK_LENGTHS)).int()[:, None] * 10000
    cols = ops.topk_ascending_reference(scores, lengths, k).long()
    want = torch.where(cols >= 0, labels.long().gather(1, cols.clamp_min(0)), -1).int()
    assert torch.equal(ops.topk_ascending_reference(scores, lengths, k, labels), want)
    assert (want >= 0).any() and (want < 0).any()
    if tk is None:
        return
    device = torch.device(DEVICE)
    for reads in TOPK_READS.values():  # one program per row
        with pytest.MonkeyPatch.context() as m:
            m.setattr(tk, "TOPK_CONFIG", dict(tk.TOPK_CONFIG, **reads))
            m.setattr(tk, "num_sms", lambda device: 16)
            assert tk.topk_plan(len(TOPK_LENGTHS), 2500, k, device)[1] == 1
            assert torch.equal(tk.topk_ascending(*_dev(scores, lengths), k, _dev(labels.contiguous())[0]).cpu(), want)
    for split in TOPK_SPLITS.values():  # split rows: the labels are read in stage 2
        with pytest.MonkeyPatch.context() as m:
            m.setattr(tk, "TOPK_CONFIG", dict(tk.TOPK_CONFIG, CHUNK_PER_K=2, **split))
            m.setattr(tk, "num_sms", lambda device: 1000)
            assert tk.topk_plan(len(TOPK_LENGTHS), 2500, k, device)[1] > 1
            assert torch.equal(tk.topk_ascending(*_dev(scores, lengths), k, _dev(labels.contiguous())[0]).cpu(), want)


def test_pool_entries_reference_matches_definition():
    cand = torch.tensor([[0, 2, 5, -1], [1, -1, -1, -1], [-1, -1, -1, -1]])
    visible = torch.tensor([43, 12, 100])
    pool = ops.pool_entries_reference(cand, visible, 8)
    assert pool.dtype == torch.int32 and pool.shape == (3, 32)
    for t in range(3):
        for j in range(4):
            for i in range(8):
                e = int(cand[t, j]) * 8 + i
                assert int(pool[t, j * 8 + i]) == (e if cand[t, j] >= 0 and e < visible[t] else -1)


@needs_triton
@pytest.mark.parametrize("n", [3, 300])
def test_pool_entries_kernel_matches_reference(n):
    g = torch.Generator().manual_seed(n)
    t = 5
    cand = torch.sort(torch.randint(0, 4 * n, (t, n), generator=g), dim=1).values
    cand[1, n // 2 :] = -1
    cand[2] = -1
    visible = torch.randint(0, 32 * n, (t,), generator=g)
    ref = ops.pool_entries_reference(cand, visible, 8)
    for c in (cand, cand.int()):
        assert torch.equal(tk.pool_entries(*_dev(c, visible), 8).cpu(), ref)
    with pytest.raises(ValueError, match="block must be a power of two"):
        tk.pool_entries(*_dev(cand, visible), 6)
    with pytest.raises(ValueError, match="visible must be int32/int64"):
        tk.pool_entries(*_dev(cand, visible[:2]), 8)


# ----------------------------------------------------------------------------------- contract


@needs_triton
def test_kernel_wrappers_reject_bad_arguments():
    args = _score_case(4, **dict(SCORE_CASES["ragged"], lengths=[3], row_req=[0]))
    bad = {
        0: (args[0].half(), "q must be bf16"),
        1: (args[1].double(), "weights must be float32"),
        3: (args[3][..., :1], "key_scales must be uint8"),
        5: (args[5].float(), "row_req must be int32/int64"),
        6: (args[6][:0], "lengths must be int32/int64"),
    }
    for i, (value, message) in bad.items():
        wrong = list(args)
        wrong[i] = value
        with pytest.raises(ValueError, match=message):
            tk.index_scores(*_dev(*wrong))
    with pytest.raises(ValueError, match=r"key_codes must be uint8 \[NB, 8, 32\]"):
        tk.index_scores(*_dev(*args[:7]), 8, *args[8:])
    with pytest.raises(ValueError, match="entries must be int32/int64"):
        tk.index_scores(*_dev(*args[:9]), torch.zeros(1, 7, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match=r"q must be \[T, H, Dk\] with Dk a power of two >= 16"):
        tk.index_scores(*_dev(args[0][..., :48], *args[1:]))
    with pytest.raises(ValueError, match=r"q must be \[T, H, Dk\] with Dk >= 32 for FP4 keys"):
        tk.index_scores(*_dev(args[0][..., :16], *args[1:]))
    # key_scales None: key_codes must be bf16 keys [NB, per_block, Dk], contiguous (FP4 codes
    # without their scales are refused)
    v4 = _score_case(4, **dict(SCORE_CASES["v4_prefill"], lengths=[3], row_req=[0]))
    keys = v4[2]
    for base, value, message in ((v4, keys.half(), r"key_codes must be bf16 \[NB, 64, 128\]"),
                                 (v4, keys[..., :64], r"key_codes must be bf16 \[NB, 64, 128\]"),
                                 (v4, keys.transpose(0, 1).contiguous().transpose(0, 1), "key_codes must be contiguous"),
                                 (args, args[2], r"key_codes must be bf16 \[NB, 16, 64\] \(unquantised keys, as key_scales is None\)")):
        wrong = list(base)
        wrong[2], wrong[3] = value, None
        with pytest.raises(ValueError, match=message):
            tk.index_scores(*_dev(*wrong))
    scores, lengths = _dev(torch.zeros(2, 16), torch.tensor([3, 4]))
    with pytest.raises(ValueError, match="block must be a power of two"):
        tk.block_max(scores, lengths, 6)
    with pytest.raises(ValueError, match="scores must be float32"):
        tk.topk_ascending(scores.half(), lengths, 4)
    with pytest.raises(ValueError, match="lengths must be int32/int64 \\[2\\]"):
        tk.topk_ascending(scores, lengths[:1], 4)
    with pytest.raises(ValueError, match="labels must be int32 \\[2, 16\\]"):
        tk.topk_ascending(scores, lengths, 4, lengths.new_zeros(2, 15).int())


def test_indexer_module_imports_without_triton():
    """CPU machines without triton import the ops: the kernels load only on CUDA tensors."""
    code = "import sys, dsv4.ops.indexer; assert 'triton' not in sys.modules, 'triton imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
