"""Model runner: turns the scheduler's chunks into one flat ForwardBatch, runs the model and
returns the logits rows the engine needs (the last row of every sampling chunk, plus every
row of a chunk whose request asked for prompt logprobs).

Under async scheduling (`EngineConfig.async_scheduling`) a step is built while the previous
one still runs, before its sampled tokens reach the host: a request's newest token is then a
placeholder (`pending_token(slot)`) in its token list, and `PendingTokens.resolve` replaces
it on the device, from the token the sampler wrote for that slot, before the forward reads
the ids (stream order: the sampler of the previous step has run by then)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.cache.manager import KVCacheManager
from dsv4.cache.storage import KVCacheStorage
from dsv4.engine.cuda_graphs import DecodeGraphs, PiecewiseGraphs
from dsv4.engine.scheduler import Chunk
from dsv4.model.batch import ForwardBatch
from dsv4.model.model import Model


def pending_token(slot: int) -> int:
    """The placeholder id of the token being sampled for state slot `slot` (<= -2: -1 means
    "no token" in a step's look-back ids)."""
    return -2 - slot


class PendingTokens:
    """The last token sampled for each state slot, on the device (async scheduling)."""

    def __init__(self, num_slots: int, device: torch.device):
        self.tokens = torch.zeros(num_slots, dtype=torch.long, device=device)

    def record(self, slots: list[int], sampled: torch.Tensor) -> None:
        """`sampled[i]` is the token just sampled for slot `slots[i]` (no host sync)."""
        self.tokens.index_copy_(0, torch.tensor(slots, dtype=torch.long).to(self.tokens.device, non_blocking=True), sampled)

    def resolve(self, ids: torch.Tensor) -> None:
        """In place on the device: every placeholder `pending_token(s)` in `ids` becomes the
        token recorded for slot s."""
        slots = (-2 - ids).clamp_(min=0)
        ids.copy_(torch.where(ids <= -2, self.tokens[slots], ids))


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
            # only a request's newest token can be pending, and a chunk never starts after it
            prev.append([tokens[c.start - 1 - s] if c.start - 1 - s >= 0 else -1 for s in range(self.lookback)])
            if min(prev[-1]) < -1:
                raise RuntimeError(f"request {req.request_id!r}: a pending token in the look-back of a chunk at {c.start}")
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

    def run(self, chunks: list[Chunk], pending: PendingTokens | None = None) -> StepLogits:
        """Queue the step on the device (nothing waits for it); `pending` resolves the
        placeholders among the ids (async scheduling)."""
        batch, sample_rows, prompt_rows = self.build_batch(chunks)
        resolve = pending.resolve if pending is not None else None
        if self.decode is not None and self.decode.fits(batch):
            return StepLogits(self.decode.run(batch, resolve), sample_rows, prompt_rows)
        if self.prefill is not None and self.prefill.fits(batch):
            return StepLogits(self.prefill.run(batch, resolve), sample_rows, prompt_rows)
        if resolve is not None:
            resolve(batch.input_ids)
        hidden = self.model.forward(batch, self.storage)
        return StepLogits(self.model.logits(hidden), sample_rows, prompt_rows)
