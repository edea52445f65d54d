"""Incremental detokenization and stop handling for streamed generation.

Three layers, each usable alone:

* ``TokenBytes``: built once per tokenizer, maps every token id to the raw bytes it
  decodes to. DeepSeek-V4's tokenizer is byte-level BPE, so one token may carry half
  of a UTF-8 character (CJK, emoji); working on bytes rather than on re-decoded text
  makes each step O(1) and lets an incremental UTF-8 decoder hold partial characters
  back instead of emitting U+FFFD for them.
* ``IncrementalDetokenizer``: per request, token ids in, text deltas out. The
  concatenated deltas (plus ``flush()``) equal ``tokenizer.decode(ids)``.
* ``StopChecker``: per request, text deltas in, text that is safe to stream out.
  ``RequestStream`` combines both with stop tokens and the length limit.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer, decoders

from dsv4.engine.sampling_params import SamplingParams

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


def _byte_level_alphabet() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet: the printable character standing for each byte.

    Bytes that are printable and not whitespace stand for themselves; the remaining 68
    bytes are given the code points 256, 257, ... in byte order, so that every token
    string is made of visible characters.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\N{INVERTED EXCLAMATION MARK}"), ord("\N{NOT SIGN}") + 1),
        *range(ord("\N{REGISTERED SIGN}"), ord("\N{LATIN SMALL LETTER Y WITH DIAERESIS}") + 1),
    ]
    alphabet = {chr(b): b for b in printable}
    extra = 256
    for b in range(256):
        if b not in printable:
            alphabet[chr(extra)] = b
            extra += 1
    return alphabet


class TokenBytes:
    """Raw bytes of every token id of a byte-level ``tokenizers.Tokenizer`` (build once, share).

    A token maps character by character through the byte-level alphabet; a token with
    any character outside it (added tokens such as ``<｜User｜>``) stands for its own
    UTF-8 text. This is the rule the library's ByteLevel decoder applies, so decoding
    these bytes reproduces ``Tokenizer.decode``.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        if not isinstance(tokenizer.decoder, decoders.ByteLevel):
            raise ValueError(
                f"tokenizer: must use a ByteLevel decoder, got {type(tokenizer.decoder).__name__}"
            )
        alphabet = _byte_level_alphabet()
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        # Ids without a token decode to nothing, as in Tokenizer.decode.
        self._bytes: list[bytes] = [b""] * self.vocab_size
        for token, token_id in tokenizer.get_vocab(with_added_tokens=True).items():
            try:
                self._bytes[token_id] = bytes(alphabet[c] for c in token)
            except KeyError:
                self._bytes[token_id] = token.encode("utf-8")
        self.special_ids = frozenset(
            token_id for token_id, tok in tokenizer.get_added_tokens_decoder().items() if tok.special
        )

    def __getitem__(self, token_id: int) -> bytes:
        return self._bytes[token_id] if 0 <= token_id < self.vocab_size else b""


class IncrementalDetokenizer:
    """Turns token ids, appended one at a time, into text deltas.

    Incomplete UTF-8 sequences at the end are held back until the bytes that complete
    them arrive; bytes that can never form a character become U+FFFD as soon as that is
    certain, exactly as a full decode would render them. ``flush()`` at the end renders a
    still-incomplete tail (as U+FFFD, again matching a full decode).
    """

    def __init__(self, token_bytes: TokenBytes, skip_special_tokens: bool = True) -> None:
        self._token_bytes = token_bytes
        self._skip_special_tokens = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if self._skip_special_tokens and token_id in self._token_bytes.special_ids:
            return ""
        return self._utf8.decode(self._token_bytes[token_id])

    def push_many(self, token_ids: Sequence[int]) -> str:
        return "".join(self.push(t) for t in token_ids)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


@dataclass
class StopMatch:
    text: str  # the output text up to the stop (or through it, with include_stop_str_in_output)
    stop_str: str


class StopChecker:
    """Finds stop strings in streamed text without ever emitting text it must take back.

    The stream is cut at the first point where its text contains any stop string: among
    the occurrences, the one that ends first wins (ties go to the longer string, i.e. the
    one starting earlier). That result does not depend on how the text was split into
    deltas. A tail that could still grow into a stop string is held back until later text
    rules that out, or until ``flush()`` releases it at the end of generation.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self._stop = list(stop)
        self._include_stop = include_stop_str_in_output
        self._held = ""
        self.stopped: StopMatch | None = None

    def feed(self, delta: str, detect: bool = True) -> str:
        """Add ``delta``; return the text that is now safe to emit.

        With ``detect=False`` (the request is below ``min_tokens``) stop strings are not
        acted on yet, but possible prefixes are still held back so a stop string that
        straddles the ``min_tokens`` boundary is caught. After a stop, ``self.stopped``
        is set and its ``text`` is the final piece to emit; further feeding is an error.
        """
        if self.stopped is not None:
            raise RuntimeError("StopChecker.feed after a stop string was found")
        text = self._held + delta
        if detect:
            match = self._first_stop(text)
            if match is not None:
                start, stop_str = match
                end = start + len(stop_str) if self._include_stop else start
                self._held = ""
                self.stopped = StopMatch(text=text[:end], stop_str=stop_str)
                return ""
        keep = self._longest_stop_prefix_suffix(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def flush(self) -> str:
        """Release the held-back tail when generation ends for another reason."""
        held, self._held = self._held, ""
        return held

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, -length, stop string)
        for s in self._stop:
            start = text.find(s)
            if start >= 0:
                key = (start + len(s), -len(s), s)
                if best is None or key < best:
                    best = key
        return None if best is None else (best[0] + best[1], best[2])

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest


@dataclass
class StreamDelta:
    text: str  # new text to send (may be empty while bytes or a stop prefix are pending)
    finish_reason: str | None  # None, FINISH_STOP or FINISH_LENGTH
    stop_reason: str | int | None  # matched stop string or stop token id; None for eos/length


class RequestStream:
    """One request's output: token ids in, streamable text and finish state out.

    Finishes with "stop" on eos (unless ``ignore_eos``), on a ``stop_token_ids`` token
    or on a stop string, and with "length" once ``max_output_tokens`` tokens exist. As in
    vLLM, a stop token's own text is left out unless ``include_stop_str_in_output``, and
    stops are not acted on before ``min_tokens`` tokens (the sampler also suppresses eos
    and stop tokens until then).
    """

    def __init__(
        self,
        token_bytes: TokenBytes,
        params: SamplingParams,
        *,
        eos_token_id: int | None,
        max_output_tokens: int | None = None,
    ) -> None:
        """``max_output_tokens`` defaults to ``params.max_tokens``; pass the tighter bound
        when the context length limits the request (None = no limit here)."""
        self.params = params
        self._eos_token_id = None if params.ignore_eos else eos_token_id
        self._max_output_tokens = params.max_tokens if max_output_tokens is None else max_output_tokens
        self._detokenizer = IncrementalDetokenizer(token_bytes, params.skip_special_tokens)
        self._stop_checker = StopChecker(params.stop, params.include_stop_str_in_output)
        self.num_tokens = 0
        self.text = ""
        self.finish_reason: str | None = None

    def append(self, token_id: int) -> StreamDelta:
        if self.finish_reason is not None:
            raise RuntimeError("RequestStream.append after the request finished")
        self.num_tokens += 1
        may_stop = self.num_tokens >= self.params.min_tokens

        stop_token = may_stop and (
            token_id == self._eos_token_id or token_id in self.params.stop_token_ids
        )
        if stop_token:
            delta = self._detokenizer.push(token_id) if self.params.include_stop_str_in_output else ""
            stop_reason = None if token_id == self._eos_token_id else token_id
            return self._finish(self._stop_checker.feed(delta, detect=False), FINISH_STOP, stop_reason)

        emitted = self._stop_checker.feed(self._detokenizer.push(token_id), detect=may_stop)
        if self._stop_checker.stopped is not None:
            match = self._stop_checker.stopped
            return self._finish(emitted + match.text, FINISH_STOP, match.stop_str)
        if self._max_output_tokens is not None and self.num_tokens >= self._max_output_tokens:
            return self._finish(emitted, FINISH_LENGTH, None)
        self.text += emitted
        return StreamDelta(emitted, None, None)

    def finish(self, finish_reason: str) -> StreamDelta:
        """End the request for a reason decided elsewhere (context full, abort): release held text."""
        return self._finish("", finish_reason, None)

    def _finish(self, emitted: str, finish_reason: str, stop_reason: str | int | None) -> StreamDelta:
        if self._stop_checker.stopped is None:
            # Nothing can follow any more: a held stop-string prefix is plain text now, and
            # incomplete UTF-8 bytes render as U+FFFD, as in a full decode.
            emitted += self._stop_checker.flush() + self._detokenizer.flush()
        self.finish_reason = finish_reason
        self.text += emitted
        return StreamDelta(emitted, finish_reason, stop_reason)
