"""One sequence the engine is computing: its tokens, progress, cache state and stream."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from dsv4.engine.detokenizer import RequestStream
from dsv4.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str  # unique per sequence (`parent#k` for the k-th of n samples)
    parent_id: str
    index: int  # which of the parent's n samples
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: RequestStream
    priority: int = 0
    cache_salt: str | None = None
    arrival: float = field(default_factory=time.monotonic)
    generator: torch.Generator | None = None
    grammar: object | None = None  # dsv4.engine.structured.GrammarMatcher
    wait_for: str | None = None  # sibling whose prompt must be cached before this one starts

    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # progress through all_token_ids: tokens whose window/compressor state is in the cache
    num_computed: int = 0
    # set at each admission
    prefill_target: int = 0  # tokens known at admission: compute them all, then sample
    num_cached_tokens: int = 0  # prefix-cache hit of the current admission
    emit_from: int = 0  # compressed groups below this are in shared cached blocks
    window_floor: int = 0  # encoder-side ring holds nothing below this
    decoder_start: int = 0  # V4.1 bounded replay: first position the decoder layers run on
    decoder_floor: int = 0
    full_decoder: bool = True  # run the decoder on every token (exact mode / prompt logprobs)
    slot: int | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None
    prompt_logprobs: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    # what the last step added, for streaming
    text_delta: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    stop_reason: str | int | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.prefill_target - 1
