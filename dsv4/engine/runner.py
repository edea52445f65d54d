"""Model runner: turns the scheduler's chunks into one flat ForwardBatch, runs the model and
returns the logits rows the engine needs (the last row of every sampling chunk, plus every
row of a chunk whose request asked for prompt logprobs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.cache.manager import KVCacheManager
from dsv4.cache.storage import KVCacheStorage
from dsv4.engine.cuda_graphs import DecodeGraphs, PiecewiseGraphs
from dsv4.engine.scheduler import Chunk
from dsv4.model.batch import ForwardBatch
from dsv4.model.model import Model


@dataclass
class StepLogits:
    logits: torch.Tensor  # [R, V] fp32
    sample_rows: dict[str, int]  # request id -> row of its next-token logits
    prompt_rows: dict[str, tuple[int, int]]  # request id -> (first row, count) of prompt logits


class ModelRunner:
    """`decode`: runs decode-shaped steps padded to size buckets, `prefill` the other steps
    in its two pieces padded to row buckets (both from CUDA graphs on the GPU, padded the same
    way without them); None: every step runs the model as it comes (the reference path)."""

    def __init__(self, model: Model, storage: KVCacheStorage, manager: KVCacheManager, decode: DecodeGraphs | None = None,
                 prefill: PiecewiseGraphs | None = None):
        self.model, self.storage, self.manager, self.decode, self.prefill = model, storage, manager, decode, prefill
        self.device = model.device
        self.lookback = max(model.cfg.engram_max_ngram_size - 1, 1)

    def build_batch(self, chunks: list[Chunk]) -> tuple[ForwardBatch, dict, dict]:
        ids, pos, tables, prev = [], [], [], []
        starts, counts, slots, floors, dec_floors, emit, dec_tokens, rows = [], [], [], [], [], [], [], []
        sample_rows, prompt_rows = {}, {}
        offset = 0
        for c in chunks:
            req = c.req
            tokens = req.all_token_ids
            ids.extend(tokens[c.start : c.start + c.num_tokens])
            pos.extend(range(c.start, c.start + c.num_tokens))
            tables.append(self.manager.block_table(req.request_id))
            prev.append([tokens[c.start - 1 - s] if c.start - 1 - s >= 0 else -1 for s in range(self.lookback)])
            starts.append(c.start)
            counts.append(c.num_tokens)
            slots.append(req.slot)
            floors.append(req.window_floor)
            dec_floors.append(req.decoder_floor)
            emit.append(req.emit_from)
            n_dec = c.num_tokens if req.full_decoder else min(max(c.start + c.num_tokens - req.decoder_start, 0), c.num_tokens)
            dec_tokens.append(n_dec)
            if req.params.prompt_logprobs is not None and c.start < len(req.prompt_token_ids) - 1:
                n_prompt = min(c.start + c.num_tokens, len(req.prompt_token_ids) - 1) - c.start
                prompt_rows[req.request_id] = (len(rows), n_prompt)
                rows.extend(range(offset, offset + n_prompt))
            if c.samples:
                sample_rows[req.request_id] = len(rows)
                rows.append(offset + c.num_tokens - 1)
            offset += c.num_tokens
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.long)
        dev = "cpu" if self.model.fast else self.device  # the fast path uploads its own step (dsv4.model.step)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(pos, dtype=torch.long, device=dev),
            start_pos=starts,
            num_tokens=counts,
            slots=slots,
            block_tables=block_tables.to(dev),
            prev_tokens=torch.tensor(prev, dtype=torch.long, device=dev),
            window_floor=floors,
            decoder_window_floor=dec_floors,
            emit_from=emit,
            decoder_tokens=dec_tokens,
            logits_rows=torch.tensor(rows, dtype=torch.long, device=dev),
        )
        return batch, sample_rows, prompt_rows

    def run(self, chunks: list[Chunk]) -> StepLogits:
        batch, sample_rows, prompt_rows = self.build_batch(chunks)
        if self.decode is not None and self.decode.fits(batch):
            return StepLogits(self.decode.run(batch), sample_rows, prompt_rows)
        if self.prefill is not None and self.prefill.fits(batch):
            return StepLogits(self.prefill.run(batch), sample_rows, prompt_rows)
        hidden = self.model.forward(batch, self.storage)
        return StepLogits(self.model.logits(hidden), sample_rows, prompt_rows)
