"""Per-request sampling parameters.

Field names and defaults follow vLLM's ``SamplingParams`` so that clients written
against the OpenAI-compatible servers of vLLM/SGLang map onto dsv4 one-to-one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Below this temperature we sample greedily: dividing float32 logits by a value this
# small overflows to inf and the softmax degenerates into NaNs anyway.
GREEDY_TEMPERATURE_EPS = 1e-5

MAX_N = 128
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to sample one request's continuation and when to stop it.

    ``temperature == 0`` (below ``GREEDY_TEMPERATURE_EPS``) means greedy decoding, in
    which case ``top_p``/``top_k``/``min_p`` and ``seed`` have no effect.
    ``top_k`` of 0 or -1 disables top-k. ``max_tokens=None`` lets the request run until
    the model's context length. ``logprobs``/``prompt_logprobs`` ask for the top-N
    alternatives per position (0 = only the chosen token's own logprob).
    ``validate()`` runs on construction; call it again after mutating a field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        # Accept the OpenAI-style shorthands: a single stop string, or None for "no stops".
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    def validate(self) -> None:
        """Raise ``ValueError("<field>: <expectation>, got <value>")`` on the first bad field."""
        _check_int("n", self.n, 1, MAX_N)
        _check_float("temperature", self.temperature, lo=0.0)
        _check_float("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _check_int("top_k", self.top_k, -1)
        _check_float("min_p", self.min_p, lo=0.0, hi=1.0)
        _check_float("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
        _check_float("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        if self.seed is not None:
            _check_int("seed", self.seed)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop: must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, 0)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens: must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, 0, MAX_LOGPROBS)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be a bool, got {getattr(self, name)!r}")


def _check_int(name: str, value: object, lo: int | None = None, hi: int | None = None) -> None:
    # bool is a subclass of int; `top_k=True` is a client bug, not a value of 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name}: must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name}: must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name}: must be <= {hi}, got {value}")


def _check_float(
    name: str, value: object, lo: float, hi: float | None = None, lo_open: bool = False
) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name}: must be a finite number, got {value!r}")
    if lo_open and value <= lo:
        raise ValueError(f"{name}: must be > {lo}, got {value}")
    if not lo_open and value < lo:
        raise ValueError(f"{name}: must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name}: must be <= {hi}, got {value}")
