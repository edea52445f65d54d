"""Decode steps on fixed shapes: batches padded to a size bucket, replayed from CUDA graphs.

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

import torch

from dsv4.cache.storage import KVCacheStorage
from dsv4.model.batch import ForwardBatch
from dsv4.model.model import Model
from dsv4.model.step import Step, build_step

# Batch-size buckets (vLLM's default capture sizes up to 256, in steps of 8 beyond 8).
DEFAULT_SIZES = (1, 2, 4, 8, *range(16, 257, 8))


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
        self._steps: dict[int, tuple[Step, torch.cuda.CUDAGraph, torch.Tensor]] = {}  # bucket -> captured
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

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [n * rows, vocab] (fp32) of a batch that `fits`, padded to its bucket."""
        if not self.fits(batch):
            raise ValueError("DecodeGraphs.run: the batch is not decode-shaped (see fits)")
        n = batch.num_requests
        size = self.bucket(n)
        started = time.perf_counter()
        fresh = build_step(batch, self.model.cfg, self.cache.block_size, "cpu" if self.use_graphs else self.model.device,
                           pad_requests=size - n, pad_rows=self.rows, max_blocks=self.max_blocks, pinned=self.use_graphs)
        if not self.use_graphs:
            return self._body(fresh)[: n * self.rows]
        step, graph, out = self._entry(size)
        step.copy_(fresh)
        self.host_ms = (time.perf_counter() - started) * 1e3  # the host's share of a step (benchmarks report it)
        graph.replay()
        return out[: n * self.rows]

    # ------------------------------------------------------------------------- internals
    def _body(self, step: Step) -> torch.Tensor:
        return self.model.logits(self.model.forward_step(step, self.cache))

    def _static_step(self, size: int) -> Step:
        """A step of `size` padding requests (writes nothing) with the captured shapes."""
        cfg, device = self.model.cfg, self.model.device
        look_back = max(cfg.engram_max_ngram_size - 1, 1)
        empty = ForwardBatch(
            input_ids=torch.zeros(0, dtype=torch.long, device=device), positions=torch.zeros(0, dtype=torch.long, device=device),
            start_pos=[], num_tokens=[], slots=[], block_tables=torch.zeros(0, self.max_blocks, dtype=torch.long, device=device),
            prev_tokens=torch.zeros(0, look_back, dtype=torch.long, device=device),
        )
        return build_step(empty, cfg, self.cache.block_size, device, pad_requests=size, pad_rows=self.rows, max_blocks=self.max_blocks)

    def _entry(self, size: int) -> tuple[Step, torch.cuda.CUDAGraph, torch.Tensor]:
        if size not in self._steps:
            step = self._static_step(size)
            # warm up outside the graph (Triton compiles, cuBLAS picks its kernels), on a side
            # stream as capture requires
            side = torch.cuda.Stream(self.model.device)
            side.wait_stream(torch.cuda.current_stream(self.model.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._body(step)
            torch.cuda.current_stream(self.model.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self._body(step)
            self._steps[size] = (step, graph, out)
        return self._steps[size]
