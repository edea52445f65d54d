"""A forward's metadata as device tensors of fixed shape: what the fast path runs on.

The reference path (dsv4.model.layers.attention) plans its gathers on the host from the
`ForwardBatch` lists. The fast path instead hands every kernel the same few device tensors
(which request each row belongs to, its position, each request's first row and position,
window floor, state slot and block table) and lets the kernels find their own rows. Nothing in
a fast forward then synchronises with the host or has a data-dependent shape, so a decode step
can be captured once per batch size and replayed (dsv4.engine.cuda_graphs).

`build_step` turns a ForwardBatch into a `Step`, optionally padded to more requests: padding
requests have one row each at position 0, no blocks (block table row -1) and `write` False,
so they read only their own row and write nothing. `StepBuffer` holds a captured step's
tensors in one device buffer and refills them from a host-built step with one copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

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
    # Per-row facts the layers index the caches with, built on the host with the rest, so no
    # layer spends launches deriving them (~50 small kernels a decode step before).
    slot: torch.Tensor  # [R] int64 state slot of the row's request
    ring_pos: torch.Tensor  # [R] int64 the row's place in its request's window ring (position % window)
    ring_keep: torch.Tensor  # [R] bool: a key the ring keeps after this step (each real request's last `window` rows)
    # per compress ratio (first axis: `ratios`; `by_ratio` picks one)
    ratios: tuple[int, ...]
    visible: torch.Tensor  # [NR, R] int64 compressed entries the row sees (complete groups to its position; padding: none)
    entry_pos: torch.Tensor  # [NR, R] int64 the position of the row's entry (its group's first: the entry's RoPE angle)
    in_group: torch.Tensor  # [NR, R] int64 the row's place in its group (position % ratio)
    tail: torch.Tensor  # [NR, R] bool: a real row of its request's trailing incomplete group (kept in the slot's tail)
    # RoPE tables every layer needs: made once per forward (`derived`), not once per layer.
    # Cleared at the start of each forward, so a captured graph computes them inside itself.
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_rows(self) -> int:
        return self.req.shape[0]

    def by_ratio(self, name: str, ratio: int) -> torch.Tensor:
        """A per-ratio field's row for compress ratio `ratio` (a view)."""
        return getattr(self, name)[self.ratios.index(ratio)]

    def derived(self, key, make):
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]


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

    def forget_derived(self) -> None:
        self.enc.memo.clear()
        self.dec.memo.clear()

    def named_tensors(self, names: tuple[str, ...] | None = None) -> list[tuple[str, torch.Tensor]]:
        """(field[.row field], tensor) of the fields in `names` (default: all), in field order."""
        out = []
        for f in fields(self):
            value = getattr(self, f.name)
            if names is not None and f.name not in names:
                continue
            if isinstance(value, Rows):
                out += [(f"{f.name}.{g.name}", getattr(value, g.name)) for g in fields(value) if isinstance(getattr(value, g.name), torch.Tensor)]
            elif isinstance(value, torch.Tensor):
                out.append((f.name, value))
        return out


class StepBuffer:
    """A captured step's inputs (the fields in `names`, default all) as views of one byte buffer
    on the step's device, refilled from a host step of the same shapes by one copy through a
    page-locked staging buffer (`load`) — not a pinned allocation and a copy per tensor, which
    cost a decode step ~0.5 ms of host time. `step` is the re-homed step the graph captures.

    Layout: each tensor in field order, at an offset rounded up to `_ALIGN` bytes (a multiple
    of every element size: int64 views start on 8 bytes, and the vector loads of a kernel on
    16). On CPU (tests: graphs need CUDA) the staging buffer is plain memory and the copy
    synchronous; on CUDA it is pinned and the copy asynchronous on the buffer's device's
    current stream, the stream the graph replays on."""

    _ALIGN = 16

    def __init__(self, step: Step, names: tuple[str, ...] | None = None, device: torch.device | None = None):
        """`step` on the host, or already on the device (a graph's padding step); `device`:
        where the buffer lives (default: the step's)."""
        self.names = names
        held = step.named_tensors(names)
        device = step.slots.device if device is None else torch.device(device)
        spans, total = [], 0
        for label, t in held:
            align = max(self._ALIGN, t.element_size())
            total = -(-total // align) * align
            spans.append((label, total, t.numel() * t.element_size(), t.dtype, tuple(t.shape)))
            total += spans[-1][2]
        self.spans = spans
        size = -(-max(total, 1) // self._ALIGN) * self._ALIGN
        self.buffer = torch.zeros(size, dtype=torch.uint8, device=device)
        on_cuda = device.type == "cuda"
        self.staging = torch.zeros(size, dtype=torch.uint8, pin_memory=on_cuda)
        # recorded after each copy: until it completes, that copy may still read the staging buffer
        self.copied = torch.cuda.Event() if on_cuda else None
        views = {label: self._view(self.buffer, off, n, t) for (label, off, n, _, _), (_, t) in zip(spans, held)}
        self.step = _with_tensors(step, views)
        # numpy views of the staging buffer: filling them costs ~1 us a field, a torch copy ~10
        self.host_views = [self._view(self.staging, off, n, t).numpy() for (_, off, n, _, _), (_, t) in zip(spans, held)]
        if all(t.device.type == "cpu" for _, t in held):
            self.load(step)
        else:  # a step already on the device (a graph's padding step)
            for view, (_, t) in zip(views.values(), held):
                view.copy_(t)

    @staticmethod
    def _view(buf: torch.Tensor, offset: int, nbytes: int, like: torch.Tensor) -> torch.Tensor:
        return buf[offset : offset + nbytes].view(like.dtype).view(like.shape)

    def load(self, host: Step) -> None:
        """Copy `host` (CPU tensors, the captured shapes and dtypes) into the step's tensors:
        every held field, packed on the host, then one copy, ordered before whatever the
        stream runs next (the replay). A step that does not match the captured one (more rows
        or requests than the bucket, another field set or dtype) is refused before anything is
        written: never truncated or cast."""
        if host.widths != self.step.widths:
            raise ValueError(f"StepBuffer.load: score-table widths {host.widths} differ from the captured {self.step.widths}")
        sources = host.named_tensors(self.names)
        labels = [label for label, *_ in self.spans]
        if [label for label, _ in sources] != labels:
            raise ValueError(f"StepBuffer.load: the step has fields {[label for label, _ in sources]}, the captured one {labels}")
        for (label, _, _, dtype, shape), (_, src) in zip(self.spans, sources):
            if tuple(src.shape) != shape:
                raise ValueError(f"StepBuffer.load: {label} shape {list(src.shape)} does not fit the captured {list(shape)} (a bigger step needs a bigger bucket)")
            if src.dtype != dtype or src.device.type != "cpu":
                raise ValueError(f"StepBuffer.load: {label} is {src.dtype} on {src.device}, the captured one {dtype} (a CPU step is loaded)")
        if self.copied is not None:
            self.copied.synchronize()  # the previous load's copy has read the staging buffer: refill it
        for view, (_, src) in zip(self.host_views, sources):
            view[...] = src.numpy()
        self.buffer.copy_(self.staging, non_blocking=self.copied is not None)
        if self.copied is not None:
            # on the stream the copy ran on: the destination device's current one (which need
            # not be the current device's, that a bare `record()` would use)
            self.copied.record(torch.cuda.current_stream(self.buffer.device))


def _with_tensors(step: Step, views: dict[str, torch.Tensor]) -> Step:
    """`step` with the tensors named in `views` replaced (a new Step; Rows rebuilt)."""
    changes = {}
    for f in fields(step):
        value = getattr(step, f.name)
        if isinstance(value, Rows):
            sub = {g.name: views[f"{f.name}.{g.name}"] for g in fields(value) if f"{f.name}.{g.name}" in views}
            if sub:
                changes[f.name] = replace(value, memo={}, **sub)
        elif f.name in views:
            changes[f.name] = views[f.name]
    return replace(step, **changes)


def _rows(starts, counts, floors, write, slots, window: int, ratios: tuple[int, ...]) -> Rows:
    """Rows of requests at `starts` with `counts` rows each (lists or numpy arrays; `slots` and
    `write` per request)."""
    # numpy, then shared with torch: torch's CPU ops (tensor from a list, repeat_interleave)
    # cost 10-30 us each, most of a decode step's host time at 256 requests
    start, count = np.asarray(starts, dtype=np.int64), np.asarray(counts, dtype=np.int64)
    row0 = np.cumsum(count) - count
    req = np.repeat(np.arange(len(counts), dtype=np.int64), count)
    local = np.arange(req.size, dtype=np.int64) - row0[req]
    positions = start[req] + local
    real = np.asarray(write, dtype=bool)[req]
    end = (start + count)[req]
    r = np.asarray(ratios, dtype=np.int64)[:, None]
    entry_pos = positions - positions % r
    t = torch.from_numpy
    return Rows(
        req=t(req.astype(np.int32)), positions=t(positions), local=t(local), write=t(real),
        start=t(start), count=t(count), row0=t(row0.astype(np.int32)), floor=t(np.asarray(floors, dtype=np.int64)),
        slot=t(np.asarray(slots, dtype=np.int64)[req]), ring_pos=t(positions % window), ring_keep=t(real & (positions >= end - window)),
        ratios=tuple(ratios), visible=t(np.where(real, (positions + 1) // r, 0)), entry_pos=t(entry_pos),
        in_group=t(positions - entry_pos), tail=t(real & (positions >= end - end % r)),
    )


def build_step(batch: ForwardBatch, cfg: ModelConfig, block_size: int, device: torch.device | str, *, pad_requests: int = 0,
               pad_rows: int | list[int] = 1, pad_dec_rows: list[int] | None = None, pad_logits: int | list[int] | None = None,
               max_blocks: int | None = None) -> Step:
    """The fast path's view of `batch` on `device`. `pad_requests` appends padding requests
    (graph buckets) of `pad_rows` rows each (or one count per padding request), of which the
    last `pad_dec_rows` run the decoder (default: all) and the last `pad_logits` of those are
    logits rows (a count for all or one per padding request; default: all, decode buckets); `max_blocks` widens the block tables (and with
    them the indexer score tables) to a fixed capacity, so that steps of any context length
    fit one captured shape (a graph's step is refilled from a CPU build: `StepBuffer`). Built from host data:
    give the batch CPU tensors, or its device tensors are read back (a synchronisation); on
    another device the fields are views of one buffer, filled by one copy."""
    device = torch.device(device)
    b, n_pad = batch.num_requests, pad_requests
    pad_enc = [pad_rows] * n_pad if isinstance(pad_rows, int) else list(pad_rows)
    pad_dec = list(pad_enc) if pad_dec_rows is None else list(pad_dec_rows)
    if len(pad_enc) != n_pad or len(pad_dec) != n_pad or not all(0 < d <= e for d, e in zip(pad_dec, pad_enc)):
        raise ValueError(f"padding: {n_pad} requests need one count each with 0 < decoder rows <= rows, got rows {pad_enc}, decoder rows {pad_dec}")
    # per-request values as numpy arrays (Python loops over 256 requests cost ~0.1 ms here)
    padded = lambda values, pad: np.asarray(list(values) + list(pad), dtype=np.int64)
    starts, counts = padded(batch.start_pos, [0] * n_pad), padded(batch.num_tokens, pad_enc)
    write = np.arange(b + n_pad) < b
    slots = padded(batch.slots, [0] * n_pad)
    rows = lambda starts, counts, floors: _rows(starts, counts, floors, write, slots, cfg.window, cfg.compress_ratio_set)
    enc_floors, dec_floors = padded(batch.window_floor, [0] * n_pad), padded(batch.decoder_window_floor, [0] * n_pad)
    enc = rows(starts, counts, enc_floors)
    real = counts[:b] if batch.decoder_tokens is None else np.minimum(np.asarray(batch.decoder_tokens, dtype=np.int64), counts[:b])
    kept = np.concatenate([real, np.asarray(pad_dec, dtype=np.int64)])
    keep = None
    if np.array_equal(kept, counts):
        dec = rows(starts, counts, dec_floors)
    else:
        dec = rows(starts + counts - kept, kept, dec_floors)
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
            widths[r] = int(((starts + counts) // r).max(initial=0))
        else:
            widths[r] = width * (block_size // r)
    look_back = batch.prev_tokens.shape[1]
    prev = torch.full((b + n_pad, look_back), -1, dtype=torch.long)
    prev[:b] = batch.prev_tokens.cpu()
    ids = torch.cat([batch.input_ids.cpu(), torch.zeros(sum(pad_enc), dtype=torch.long)])
    emit = torch.from_numpy(padded(batch.emit_from, [1 << 62] * n_pad))

    host = Step(
        input_ids=ids, prev_tokens=prev, block_tables=table, slots=torch.from_numpy(slots), emit_from=emit,
        enc=enc, dec=dec, dec_keep=keep, logits_index=logits_index, widths=widths,
    )
    if device.type == "cpu":
        return host
    # one packed copy of every field (a pinned copy per field cost the eager step ~1 ms of host time)
    return StepBuffer(host, device=device).step
