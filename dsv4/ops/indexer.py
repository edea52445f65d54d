"""The indexer as four graph-safe ops (MODEL.md 2.4, "Indexer" and "Hierarchical
candidates"): scores of a row's entries (V4.1's FP4 keys or V4-Flash's unquantised ones),
block maxima (level one of the two-level top-k), the ascending top-k and a Reindex layer's
candidate pool. All per-row metadata (request, length, entry list) are device tensors of
static shape, so a step can be captured in a CUDA graph.

Each op runs its Triton kernel (`dsv4.ops.triton.indexer`, imported only then) when its tensors
are on CUDA, else its torch reference, which is also the test oracle. The kernels leave the
columns (blocks) a row does not have unwritten; callers never read them. The references fill
them with -inf, as `Attention.select` does for entries a query cannot see.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv4.model import quant
from dsv4.ops import on_triton

IDX_BLOCK = 32  # one ue8m0 scale byte per 32 channels of an indexer key


def index_scores(q, weights, key_codes, key_scales, block_tables, row_req, lengths, per_block: int, width: int, entries=None) -> torch.Tensor:
    """Index scores of every row against the entries of its request -> fp32 [T, width].

    q [T, H, Dk] (bf16 on CUDA, fp32 allowed on CPU): the indexer query (V4.1's FP4-rounded);
    weights fp32 [T, H] (already x H**-0.5); key_codes uint8 [NB, per_block, Dk/2] (e2m1, low
    nibble = even channel) and key_scales uint8 [NB, per_block, Dk/32] (ue8m0 bytes): V4.1's
    indexer keys, entry j of request b at block block_tables[b, j // per_block], offset
    j % per_block;
    row_req int [T] (request of each row), lengths int [T] (columns to produce, <= width).
    entries None: column c scores entry c; entries int [T, width]: column c scores entry
    entries[t, c] (one the request holds; visibility is the caller's), and an entry < 0 scores
    -inf. V4's keys are unquantised: key_codes [NB, per_block, Dk] in the compute dtype (bf16
    on CUDA) and key_scales None.

    out[t, c] = sum_h relu(q[t, h] . key) * Dk**-0.5 * weights[t, h] for c < lengths[t];
    columns >= lengths[t] are unwritten on CUDA (-inf in the reference)."""
    if on_triton(q):
        from dsv4.ops.triton import indexer

        return indexer.index_scores(q, weights, key_codes, key_scales, block_tables, row_req, lengths, per_block, width, entries)
    return index_scores_reference(q, weights, key_codes, key_scales, block_tables, row_req, lengths, per_block, width, entries)


def index_scores_reference(q, weights, key_codes, key_scales, block_tables, row_req, lengths, per_block: int, width: int, entries=None) -> torch.Tensor:
    """`index_scores` computed as `Attention.select` computes a row's scores: keys dequantised
    to fp32, one fp32 einsum per chunk of rows (the same chunking), relu, x Dk**-0.5, x weight,
    sum over heads. Columns a row does not score read location (block 0, offset 0) and are
    then set to -inf."""
    t, h, dk = q.shape
    device = q.device
    cols = torch.arange(width, device=device)
    entry = cols.expand(t, width) if entries is None else entries.long()
    valid = (cols < lengths.long().clamp(max=width).unsqueeze(1)) & (entry >= 0)
    entry = torch.where(valid, entry, 0)
    block = torch.where(valid, block_tables.long()[row_req.long().unsqueeze(1), entry // per_block], 0)
    offset = entry % per_block
    out = torch.full((t, width), float("-inf"), dtype=torch.float32, device=device)
    if t == 0 or width == 0:
        return out
    q = q.float()
    step = max(1, (1 << 26) // (width * (dk + h)))  # bounds a chunk's keys and scores
    for c in range(0, t, step):
        rows = slice(c, c + step)
        loc = (block[rows], offset[rows])
        if key_scales is None:
            keys = key_codes[loc].float()
        else:
            keys = quant.dequantize_fp4(key_codes[loc], key_scales[loc], torch.float32, IDX_BLOCK)
        scores = (torch.einsum("rhd,rtd->rht", q[rows], keys).relu() * dk**-0.5 * weights[rows].unsqueeze(-1)).sum(dim=1)
        out[rows] = scores.masked_fill(~valid[rows], float("-inf"))
    return out


def block_max(scores: torch.Tensor, lengths: torch.Tensor, block: int) -> torch.Tensor:
    """Level one of the two-level top-k -> fp32 [T, cdiv(width, block)]: block i of row t is
    the max of scores[t, i*block : min((i+1)*block, lengths[t])], and the block holding the
    newest column, (lengths[t]-1) // block, is +inf (always kept). Blocks >= cdiv(lengths[t],
    block) are unwritten on CUDA (-inf in the reference). `block` is a power of two."""
    if on_triton(scores):
        from dsv4.ops.triton import indexer

        return indexer.block_max(scores, lengths, block)
    return block_max_reference(scores, lengths, block)


def block_max_reference(scores: torch.Tensor, lengths: torch.Tensor, block: int) -> torch.Tensor:
    """What `Attention._candidates` computes for the block scores of a row whose columns from
    lengths[t] on are -inf (the entries the query cannot see)."""
    t, width = scores.shape
    lengths = lengths.long().clamp(max=width)
    n_blocks = -(-width // block)
    if width == 0:
        return scores.new_full((t, 0), float("-inf"))
    cols = torch.arange(width, device=scores.device)
    masked = scores.masked_fill(cols >= lengths.unsqueeze(1), float("-inf"))
    maxima = F.pad(masked, (0, n_blocks * block - width), value=float("-inf")).unflatten(-1, (n_blocks, block)).amax(-1)
    newest = torch.div(lengths - 1, block, rounding_mode="floor")  # -1 for an empty row: no block
    return maxima.masked_fill(torch.arange(n_blocks, device=scores.device) == newest.unsqueeze(1), float("inf"))


def topk_ascending(scores: torch.Tensor, lengths: torch.Tensor, k: int, labels: torch.Tensor | None = None) -> torch.Tensor:
    """The columns of the k largest scores[t, :lengths[t]] -> int32 [T, k]: ties go to the lower
    column, -inf is never picked (+inf is an ordinary largest value), sorted ascending, padded
    with -1. Scores must not be NaN. labels int [T, width]: each pick's label labels[t, col]
    instead of its column (still in column order; the -1 padding stays)."""
    if on_triton(scores):
        from dsv4.ops.triton import indexer

        return indexer.topk_ascending(scores, lengths, k, labels)
    return topk_ascending_reference(scores, lengths, k, labels)


def topk_ascending_reference(scores: torch.Tensor, lengths: torch.Tensor, k: int, labels: torch.Tensor | None = None) -> torch.Tensor:
    """`Attention.select`'s selection: a stable descending sort (`topk_lowest_index_on_ties`),
    the first min(k, width), picks of -inf dropped, ascending, padded with -1 to k columns."""
    t, width = scores.shape
    cols = torch.arange(width, device=scores.device)
    masked = scores.masked_fill(cols >= lengths.long().clamp(max=width).unsqueeze(1), float("-inf"))
    n = min(k, width)
    values, indices = masked.sort(dim=-1, descending=True, stable=True)
    picks = torch.where(values[:, :n] > float("-inf"), indices[:, :n], width).sort(dim=-1).values
    picks = F.pad(torch.where(picks < width, picks, -1), (0, k - n), value=-1)
    if labels is not None:
        picks = torch.where(picks >= 0, labels.long().gather(1, picks.clamp_min(0)), -1)
    return picks.to(torch.int32)


def pool_entries(cand: torch.Tensor, visible: torch.Tensor, block: int) -> torch.Tensor:
    """A Reindex layer's candidate pool (MODEL.md 2.4): the entries of the candidate blocks
    cand int [T, n] (ascending, -1: none) -> int32 [T, n * block], column j * block + i holding
    entry cand[t, j] * block + i, or -1 where there is no block or the entry is not visible
    (>= visible[t]). Ascending where not -1, as `topk_ascending(..., labels=)` needs."""
    if on_triton(cand):
        from dsv4.ops.triton import indexer

        return indexer.pool_entries(cand, visible, block)
    return pool_entries_reference(cand, visible, block)


def pool_entries_reference(cand: torch.Tensor, visible: torch.Tensor, block: int) -> torch.Tensor:
    cand = cand.long()
    entries = (cand.unsqueeze(-1) * block + torch.arange(block, device=cand.device)).flatten(1)
    ok = (cand >= 0).repeat_interleave(block, dim=1) & (entries < visible.long().unsqueeze(1))
    return torch.where(ok, entries, -1).to(torch.int32)
