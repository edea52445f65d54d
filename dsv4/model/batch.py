"""The flat batch the model runs on: tokens of several requests concatenated, no padding.

The scheduler/runner builds one `ForwardBatch` per step; the model only reads it. Per-request
fields are Python lists (they drive per-request slicing in the torch reference ops) mirrored
by tensors where a kernel needs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, all requests' new tokens concatenated
    positions: torch.Tensor  # [T] int64, absolute position of each token
    start_pos: list[int]  # per request: position of its first token in this step
    num_tokens: list[int]  # per request: tokens in this step (>= 1)
    slots: list[int]  # per request: state-slot index (window rings, compressor tails)
    block_tables: torch.Tensor  # [B, max_blocks] int64 physical block ids (-1 = none)
    prev_tokens: torch.Tensor  # [B, max_ngram-1] ids of positions start-1, start-2, ... (-1: none)
    # Window keys below this position are invisible (0 normally; the replay start under
    # bounded replay, whose ring holds no state before it). Encoder side / every V4 layer.
    window_floor: list[int] = field(default_factory=list)
    # V4.1 layers from the CED split on (the last KV source's attention/FFN and after).
    decoder_window_floor: list[int] = field(default_factory=list)
    # Compressed groups that start below this position are already in the cache (prefix
    # hit): recompute their compressor state but never rewrite them.
    emit_from: list[int] = field(default_factory=list)
    # V4.1 CED: per request, how many of its last tokens run the layers after the split
    # (None: all tokens, the exact mode).
    decoder_tokens: list[int] | None = None
    # Flat rows (indices into the T tokens) whose final hidden state is returned.
    logits_rows: torch.Tensor | None = None
    # Optional recorder of selections (experts, index top-k, candidate blocks) for tests.
    trace: dict | None = None
    # Optional recorder of what the draft stages read from the target, for the logits rows:
    # "final_streams" [R, hc, D] (the last layer's streams before the final collapse; V4 MTP
    # input) and "dspark" {layer: [R, D]} (mean over the streams entering each of
    # cfg.dspark_target_layer_ids; V4.1 DSpark input).
    capture: dict | None = None

    def __post_init__(self) -> None:
        b = len(self.start_pos)
        if not self.window_floor:
            self.window_floor = [0] * b
        if not self.decoder_window_floor:
            self.decoder_window_floor = list(self.window_floor)
        if not self.emit_from:
            self.emit_from = [0] * b
        offsets = [0]
        for n in self.num_tokens:
            offsets.append(offsets[-1] + n)
        self.offsets = offsets  # cu_seqlens
        if self.logits_rows is None:
            self.logits_rows = torch.arange(offsets[-1], device=self.input_ids.device)

    @property
    def num_requests(self) -> int:
        return len(self.start_pos)

    def request_rows(self, b: int) -> slice:
        return slice(self.offsets[b], self.offsets[b + 1])
