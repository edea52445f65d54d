"""Structured output (guided decoding): JSON schema, JSON object, regex, choice and EBNF.

The OpenAI-compatible server turns a request's ``response_format`` or vLLM-style
``guided_*`` / ``structured_outputs`` fields into a ``GrammarSpec`` (``spec_from_openai``),
the ``GrammarCompiler`` compiles it once per distinct spec against the tokenizer, and each
request gets a ``GrammarMatcher`` that yields the allowed-token mask for the next step and
follows the tokens actually sampled. ``fill_masks`` builds the [B, V] mask of a whole batch
for ``SamplingBatch.build(allowed_token_masks=...)``.

xgrammar does the grammar work: it precomputes, per grammar state, which of the 129,280
tokens can follow, so a mask costs a fraction of a millisecond. Masks travel as xgrammar's
int32 bitmask (one bit per token, 32x smaller than a bool mask) and are expanded to bool on
the target device.

Only the tokenizer's plain byte-level tokens can be produced under a grammar: added tokens
(``<think>``, ``<｜User｜>``, tool-call markers, place-holders) are control markers rather
than text, and emitting one inside, say, a JSON string would derail the chat parsers, so
they are never allowed. EOS is allowed exactly where the grammar may end.

Reasoning models think first: a matcher built with ``starts_in_reasoning`` leaves every
token allowed until the end-of-thinking marker (``</think>``, one added token in DeepSeek-V4)
has been sampled, and constrains only the answer after it.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch
import xgrammar as xgr
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
REASONING_END_MARKER = "</think>"
DEEPSEEK_EOS_TOKEN_ID = 1

# vLLM's request extensions: field name -> spec kind.
_GUIDED_FIELDS = (
    ("guided_json", "json_schema"),
    ("guided_regex", "regex"),
    ("guided_choice", "choice"),
    ("guided_grammar", "grammar"),
)
_STRUCTURED_OUTPUTS_FIELDS = (
    ("json", "json_schema"),
    ("regex", "regex"),
    ("choice", "choice"),
    ("grammar", "grammar"),
)
_REGEX_SPECIAL = frozenset("\\^$.|?*+()[]{}")
# xgrammar prefixes its C++ errors with "[hh:mm:ss] /path/file.cc:123: " and sometimes a
# failed internal check; neither means anything to an API client.
_XGR_ERROR_NOISE = re.compile(r"^\[[\d:]+\]\s+\S+?:\d+:\s*|Check failed: \(.*?\) is false:\s*")


class StructuredOutputError(ValueError):
    """An invalid structured-output request; the message names the offending request field
    (the server answers 400 with it)."""


def _clean_error(exc: BaseException) -> str:
    text = _XGR_ERROR_NOISE.sub("", str(exc).strip()).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def choice_regex(choices: Sequence[str]) -> str:
    """A regex matching exactly one of ``choices``, each taken literally."""
    return "|".join("(" + "".join("\\" + c if c in _REGEX_SPECIAL else c for c in s) + ")" for s in choices)


@dataclass(frozen=True)
class GrammarSpec:
    """One output constraint, normalised and validated on construction.

    kind: one of ``KINDS``. value: ``json_schema`` a dict or JSON text (stored as compact
    JSON text, keys in their given order since that order is the generated order);
    ``json_object`` none; ``regex`` / ``grammar`` (EBNF, GBNF) a string; ``choice`` a
    non-empty list of strings (stored as a tuple). The normalised spec is hashable and is
    the compile-cache key. ``field`` is the request field it came from, for error messages;
    it takes no part in equality.
    """

    kind: str
    value: Any = None
    field: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StructuredOutputError(
                f"{self.label}: unknown constraint kind {self.kind!r}, expected one of {KINDS}"
            )
        object.__setattr__(self, "value", self._normalised_value())
        self._validate_syntax()

    @property
    def label(self) -> str:
        return self.field or self.kind

    def _normalised_value(self) -> str | tuple[str, ...] | None:
        value = self.value
        if self.kind == "json_object":
            return None
        if self.kind == "json_schema":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as exc:
                    raise StructuredOutputError(f"{self.label}: not valid JSON: {exc}") from None
            if not isinstance(value, dict):
                raise StructuredOutputError(f"{self.label}: a JSON schema must be a JSON object")
            try:
                return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise StructuredOutputError(f"{self.label}: schema is not JSON-serialisable: {exc}") from None
        if self.kind == "choice":
            if isinstance(value, str) or not isinstance(value, Sequence) or not value:
                raise StructuredOutputError(f"{self.label}: must be a non-empty list of strings")
            if not all(isinstance(c, str) for c in value):
                raise StructuredOutputError(f"{self.label}: every choice must be a string")
            return tuple(value)
        if not isinstance(value, str) or not value:
            raise StructuredOutputError(f"{self.label}: must be a non-empty string")
        return value

    def _validate_syntax(self) -> None:
        """Parse the constraint without a tokenizer (well under a millisecond), so that a bad
        schema, regex or grammar is refused when the request arrives, before any compiling."""
        try:
            if self.kind == "json_schema":
                xgr.Grammar.from_json_schema(self.value)
            elif self.kind == "regex":
                xgr.Grammar.from_regex(self.value)
            elif self.kind == "choice":
                xgr.Grammar.from_regex(choice_regex(self.value))
            elif self.kind == "grammar":
                xgr.Grammar.from_ebnf(self.value)
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError with C++ text
            raise StructuredOutputError(
                f"{self.label}: invalid {self.kind.replace('_', ' ')}: {_clean_error(exc)}"
            ) from None


def spec_from_openai(
    response_format: Mapping[str, Any] | None, extra: Mapping[str, Any] | None = None
) -> GrammarSpec | None:
    """The constraint an OpenAI-style request asks for, or None for free text.

    Reads ``response_format`` (``text`` / ``json_object`` / ``json_schema``) and the vLLM
    extensions ``guided_json|regex|choice|grammar`` and ``structured_outputs`` (keys
    ``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) from ``extra``. At most
    one constraint may be given. The OpenAI ``strict`` flag needs no handling: the grammar
    always enforces the schema."""
    found: list[tuple[str, Any, str]] = []  # (kind, value, field)
    if response_format is not None:
        if not isinstance(response_format, Mapping):
            raise StructuredOutputError("response_format: must be an object")
        rtype = response_format.get("type")
        if rtype == "json_schema":
            body = response_format.get("json_schema")
            if not isinstance(body, Mapping) or body.get("schema") is None:
                raise StructuredOutputError(
                    "response_format.json_schema.schema: required for type 'json_schema'"
                )
            found.append(("json_schema", body["schema"], "response_format.json_schema.schema"))
        elif rtype == "json_object":
            found.append(("json_object", None, "response_format"))
        elif rtype != "text":
            raise StructuredOutputError(
                f"response_format.type: must be 'text', 'json_object' or 'json_schema', got {rtype!r}"
            )
    extra = extra or {}
    for name, kind in _GUIDED_FIELDS:
        if extra.get(name) is not None:
            found.append((kind, extra[name], name))
    outputs = extra.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, Mapping):
            raise StructuredOutputError("structured_outputs: must be an object")
        for name, kind in _STRUCTURED_OUTPUTS_FIELDS:
            if outputs.get(name) is not None:
                found.append((kind, outputs[name], f"structured_outputs.{name}"))
        if outputs.get("json_object"):
            found.append(("json_object", None, "structured_outputs.json_object"))
    if len(found) > 1:
        first, second = found[0][2], found[1][2]
        raise StructuredOutputError(
            f"{second}: only one structured output constraint may be given, {first} is too"
        )
    if not found:
        return None
    kind, value, source = found[0]
    return GrammarSpec(kind, value, field=source)


def _rust_tokenizer(tokenizer: Any) -> RustTokenizer:
    """A ``tokenizers.Tokenizer`` from a tokenizer.json path, such an object, or a wrapper
    holding one as ``.backend`` (``dsv4.model.tokenizer.Tokenizer``)."""
    if isinstance(tokenizer, RustTokenizer):
        return tokenizer
    if isinstance(tokenizer, (str, os.PathLike)):
        return RustTokenizer.from_file(os.fspath(tokenizer))
    backend = getattr(tokenizer, "backend", None)
    if isinstance(backend, RustTokenizer):
        return backend
    raise TypeError(
        f"tokenizer: expected a tokenizer.json path or a tokenizers.Tokenizer, got {type(tokenizer).__name__}"
    )


def find_reasoning_end_token_ids(tokenizer: Any, marker: str = REASONING_END_MARKER) -> list[int]:
    """Token ids that ``marker`` encodes to (DeepSeek-V4: ``</think>`` is the single added
    token 128822); pass them to ``GrammarMatcher(reasoning_end_token_ids=...)``."""
    ids = _rust_tokenizer(tokenizer).encode(marker, add_special_tokens=False).ids
    if not ids:
        raise ValueError(f"reasoning end marker {marker!r} encodes to no tokens")
    return list(ids)


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A spec compiled for one tokenizer: what ``GrammarMatcher`` is built from (shareable
    across requests and threads; it holds no per-request state)."""

    spec: GrammarSpec
    grammar: xgr.CompiledGrammar
    vocab_size: int
    eos_token_id: int
    eos_only_bitmask: torch.Tensor = field(repr=False)  # [ceil(V/32)] int32, only EOS set


def _bitmask_width(vocab_size: int) -> int:
    return xgr.get_bitmask_shape(1, vocab_size)[1]


def _eos_only_bitmask(vocab_size: int, eos_token_id: int) -> torch.Tensor:
    row = torch.zeros(_bitmask_width(vocab_size), dtype=torch.int32)
    word, bit = divmod(eos_token_id, 32)
    # Bit 31 is the int32 sign bit; build the word in int64 and wrap it.
    row[word] = torch.tensor(1 << bit, dtype=torch.int64).to(torch.int32)
    return row


class GrammarCompiler:
    """Compiles ``GrammarSpec``s for one tokenizer, each distinct spec once (LRU cache).

    tokenizer: tokenizer.json path, ``tokenizers.Tokenizer`` or ``dsv4`` ``Tokenizer``
    (byte-level BPE). vocab_size: the model's vocabulary (logit) size, which may exceed the
    tokenizer's; ids past the tokenizer's are never allowed. eos_token_id: the only token
    allowed once a grammar is complete. any_whitespace / max_whitespace: JSON may put up to
    ``max_whitespace`` whitespace characters between elements (so a model may pretty-print,
    but cannot loop on whitespace forever); ``any_whitespace=False`` forces the one-line
    ``json.dumps`` layout. cache_size: compiled grammars kept. compile_workers: threads of
    the ``compile_async`` pool, which keeps compiling off the engine's step loop.

    Thread-safe: concurrent requests for a spec share one compilation.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        *,
        eos_token_id: int = DEEPSEEK_EOS_TOKEN_ID,
        any_whitespace: bool = True,
        max_whitespace: int | None = 32,
        cache_size: int = 256,
        compile_workers: int = 2,
    ) -> None:
        backend = _rust_tokenizer(tokenizer)
        if not isinstance(backend.decoder, decoders.ByteLevel):
            raise ValueError(
                f"tokenizer: must be byte-level BPE, got a {type(backend.decoder).__name__} decoder"
            )
        tokenizer_size = backend.get_vocab_size(with_added_tokens=True)
        if vocab_size < tokenizer_size:
            raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {tokenizer_size} ids")
        if not 0 <= eos_token_id < tokenizer_size:
            raise ValueError(f"eos_token_id {eos_token_id} is not a token id")
        if cache_size < 1:
            raise ValueError("cache_size must be at least 1")
        # xgrammar treats an empty token as special (never allowed), which is what both the
        # added tokens and the padding ids past the tokenizer need.
        encoded = [""] * vocab_size
        for token, token_id in backend.get_vocab(with_added_tokens=True).items():
            encoded[token_id] = token
        for token_id in backend.get_added_tokens_decoder():
            encoded[token_id] = ""
        self.tokenizer_info = xgr.TokenizerInfo(
            encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size, stop_token_ids=[eos_token_id]
        )
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._eos_only = _eos_only_bitmask(vocab_size, eos_token_id)
        self._any_whitespace = any_whitespace
        self._max_whitespace = max_whitespace if any_whitespace else None
        # Our cache replaces xgrammar's so that there is one bound on what is kept.
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, cache_enabled=False)
        self._cache: OrderedDict[GrammarSpec, Future[CompiledGrammar]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=compile_workers, thread_name_prefix="dsv4-grammar")

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar of ``spec``, compiled in this thread unless cached or already
        being compiled. Raises ``StructuredOutputError`` when compiling fails."""
        future, owner = self._claim(spec)
        if owner:
            self._build(spec, future)
        return future.result()

    def compile_async(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        """Like ``compile`` but on the compile pool; the future fails with
        ``StructuredOutputError``. The future may be shared with other callers of the same
        spec, so it cannot be cancelled."""
        future, owner = self._claim(spec)
        if owner:
            try:
                self._pool.submit(self._build, spec, future)
            except RuntimeError as exc:  # the pool is closed
                self._fail(spec, future, exc)
        return future

    def close(self) -> None:
        """Stop the compile pool once queued compilations finish."""
        self._pool.shutdown(wait=True)

    def _claim(self, spec: GrammarSpec) -> tuple[Future[CompiledGrammar], bool]:
        """The cache entry of ``spec`` and whether the caller must fill it (a new entry)."""
        if not isinstance(spec, GrammarSpec):
            raise TypeError(f"spec: expected a GrammarSpec, got {type(spec).__name__}")
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                return future, False
            future = Future()
            # Running from the start: a shared future must not be cancelled by one waiter.
            future.set_running_or_notify_cancel()
            self._cache[spec] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return future, True

    def _build(self, spec: GrammarSpec, future: Future[CompiledGrammar]) -> None:
        try:
            grammar = self._compile_xgr(spec)
        except Exception as exc:  # whatever fails must reach every waiter of the future
            self._fail(spec, future, exc)
            return
        future.set_result(CompiledGrammar(spec, grammar, self.vocab_size, self.eos_token_id, self._eos_only))

    def _fail(self, spec: GrammarSpec, future: Future[CompiledGrammar], exc: BaseException) -> None:
        """Fail ``future`` and drop it from the cache, so that the next request for the spec
        tries again rather than inheriting the failure."""
        with self._lock:
            if self._cache.get(spec) is future:
                del self._cache[spec]
        future.set_exception(exc)

    def _compile_xgr(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        json_options = {"any_whitespace": self._any_whitespace, "max_whitespace_cnt": self._max_whitespace}
        try:
            if spec.kind == "json_schema":
                return self._compiler.compile_json_schema(spec.value, **json_options)
            if spec.kind == "json_object":
                # Non-strict: an object with any properties, as OpenAI's JSON mode allows.
                return self._compiler.compile_json_schema(
                    '{"type":"object"}', strict_mode=False, **json_options
                )
            if spec.kind == "regex":
                return self._compiler.compile_regex(spec.value)
            if spec.kind == "choice":
                return self._compiler.compile_regex(choice_regex(spec.value))
            return self._compiler.compile_grammar(spec.value)
        except Exception as exc:
            raise StructuredOutputError(
                f"{spec.label}: cannot compile {spec.kind.replace('_', ' ')}: {_clean_error(exc)}"
            ) from exc


@cache
def _byte_bits(device: torch.device) -> torch.Tensor:
    """[256, 8] bool: row b holds the bits of byte b, least significant first."""
    return ((torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1).bool().to(device)


def _expand_bitmask(
    bitmask: torch.Tensor, vocab_size: int, device: torch.device | str | None
) -> torch.Tensor:
    """[B, ceil(V/32)] int32 bitmask -> [B, V] bool on ``device``. Only the compact bitmask
    crosses to the device, where a byte -> 8 bools table lookup writes the result directly
    (no full-size integer temporaries). Bit j of word k is token 32k + j; on a little-endian
    machine (x86, ARM, CUDA) that is bit j % 8 of byte 4k + j // 8."""
    packed = bitmask.to(device).view(torch.uint8)
    return _byte_bits(packed.device)[packed.int()].flatten(1)[:, :vocab_size]


class GrammarMatcher:
    """One request's position in its grammar.

    Per step the engine asks ``allowed_mask()`` (None: no constraint right now), samples, and
    feeds the sampled token to ``accept``; once ``is_terminated()`` the only token left is
    EOS. reasoning_end_token_ids: the end-of-thinking marker's ids
    (``find_reasoning_end_token_ids``); starts_in_reasoning: the prompt leaves the model
    thinking, so nothing is constrained until that marker has been accepted.
    """

    def __init__(
        self,
        compiled: CompiledGrammar,
        *,
        reasoning_end_token_ids: Sequence[int] | None = None,
        starts_in_reasoning: bool = False,
    ) -> None:
        if starts_in_reasoning and not reasoning_end_token_ids:
            raise ValueError(
                "starts_in_reasoning needs reasoning_end_token_ids, or the grammar would never apply"
            )
        self.compiled = compiled
        self._matcher = xgr.GrammarMatcher(compiled.grammar)
        self._end_marker = list(reasoning_end_token_ids or ())
        self._recent: deque[int] = deque(maxlen=max(len(self._end_marker), 1))
        self._starts_in_reasoning = starts_in_reasoning
        self._in_reasoning = starts_in_reasoning
        self._bitmask = torch.empty(1, compiled.eos_only_bitmask.numel(), dtype=torch.int32)
        self._bitmask_current = False

    @property
    def in_reasoning(self) -> bool:
        return self._in_reasoning

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled ``token_id``; False (state unchanged) if the grammar forbids
        it. While reasoning every token is accepted."""
        if self._in_reasoning:
            self._recent.append(token_id)
            if list(self._recent) == self._end_marker:
                self._in_reasoning = False
            return True
        if self._matcher.is_terminated():
            return False  # EOS already accepted; xgrammar would also log a warning
        accepted = self._matcher.accept_token(token_id)
        if accepted:
            self._bitmask_current = False
        return accepted

    def is_terminated(self) -> bool:
        """True once the grammar admits nothing but EOS (or EOS was accepted): the engine can
        stop the request. A grammar that is complete but may still grow (``\\d+`` after "12")
        is not terminated; its mask allows EOS and the continuations."""
        if self._in_reasoning:
            return False
        if self._matcher.is_terminated():
            return True
        if not self._matcher.is_completed():
            return False
        return torch.equal(self._fill()[0], self.compiled.eos_only_bitmask)

    def allowed_mask(self, device: torch.device | str | None = None) -> torch.Tensor | None:
        """[vocab_size] bool, True = may be sampled next; None while unconstrained."""
        if self._in_reasoning:
            return None
        return _expand_bitmask(self._fill(), self.compiled.vocab_size, device)[0]

    def reset(self) -> None:
        """Back to the state right after construction (e.g. to restart a preempted request)."""
        self._matcher.reset()
        self._recent.clear()
        self._in_reasoning = self._starts_in_reasoning
        self._bitmask_current = False

    def _fill(self) -> torch.Tensor:
        """The next-token bitmask [1, W], recomputed only after the state changed."""
        if not self._bitmask_current:
            self._fill_row(self._bitmask, 0)
            self._bitmask_current = True
        return self._bitmask

    def _fill_row(self, bitmask: torch.Tensor, row: int) -> None:
        if self._matcher.is_terminated():
            bitmask[row] = self.compiled.eos_only_bitmask  # xgrammar refuses to fill after EOS
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)


@cache
def _batch_filler() -> xgr.BatchGrammarMatcher:
    return xgr.BatchGrammarMatcher()


_batch_buffers = threading.local()


def _batch_bitmask(rows: int, width: int) -> torch.Tensor:
    """A reusable [rows, width] int32 CPU bitmask for this thread (grown on demand), so a
    step's mask fill allocates nothing."""
    buffer = getattr(_batch_buffers, "bitmask", None)
    if buffer is None or buffer.shape[0] < rows or buffer.shape[1] != width:
        buffer = torch.empty(max(rows, 1), width, dtype=torch.int32)
        _batch_buffers.bitmask = buffer
    return buffer[:rows]


def fill_masks(
    matchers: Sequence[GrammarMatcher | None], vocab_size: int, device: torch.device | str | None = None
) -> torch.Tensor | None:
    """The [B, vocab_size] bool allowed-token mask of a batch (row i for ``matchers[i]``;
    a None or still-reasoning row allows everything), or None when no row is constrained.
    Constrained rows are filled together by xgrammar's multithreaded batch filler."""
    constrained = [(row, m) for row, m in enumerate(matchers) if m is not None and not m.in_reasoning]
    if not constrained:
        return None
    for _, matcher in constrained:
        if matcher.compiled.vocab_size != vocab_size:
            raise ValueError(
                f"matcher compiled for vocab_size {matcher.compiled.vocab_size}, batch has {vocab_size}"
            )
    bitmask = _batch_bitmask(len(matchers), _bitmask_width(vocab_size))
    bitmask.fill_(-1)  # all bits set: everything allowed
    live_rows, live = [], []
    for row, matcher in constrained:
        if matcher._matcher.is_terminated():
            matcher._fill_row(bitmask, row)
        else:
            live_rows.append(row)
            live.append(matcher._matcher)
    if live:
        _batch_filler().batch_fill_next_token_bitmask(live, bitmask, live_rows)
    return _expand_bitmask(bitmask, vocab_size, device)
