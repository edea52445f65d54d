"""A forward's metadata as device tensors of fixed shape: what the fast path runs on.

The reference path (dsv4.model.layers.attention) plans its gathers on the host from the
`ForwardBatch` lists. The fast path instead hands every kernel the same few device tensors
(which request each row belongs to, its position, each request's first row and position,
window floor, state slot and block table) and lets the kernels find their own rows. Nothing in
a fast forward then synchronises with the host or has a data-dependent shape, so a decode step
can be captured once per batch size and replayed (dsv4.engine.cuda_graphs).

`build_step` turns a ForwardBatch into a `Step`, optionally padded to more requests: padding
requests have one row each at position 0, no blocks (block table row -1) and `write` False,
so they read only their own row and write nothing. `Step.copy_` refills a captured step's
tensors in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np
import torch

from dsv4.config import ModelConfig
from dsv4.model.batch import ForwardBatch


@dataclass
class Rows:
    """The rows a layer runs on: rows row0[b] .. row0[b]+count[b]-1 are request b's, at
    positions start[b] ..; window keys below floor[b] are invisible."""

    req: torch.Tensor  # [R] int32 request of each row
    positions: torch.Tensor  # [R] int64
    local: torch.Tensor  # [R] int64 row index inside its request's rows
    write: torch.Tensor  # [R] bool: a real row (False: padding, writes nothing)
    start: torch.Tensor  # [B] int64
    count: torch.Tensor  # [B] int64
    row0: torch.Tensor  # [B] int32
    floor: torch.Tensor  # [B] int64
    # Tensors derived from the above that every layer needs (rope tables, ring targets,
    # visible entries): made once per forward (`derived`), not once per layer. Cleared at the
    # start of each forward, so a captured graph computes them inside itself.
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_rows(self) -> int:
        return self.req.shape[0]

    def derived(self, key, make):
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]

    def ring_write(self, window: int) -> torch.Tensor:
        """[R] bool: the rows whose keys the window ring keeps after this step (each
        request's last `window`)."""
        def make():
            req = self.req.long()
            return self.write & (self.positions >= self.start[req] + self.count[req] - window)

        return self.derived(("ring_write", window), make)


@dataclass
class Step:
    input_ids: torch.Tensor  # [R] int64
    prev_tokens: torch.Tensor  # [B, max_ngram-1] int64 ids of positions start-1, start-2, ... (-1: none)
    block_tables: torch.Tensor  # [B, max_blocks] int32 (-1: none)
    slots: torch.Tensor  # [B] int64 state slot
    emit_from: torch.Tensor  # [B] int64 compressed groups starting below are cached already
    enc: Rows  # every row (encoder side; every layer of V4 and of exact-mode V4.1)
    dec: Rows  # the rows from the V4.1 CED split on (same rows as `enc` unless `dec_keep`)
    dec_keep: torch.Tensor | None  # [R_dec] int64 rows of `enc` the decoder keeps (None: all)
    logits_index: torch.Tensor  # [L] int64 rows (of `dec`) whose hidden state is returned, padding rows last
    widths: dict  # compress ratio -> columns of the indexer's score table (host int)

    @property
    def num_requests(self) -> int:
        return self.slots.shape[0]

    def tensors(self) -> list[torch.Tensor]:
        out = []
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Rows):
                out += [getattr(value, g.name) for g in fields(value) if g.name != "memo"]
            elif isinstance(value, torch.Tensor):
                out.append(value)
        return out

    def forget_derived(self) -> None:
        self.enc.memo.clear()
        self.dec.memo.clear()

    def copy_(self, other: Step, names: tuple[str, ...] | None = None) -> None:
        """Refill these tensors in place from a step of the same shapes (a captured graph's
        inputs); `names`: only these fields (a piece of a forward that reads no others)."""
        if other.widths != self.widths or (other.dec_keep is None) != (self.dec_keep is None):
            raise ValueError("Step.copy_: the steps differ in structure")
        for f in fields(self):
            if names is not None and f.name not in names:
                continue
            dst, src = getattr(self, f.name), getattr(other, f.name)
            if isinstance(dst, Rows):
                pairs = [(getattr(dst, g.name), getattr(src, g.name)) for g in fields(dst) if g.name != "memo"]
            elif isinstance(dst, torch.Tensor):
                pairs = [(dst, src)]
            else:
                continue
            for d, s in pairs:
                if d.shape != s.shape:
                    raise ValueError(f"Step.copy_: {f.name} shape {list(s.shape)} does not fit {list(d.shape)}")
                d.copy_(s, non_blocking=True)


def _rows(starts: list[int], counts: list[int], floors: list[int], write: list[bool]) -> Rows:
    start, count = torch.tensor(starts, dtype=torch.long), torch.tensor(counts, dtype=torch.long)
    row0 = torch.cumsum(count, 0) - count
    # numpy: torch's CPU repeat_interleave took 1-5 ms at 256 requests (most of a step's host time)
    req = torch.from_numpy(np.repeat(np.arange(len(counts), dtype=np.int64), counts))
    local = torch.arange(req.numel()) - row0[req]
    return Rows(
        req=req.int(), positions=start[req] + local, local=local, write=torch.tensor(write, dtype=torch.bool)[req],
        start=start, count=count, row0=row0.int(), floor=torch.tensor(floors, dtype=torch.long),
    )


def build_step(batch: ForwardBatch, cfg: ModelConfig, block_size: int, device: torch.device | str, *, pad_requests: int = 0,
               pad_rows: int | list[int] = 1, pad_dec_rows: list[int] | None = None, pad_logits: int | list[int] | None = None,
               max_blocks: int | None = None, pinned: bool = False) -> Step:
    """The fast path's view of `batch` on `device`. `pad_requests` appends padding requests
    (graph buckets) of `pad_rows` rows each (or one count per padding request), of which the
    last `pad_dec_rows` run the decoder (default: all) and the last `pad_logits` of those are
    logits rows (a count for all or one per padding request; default: all, decode buckets); `max_blocks` widens the block tables (and with
    them the indexer score tables) to a fixed capacity, so that steps of any context length
    fit one captured shape. `pinned` (with a CPU device): page-locked host tensors, to be
    copied into a CUDA step (`Step.copy_`) without a synchronous copy. Built from host data:
    give the batch CPU tensors, or its device tensors are read back (a synchronisation)."""
    device = torch.device(device)
    b, n_pad = batch.num_requests, pad_requests
    pad_enc = [pad_rows] * n_pad if isinstance(pad_rows, int) else list(pad_rows)
    pad_dec = list(pad_enc) if pad_dec_rows is None else list(pad_dec_rows)
    if len(pad_enc) != n_pad or len(pad_dec) != n_pad or not all(0 < d <= e for d, e in zip(pad_dec, pad_enc)):
        raise ValueError(f"padding: {n_pad} requests need one count each with 0 < decoder rows <= rows, got rows {pad_enc}, decoder rows {pad_dec}")
    starts, counts = list(batch.start_pos) + [0] * n_pad, list(batch.num_tokens) + pad_enc
    write = [True] * b + [False] * n_pad
    enc = _rows(starts, counts, list(batch.window_floor) + [0] * n_pad, write)
    dec_floors = list(batch.decoder_window_floor) + [0] * n_pad
    real = list(batch.num_tokens) if batch.decoder_tokens is None else [min(k, n) for k, n in zip(batch.decoder_tokens, batch.num_tokens)]
    kept = real + pad_dec
    keep = None
    if kept == counts:
        dec = _rows(starts, counts, dec_floors, write)
    else:
        dec = _rows([s + n - k for s, n, k in zip(starts, counts, kept)], kept, dec_floors, write)
        keep = enc.row0.long()[dec.req.long()] + (dec.positions - enc.start[dec.req.long()])
    # logits rows: original flat rows -> rows of `dec` (each must have run the decoder)
    wanted = batch.logits_rows.cpu()
    n_rows, n_dec = enc.num_rows, dec.num_rows
    if keep is None:
        logits_index = wanted
    else:
        lookup = torch.full((n_rows,), -1, dtype=torch.long)
        lookup[keep] = torch.arange(n_dec)
        logits_index = lookup[wanted]
        if bool((logits_index < 0).any()):
            raise ValueError("logits_rows: a requested row did not run the decoder layers (bounded replay keeps only each request's last tokens)")
    # the padding requests' last rows too: a fixed shape
    pad_ends = (dec.row0[b:].long() + dec.count[b:]).tolist()
    pad_last = pad_dec if pad_logits is None else [pad_logits] * n_pad if isinstance(pad_logits, int) else list(pad_logits)
    if len(pad_last) != n_pad or not all(0 <= n <= d for n, d in zip(pad_last, pad_dec)):
        raise ValueError(f"pad_logits: expected 0 .. decoder rows logits rows per padding request, got {pad_last} for {pad_dec}")
    logits_index = torch.cat([logits_index] + [torch.arange(end - n, end) for end, n in zip(pad_ends, pad_last)])

    tables = batch.block_tables.to(device="cpu", dtype=torch.int32)
    width = max(tables.shape[1], max_blocks or 0)
    table = torch.full((b + n_pad, width), -1, dtype=torch.int32)
    table[:b, : tables.shape[1]] = tables
    widths = {}
    for r in cfg.compress_ratio_set:
        if max_blocks is None:  # exactly the most entries any request has after this step
            widths[r] = max(((s + n) // r for s, n in zip(starts, counts)), default=0)
        else:
            widths[r] = width * (block_size // r)
    look_back = batch.prev_tokens.shape[1]
    prev = torch.full((b + n_pad, look_back), -1, dtype=torch.long)
    prev[:b] = batch.prev_tokens.cpu()
    ids = torch.cat([batch.input_ids.cpu(), torch.zeros(sum(pad_enc), dtype=torch.long)])
    slots = torch.tensor(list(batch.slots) + [0] * n_pad, dtype=torch.long)
    emit = torch.tensor(list(batch.emit_from) + [1 << 62] * n_pad, dtype=torch.long)

    def dev(t: torch.Tensor) -> torch.Tensor:
        if device.type == "cuda":
            return t.pin_memory().to(device, non_blocking=True)
        return t.pin_memory() if pinned else t.to(device)

    def dev_rows(r: Rows) -> Rows:
        return Rows(**{f.name: dev(getattr(r, f.name)) for f in fields(r) if f.name != "memo"})

    return Step(
        input_ids=dev(ids), prev_tokens=dev(prev), block_tables=dev(table), slots=dev(slots), emit_from=dev(emit),
        enc=dev_rows(enc), dec=dev_rows(dec), dec_keep=None if keep is None else dev(keep),
        logits_index=dev(logits_index), widths=widths,
    )
