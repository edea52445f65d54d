"""Steps on fixed shapes: batches padded to size buckets, replayed from CUDA graphs.

`DecodeGraphs` captures whole decode steps per batch-size bucket; `PiecewiseGraphs` any other
fast-path batch (prefill, prefix hits, chunked prefill, mixed) in two pieces (below).

A decode step (every request advances by the same few rows and samples) is small enough
that launching its kernels one by one costs more than running them. The fast path
(`Model.forward_step`) never synchronises with the host and takes all metadata as device
tensors, so one step per bucket of batch sizes is captured once and then replayed after
copying the new batch's metadata into the captured tensors. Block tables are widened to
`max_blocks` (the longest sequence the cache serves), so one graph serves every context
length; the kernels loop to each row's real length.

Every decode batch runs padded to its bucket, with graphs or not (`use_graphs=False`, also
the CPU path): the same shapes run the same kernels, so greedy outputs are identical with
and without graphs. Padding requests read only their own row and write nothing.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from dsv4.cache.storage import KVCacheStorage
from dsv4.model.batch import ForwardBatch
from dsv4.model.model import Carry, Model
from dsv4.model.step import Step, StepBuffer, build_step

# Batch-size buckets (vLLM's default capture sizes up to 256, in steps of 8 beyond 8).
DEFAULT_SIZES = (1, 2, 4, 8, *range(16, 257, 8))


def _record(body, device: torch.device, pool):
    """Warm `body` up outside a graph (Triton compiles, cuBLAS picks its kernels) on a side
    stream, as capture requires, then capture it into `pool` -> (graph, body's output)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            body()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = body()
    return graph, out


def _capture(step: Step, body, device: torch.device, pool, names: tuple[str, ...] | None = None):
    """Capture `body(step)` for replays on any step of its shapes (both graph kinds capture
    this way): the step's inputs — the fields in `names` (default all), which must be every
    field `body` reads — move into one `StepBuffer` -> (inputs, graph, body's output). Before
    each replay, `inputs.load(host step)` refills all of them with one copy."""
    inputs = StepBuffer(step, names)
    graph, out = _record(lambda: body(inputs.step), device, pool)
    return inputs, graph, out


def _padding_step(model: Model, cache: KVCacheStorage, max_blocks: int, requests: int, **padding) -> Step:
    """A step of `requests` padding requests only (they write nothing; `build_step`'s padding
    arguments give their rows) on the model's device: what a graph is captured on."""
    look_back = max(model.cfg.engram_max_ngram_size - 1, 1)
    empty = ForwardBatch(
        input_ids=torch.zeros(0, dtype=torch.long), positions=torch.zeros(0, dtype=torch.long),
        start_pos=[], num_tokens=[], slots=[], block_tables=torch.zeros(0, max_blocks, dtype=torch.long),
        prev_tokens=torch.zeros(0, look_back, dtype=torch.long),
    )
    return build_step(empty, model.cfg, cache.block_size, model.device, pad_requests=requests, max_blocks=max_blocks, **padding)


class DecodeGraphs:
    """Runs decode-shaped batches (`fits`) of up to max(sizes) requests with `rows` rows each.
    The logits a call returns live in the captured output: read them before the next call."""

    def __init__(self, model: Model, cache: KVCacheStorage, *, max_blocks: int, sizes=DEFAULT_SIZES, rows: int = 1, use_graphs: bool | None = None):
        if not model.fast:
            raise ValueError("DecodeGraphs: the model runs the reference path (fast_path=False or an unsupported config)")
        sizes = sorted({int(s) for s in sizes})
        if not sizes or sizes[0] < 1:
            raise ValueError(f"sizes: expected positive batch sizes, got {sizes}")
        if max_blocks < 1:
            raise ValueError(f"max_blocks: expected >= 1, got {max_blocks}")
        self.model, self.cache, self.max_blocks, self.sizes, self.rows = model, cache, max_blocks, sizes, rows
        self.use_graphs = model.device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and model.device.type != "cuda":
            raise ValueError("use_graphs: CUDA graphs need a CUDA model")
        self._steps: dict[int, tuple[StepBuffer, torch.cuda.CUDAGraph, torch.Tensor]] = {}  # bucket -> captured
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.host_ms = 0.0

    def fits(self, batch: ForwardBatch) -> bool:
        """Decode-shaped: every request runs `rows` rows, all of them through the decoder and
        into the logits, within the sizes and the block capacity."""
        n = batch.num_requests
        return (
            0 < n <= self.sizes[-1]
            and all(t == self.rows for t in batch.num_tokens)
            and (batch.decoder_tokens is None or all(k >= self.rows for k in batch.decoder_tokens))
            and batch.logits_rows.numel() == n * self.rows
            and batch.block_tables.shape[1] <= self.max_blocks
            and batch.trace is None and batch.capture is None
        )

    def bucket(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def capture(self, sizes=None) -> None:
        """Capture the given buckets (default: all), largest first so that the smaller
        graphs reuse its memory pool. Without graphs there is nothing to capture."""
        if not self.use_graphs:
            return
        for size in sorted(self.sizes if sizes is None else {self.bucket(s) for s in sizes}, reverse=True):
            self._entry(size)

    def run(self, batch: ForwardBatch, resolve=None) -> torch.Tensor:
        """Logits [n * rows, vocab] (fp32) of a batch that `fits`, padded to its bucket.
        `resolve(input_ids)`, if given, rewrites the step's ids on the device before the
        model reads them (the runner's pending tokens)."""
        if not self.fits(batch):
            raise ValueError("DecodeGraphs.run: the batch is not decode-shaped (see fits)")
        n = batch.num_requests
        size = self.bucket(n)
        started = time.perf_counter()
        fresh = build_step(batch, self.model.cfg, self.cache.block_size, "cpu" if self.use_graphs else self.model.device,
                           pad_requests=size - n, pad_rows=self.rows, max_blocks=self.max_blocks)
        if not self.use_graphs:
            if resolve is not None:
                resolve(fresh.input_ids)
            return self._body(fresh)[: n * self.rows]
        inputs, graph, out = self._entry(size)
        inputs.load(fresh)
        if resolve is not None:
            resolve(inputs.step.input_ids)
        self.host_ms = (time.perf_counter() - started) * 1e3  # the host's share of a step (benchmarks report it)
        graph.replay()
        return out[: n * self.rows]

    # ------------------------------------------------------------------------- internals
    def _body(self, step: Step) -> torch.Tensor:
        return self.model.logits(self.model.forward_step(step, self.cache))

    def _entry(self, size: int) -> tuple[StepBuffer, torch.cuda.CUDAGraph, torch.Tensor]:
        if size not in self._steps:
            step = _padding_step(self.model, self.cache, self.max_blocks, size, pad_rows=self.rows)
            self._steps[size] = _capture(step, self._body, self.model.device, self._pool)
        return self._steps[size]


# Row-count buckets of the piecewise graphs (each piece on its own): steps of 16 rows up to 256,
# then in every doubling from 256 to 32K steps of 1/8 of its start (32 up to 512, 64 up to 1K,
# ..., 2K up to 32K), so that padding adds at most 1/8 of the rows above 256. The steps used to
# double only every 4x (128 from 256 to 2K, 512 to 8K): 2049 rows ran as 2560, whose padded
# pairs also crossed the MoE's dense-path threshold (`layers.moe.DENSE_EXPERT_PAIRS`) — mix
# 32*1@32768,2048@16384c replayed in 40.4 ms against 36.7 eager (docs/PERF.md, fourteenth session).
ROW_SIZES = tuple(sorted({*range(16, 257, 16), *(s for lo in (256, 512, 1024, 2048, 4096, 8192, 16384) for s in range(lo, 2 * lo + 1, lo // 8))}))
REQUEST_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# The fields of a step each piece reads (its `StepBuffer` holds and refills only those).
ENCODER_FIELDS = ("input_ids", "prev_tokens", "block_tables", "slots", "emit_from", "enc")
DECODER_FIELDS = ("block_tables", "slots", "dec", "dec_keep", "logits_index")


def _spread(total: int, parts: int, caps: list[int] | None = None) -> list[int]:
    """`total` as `parts` counts of at least 1 (at most caps[i]), the rest on the last ones."""
    out = [1] * parts
    left = total - parts
    for i in reversed(range(parts)):
        room = (caps[i] if caps else total) - out[i]
        take = min(left, room)
        out[i] += take
        left -= take
    if left or total < parts:
        raise ValueError(f"_spread: {total} rows do not fit {parts} requests (caps {caps})")
    return out


def _keep_all(step: Step) -> Step:
    """`step` with `dec_keep` set even when the decoder keeps every row (build_step leaves it
    None then): the decoder piece gathers its rows from the carry buffers in every case."""
    if step.dec_keep is None:
        step.dec_keep = torch.arange(step.dec.num_rows, device=step.slots.device)
    return step


class PiecewiseGraphs:
    """Runs any fast-path batch as two CUDA graphs: the encoder piece (every layer before
    the V4.1 CED split, and the split layer up to its attention: `Model.encode_step`) on the
    step's rows padded to a `row_sizes` bucket, and the decoder piece (`Model.decode_step`)
    on the rows the decoder keeps (bounded replay: each request's last `window`; exact mode:
    all) padded to a bucket of its own, each for a bucket of `request_sizes` requests.

    The pieces meet in fixed buffers of max(row_sizes) rows (the `Carry` at the split: the
    residual streams, the split layer's attention input and mixes, ids, engram hashes, the
    published selections): the encoder graph of R rows writes their first R rows and the
    decoder graph gathers its rows from them (`step.dec_keep`), so a decoder graph serves any
    encoder bucket and the graphs number len(request buckets) x (row buckets used by either
    piece), not their product. Padding requests (as in `DecodeGraphs`: no blocks, write
    nothing) absorb the padding rows; each adds one logits row at the end. Graphs are captured
    on first use of a bucket (`capture` does it ahead). Without graphs (`use_graphs=False`,
    CPU) the pieces run eagerly on the same padded shapes, so outputs are the same."""

    def __init__(self, model: Model, cache: KVCacheStorage, *, max_blocks: int, row_sizes=ROW_SIZES, request_sizes=REQUEST_SIZES, use_graphs: bool | None = None):
        if not model.fast:
            raise ValueError("PiecewiseGraphs: the model runs the reference path (fast_path=False or an unsupported config)")
        row_sizes, request_sizes = sorted({int(s) for s in row_sizes}), sorted({int(s) for s in request_sizes})
        if not row_sizes or row_sizes[0] < 1 or not request_sizes or request_sizes[0] < 1:
            raise ValueError(f"row_sizes / request_sizes: expected positive sizes, got {row_sizes} / {request_sizes}")
        if max_blocks < 1:
            raise ValueError(f"max_blocks: expected >= 1, got {max_blocks}")
        self.model, self.cache, self.max_blocks = model, cache, max_blocks
        self.row_sizes, self.request_sizes = row_sizes, request_sizes
        self.use_graphs = model.device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and model.device.type != "cuda":
            raise ValueError("use_graphs: CUDA graphs need a CUDA model")
        self._encoders: dict[tuple[int, int], tuple[StepBuffer, torch.cuda.CUDAGraph]] = {}  # (requests, rows)
        self._decoders: dict[tuple[int, int, int], tuple[StepBuffer, torch.cuda.CUDAGraph, torch.Tensor]] = {}  # (requests, rows, logits)
        self._buffers: Carry | None = None
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.host_ms = 0.0

    # ------------------------------------------------------------------------- shapes
    def plan(self, batch: ForwardBatch) -> dict | None:
        """The padded shapes of `batch` (requests, rows and decoder rows of each piece, logits
        rows, the padding requests' row counts), or None when no bucket holds it."""
        if batch.trace is not None or batch.capture is not None or batch.block_tables.shape[1] > self.max_blocks:
            return None
        n, rows = batch.num_requests, sum(batch.num_tokens)
        dec = rows if batch.decoder_tokens is None else sum(min(k, t) for k, t in zip(batch.decoder_tokens, batch.num_tokens))
        up = lambda sizes, v: next((s for s in sizes if s >= v), None)
        for extra in (0, 1):  # no padding request when both row counts are buckets already
            b = up(self.request_sizes, n + extra)
            if b is None or n == 0:
                return None
            pad = b - n
            if pad == 0:
                if rows in self.row_sizes and dec in self.row_sizes:
                    return {"requests": b, "rows": rows, "dec_rows": dec, "logits": batch.logits_rows.numel(), "pad_rows": [], "pad_dec_rows": []}
                continue
            dec_b = up(self.row_sizes, dec + pad) if dec < rows else None
            rows_b = up(self.row_sizes, rows + max(pad, (dec_b or 0) - dec))
            if rows_b is None or (dec < rows and dec_b is None):
                return None
            if dec == rows:  # exact mode: the decoder keeps every row, padding included
                dec_b = rows_b
            pad_rows = _spread(rows_b - rows, pad)
            return {"requests": b, "rows": rows_b, "dec_rows": dec_b, "logits": batch.logits_rows.numel() + pad,
                    "pad_rows": pad_rows, "pad_dec_rows": _spread(dec_b - dec, pad, pad_rows)}
        return None

    def fits(self, batch: ForwardBatch) -> bool:
        return self.plan(batch) is not None

    # ------------------------------------------------------------------------- running
    def run(self, batch: ForwardBatch, resolve=None) -> torch.Tensor:
        """Logits [len(batch.logits_rows), vocab] (fp32) of a batch that `fits`; they live in
        a captured output: read them before the next call. `resolve` as in `DecodeGraphs.run`."""
        plan = self.plan(batch)
        if plan is None:
            raise ValueError("PiecewiseGraphs.run: no bucket holds the batch (see plan)")
        started = time.perf_counter()
        fresh = self._step(batch, plan, "cpu" if self.use_graphs else self.model.device)
        logits = batch.logits_rows.numel()
        if not self.use_graphs:
            if resolve is not None:
                resolve(fresh.input_ids)
            self._store(self.model.encode_step(fresh, self.cache))
            return self.model.logits(self.model.decode_step(self._buffers, fresh, self.cache))[:logits]
        enc_inputs, enc_graph = self._encoder(plan["requests"], plan["rows"])
        dec_inputs, dec_graph, out = self._decoder(plan["requests"], plan["dec_rows"], plan["logits"])
        enc_inputs.load(fresh)
        dec_inputs.load(fresh)
        if resolve is not None:  # (only the encoder piece reads the ids)
            resolve(enc_inputs.step.input_ids)
        self.host_ms = (time.perf_counter() - started) * 1e3
        enc_graph.replay()
        dec_graph.replay()
        return out[:logits]

    def capture(self, batch: ForwardBatch) -> None:
        """Capture the graphs `batch` will replay (no-op without graphs)."""
        plan = self.plan(batch)
        if plan is None:
            raise ValueError("PiecewiseGraphs.capture: no bucket holds the batch (see plan)")
        if self.use_graphs:
            self._encoder(plan["requests"], plan["rows"])
            self._decoder(plan["requests"], plan["dec_rows"], plan["logits"])

    # ------------------------------------------------------------------------- internals
    def _step(self, batch: ForwardBatch, plan: dict, device) -> Step:
        return _keep_all(build_step(batch, self.model.cfg, self.cache.block_size, device, pad_requests=len(plan["pad_rows"]),
                                    pad_rows=plan["pad_rows"], pad_dec_rows=plan["pad_dec_rows"], pad_logits=1, max_blocks=self.max_blocks))

    def _static(self, requests: int, rows: int, dec_rows: int, logits: int) -> Step:
        """A step of padding requests only (writes nothing) with the given shapes."""
        pad_rows = _spread(rows, requests)
        pad_dec = _spread(dec_rows, requests, pad_rows)
        pad_logits = _spread(logits, requests, pad_dec) if logits >= requests else [1] * logits + [0] * (requests - logits)
        return _keep_all(_padding_step(self.model, self.cache, self.max_blocks, requests, pad_rows=pad_rows, pad_dec_rows=pad_dec, pad_logits=pad_logits))

    def _store(self, carry: Carry) -> None:
        """Copy the encoder's carry into the first rows of the buffers (made on first use)."""
        if self._buffers is None:
            rows = max(self.row_sizes) if self.use_graphs else carry.ids.shape[0]
            wide = lambda t: t.new_zeros((rows, *t.shape[1:]))
            self._buffers = replace(carry.per_row(wide), shared={k: wide(v) for k, v in carry.shared.items()})
        buf = self._buffers
        if not self.use_graphs and buf.ids.shape[0] < carry.ids.shape[0]:  # eager: grow to the largest step
            self._buffers = None
            return self._store(carry)
        n = carry.ids.shape[0]
        for name in Carry.PER_ROW:
            src = getattr(carry, name)
            if src is not None:
                getattr(buf, name)[:n].copy_(src)
        for key, src in carry.shared.items():
            buf.shared[key][:n].copy_(src)

    def _encoder(self, requests: int, rows: int):
        key = (requests, rows)
        if key not in self._encoders:
            encode = lambda step: self._store(self.model.encode_step(step, self.cache))
            inputs, graph, _ = _capture(self._static(requests, rows, rows, requests), encode, self.model.device, self._pool, ENCODER_FIELDS)
            self._encoders[key] = (inputs, graph)
        return self._encoders[key]

    def _decoder(self, requests: int, dec_rows: int, logits: int):
        key = (requests, dec_rows, logits)
        if key not in self._decoders:
            if self._buffers is None:
                raise RuntimeError("PiecewiseGraphs: an encoder graph makes the carry buffers; capture one first")
            decode = lambda step: self.model.logits(self.model.decode_step(self._buffers, step, self.cache))
            self._decoders[key] = _capture(self._static(requests, dec_rows, dec_rows, logits), decode, self.model.device, self._pool, DECODER_FIELDS)
        return self._decoders[key]
