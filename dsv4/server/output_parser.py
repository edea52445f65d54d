"""Turn DeepSeek-V4 generated text into OpenAI chat fields, streamed or whole.

The model writes its reasoning, then ``</think>``, then the answer, and optionally
a DSML tool-call block (the format that ``chat_format`` teaches it in the tools
prompt)::

    reasoning</think>answer

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

Reasoning is only present when the prompt opened a thinking block (see
``chat_format.generation_starts_in_reasoning``).  Parameters marked
``string="true"`` are raw strings; the others are JSON values.  Each call's
``arguments`` is the JSON object of its parameters, so re-encoding a parsed turn
with ``chat_format.encode_chat`` reproduces the DSML the model wrote.

Design rules, because this sits between a sampler and a client that may execute
what it receives:

* Never raise on model output and never drop text: a tool call is reported only
  for a complete, well-formed ``invoke``; any DSML that is malformed, truncated or
  empty is returned as content, verbatim.
* Stream with minimal delay: content and reasoning are released as soon as they
  cannot be the start of a marker; only a possible marker prefix (such as a
  trailing ``"\\n\\n<｜DS"``) is held back.  A tool call is announced (id and name)
  and its arguments sent once its ``invoke`` closes, so a client never sees a
  half-written call.
* Streaming and one-shot parsing are the same state machine, so every way of
  splitting the text into deltas yields the same result.

Input is the generated text without the stop token (the server strips it).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dsv4.server.chat_format import (
    INVOKE_CLOSE,
    INVOKE_OPEN_PREFIX,
    PARAMETER_CLOSE,
    PARAMETER_OPEN_PREFIX,
    THINK_END,
    TOOL_CALLS_CLOSE,
    TOOL_CALLS_OPEN,
    TOOL_CALLS_SEPARATOR,
)

__all__ = [
    "ContentDelta",
    "ParsedOutput",
    "ParserEvent",
    "ReasoningDelta",
    "StreamingOutputParser",
    "ToolCallDelta",
    "new_tool_call_id",
    "parse_output",
    "tool_parsing_enabled",
]


# --- Events -----------------------------------------------------------------------


@dataclass(frozen=True)
class ReasoningDelta:
    """A piece of ``reasoning_content``."""

    text: str

    def to_delta(self) -> dict[str, Any]:
        """The OpenAI streaming ``choices[].delta`` payload."""
        return {"reasoning_content": self.text}


@dataclass(frozen=True)
class ContentDelta:
    """A piece of ``content``."""

    text: str

    def to_delta(self) -> dict[str, Any]:
        """The OpenAI streaming ``choices[].delta`` payload."""
        return {"content": self.text}


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of tool call ``index``.

    The first delta of a call carries ``id`` and ``name`` (with empty arguments);
    the following ones carry argument chunks whose concatenation is the JSON
    ``arguments`` string, as in OpenAI streaming.
    """

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_delta(self) -> dict[str, Any]:
        """The OpenAI streaming ``choices[].delta`` payload."""
        if self.id is None:
            entry = {"index": self.index, "function": {"arguments": self.arguments}}
        else:
            entry = {
                "index": self.index,
                "id": self.id,
                "type": "function",
                "function": {"name": self.name, "arguments": self.arguments},
            }
        return {"tool_calls": [entry]}


ParserEvent = ReasoningDelta | ContentDelta | ToolCallDelta


@dataclass
class ParsedOutput:
    """An assistant turn assembled from parser events."""

    reasoning_content: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_events(cls, events: Iterable[ParserEvent]) -> ParsedOutput:
        out = cls()
        for event in events:
            out.add(event)
        return out

    def add(self, event: ParserEvent) -> None:
        """Fold one event in (what a client does with the deltas of a stream)."""
        if isinstance(event, ReasoningDelta):
            self.reasoning_content += event.text
        elif isinstance(event, ContentDelta):
            self.content += event.text
        elif event.id is not None:
            self.tool_calls.append(
                {
                    "id": event.id,
                    "type": "function",
                    "function": {"name": event.name, "arguments": event.arguments},
                }
            )
        else:
            self.tool_calls[event.index]["function"]["arguments"] += event.arguments

    def to_message(self) -> dict[str, Any]:
        """The OpenAI ``choices[].message``; empty fields become null as OpenAI does."""
        message: dict[str, Any] = {
            "role": "assistant",
            "content": self.content if self.content or not self.tool_calls else None,
            "reasoning_content": self.reasoning_content or None,
        }
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


# --- Public helpers ---------------------------------------------------------------


def tool_parsing_enabled(
    tool_choice: str | Mapping[str, Any] | None, tools: Sequence[Any] | None
) -> bool:
    """Whether DSML in the output should become ``tool_calls`` for this request.

    With ``tool_choice="none"`` or without tools, the client cannot accept tool
    calls, so anything tool-like the model writes stays content.  ``"auto"``,
    ``"required"`` and a named function parse normally; enforcing that a call
    happens is the prompt's and grammar's job, not the parser's.
    """
    return bool(tools) and tool_choice != "none"


def new_tool_call_id() -> str:
    """A fresh OpenAI-style tool call id."""
    return "call_" + secrets.token_hex(12)


def parse_output(
    text: str,
    *,
    starts_in_reasoning: bool,
    parse_tool_calls: bool = True,
    make_call_id: Callable[[], str] = new_tool_call_id,
) -> ParsedOutput:
    """Parse a complete generation (non-streaming responses)."""
    parser = StreamingOutputParser(
        starts_in_reasoning=starts_in_reasoning,
        parse_tool_calls=parse_tool_calls,
        make_call_id=make_call_id,
    )
    return ParsedOutput.from_events(parser.feed(text) + parser.finish())


# --- The state machine ---------------------------------------------------------------

_REASONING = "reasoning"  # before </think>
_CONTENT = "content"  # answer text, watching for a tool-call block
_BLOCK = "block"  # inside <｜DSML｜tool_calls>, between invokes

_SPACE = " \t\r\n"


class _NeedMore(Exception):
    """The text so far is a valid prefix of a DSML element; wait for more."""


class _NeedValueEnd(_NeedMore):
    """Inside a parameter value: nothing can change until its closing tag arrives."""


class _Malformed(Exception):
    """No continuation of the text can make it a valid DSML element."""


class StreamingOutputParser:
    """Incremental parser: ``feed`` deltas as they are decoded, then ``finish``.

    ``starts_in_reasoning`` says whether the prompt opened a thinking block;
    ``parse_tool_calls=False`` (see :func:`tool_parsing_enabled`) leaves DSML as
    content.  ``make_call_id`` names tool calls; tests pass a deterministic one.
    """

    def __init__(
        self,
        *,
        starts_in_reasoning: bool,
        parse_tool_calls: bool = True,
        make_call_id: Callable[[], str] = new_tool_call_id,
    ) -> None:
        self._state = _REASONING if starts_in_reasoning else _CONTENT
        self._parse_tool_calls = parse_tool_calls
        self._make_call_id = make_call_id
        self._buf = ""  # received text not yet classified
        # While a long parameter value streams in, new text is parked here unscanned
        # (rescanning the growing invoke on every delta would be quadratic); only
        # the closing tag, looked for in ``_value_tail`` + new text, resumes parsing.
        self._parked: list[str] = []
        self._value_tail: str | None = None
        # Text of the current tool-call block that no call has claimed yet; it is
        # released verbatim as content if the block never yields a call.
        self._unclaimed = ""
        self._calls_in_block = 0
        self._calls = 0
        self._finished = False

    def feed(self, text: str) -> list[ParserEvent]:
        """Consume a delta of generated text; return the events it completes."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if self._value_tail is not None:
            window = self._value_tail + text
            if PARAMETER_CLOSE not in window:
                self._parked.append(text)
                self._value_tail = window[-len(PARAMETER_CLOSE) :]
                return []
            self._unpark()
        self._buf += text
        events: list[ParserEvent] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[ParserEvent]:
        """End of generation: release everything held back."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        self._unpark()
        events: list[ParserEvent] = []
        if self._state == _REASONING:
            _emit(events, ReasoningDelta, self._buf)
        else:
            _emit(events, ContentDelta, self._unclaimed + self._buf)
        self._buf = self._unclaimed = ""
        return events

    def _unpark(self) -> None:
        """Move parked text into the buffer for a full scan."""
        self._buf += "".join(self._parked)
        self._parked = []
        self._value_tail = None

    def _step(self, events: list[ParserEvent]) -> bool:
        """Advance by one element or state change; False when more text is needed."""
        buf = self._buf
        if self._state == _REASONING:
            end = buf.find(THINK_END)
            if end < 0:
                safe = len(buf) - _partial_marker_len(buf, (THINK_END,))
                _emit(events, ReasoningDelta, buf[:safe])
                self._buf = buf[safe:]
                return False
            _emit(events, ReasoningDelta, buf[:end])
            self._buf = buf[end + len(THINK_END) :]
            self._state = _CONTENT
            return True

        if self._state == _CONTENT:
            start = buf.find(TOOL_CALLS_OPEN) if self._parse_tool_calls else -1
            if start < 0:
                markers = (TOOL_CALLS_SEPARATOR + TOOL_CALLS_OPEN, TOOL_CALLS_OPEN)
                held = _partial_marker_len(buf, markers) if self._parse_tool_calls else 0
                _emit(events, ContentDelta, buf[: len(buf) - held])
                self._buf = buf[len(buf) - held :]
                return False
            # The separator the encoder puts before the block belongs to the block.
            text_end = start
            if buf[:start].endswith(TOOL_CALLS_SEPARATOR):
                text_end -= len(TOOL_CALLS_SEPARATOR)
            _emit(events, ContentDelta, buf[:text_end])
            body = start + len(TOOL_CALLS_OPEN)
            self._unclaimed = buf[text_end:body]
            self._buf = buf[body:]
            self._calls_in_block = 0
            self._state = _BLOCK
            return True

        pos = _skip_space(buf, 0)
        try:
            tag = _which(buf, pos, (INVOKE_OPEN_PREFIX, TOOL_CALLS_CLOSE))
            if tag == TOOL_CALLS_CLOSE:
                end = pos + len(TOOL_CALLS_CLOSE)
                if not self._calls_in_block:  # a block without calls is just text
                    _emit(events, ContentDelta, self._unclaimed + buf[:end])
                self._unclaimed = ""
                self._buf = buf[end:]
                self._state = _CONTENT
                return True
            end, name, arguments = _scan_invoke(buf, pos)
        except _NeedValueEnd:
            self._value_tail = buf[-len(PARAMETER_CLOSE) :]
            return False
        except _NeedMore:
            return False
        except _Malformed:
            # Give back what the block held; rescan the rest as ordinary content.
            _emit(events, ContentDelta, self._unclaimed)
            self._unclaimed = ""
            self._state = _CONTENT
            return True
        index = self._calls
        self._calls += 1
        self._calls_in_block += 1
        events.append(ToolCallDelta(index, "", self._make_call_id(), name))
        events.append(ToolCallDelta(index, json.dumps(arguments, ensure_ascii=False)))
        self._unclaimed = ""
        self._buf = buf[end:]
        return True


def _emit(
    events: list[ParserEvent], kind: type[ReasoningDelta] | type[ContentDelta], text: str
) -> None:
    """Append a text event, merging with a preceding one of the same kind."""
    if not text:
        return
    if events and type(events[-1]) is kind:
        text = events.pop().text + text
    events.append(kind(text))


def _partial_marker_len(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


# --- DSML scanning ----------------------------------------------------------------
# Each scanner either returns, or raises _NeedMore when the text is a prefix of a
# valid element, or _Malformed when it can never become one.  Because the answer
# depends only on the text seen, splitting a stream differently cannot change it.


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _SPACE:
        pos += 1
    return pos


def _which(text: str, pos: int, literals: Sequence[str]) -> str:
    """The literal that ``text`` continues with at ``pos``."""
    for literal in literals:
        if text.startswith(literal, pos):
            return literal
    rest = text[pos : pos + max(map(len, literals))]
    if any(literal.startswith(rest) for literal in literals):
        raise _NeedMore
    raise _Malformed


def _expect(text: str, pos: int, literal: str) -> int:
    _which(text, pos, (literal,))
    return pos + len(literal)


def _attribute(text: str, pos: int) -> tuple[str, int]:
    """A quoted attribute value starting at ``pos``; names hold no quote or newline."""
    end = text.find('"', pos)
    if "\n" in text[pos : end if end >= 0 else len(text)]:
        raise _Malformed
    if end < 0:
        raise _NeedMore
    return text[pos:end], end


def _scan_invoke(text: str, pos: int) -> tuple[int, str, dict[str, Any]]:
    """Parse one ``invoke`` at ``pos``; return (end, function name, arguments)."""
    pos = _expect(text, pos, f'{INVOKE_OPEN_PREFIX} name="')
    name, pos = _attribute(text, pos)
    pos = _expect(text, pos, '">')
    arguments: dict[str, Any] = {}
    while True:
        pos = _skip_space(text, pos)
        if _which(text, pos, (INVOKE_CLOSE, PARAMETER_OPEN_PREFIX)) == INVOKE_CLOSE:
            return pos + len(INVOKE_CLOSE), name, arguments
        pos = _expect(text, pos, f'{PARAMETER_OPEN_PREFIX} name="')
        key, pos = _attribute(text, pos)
        pos = _expect(text, pos, '" string="')
        flag = _which(text, pos, ('true">', 'false">'))
        pos += len(flag)
        end = text.find(PARAMETER_CLOSE, pos)
        if end < 0:
            raise _NeedValueEnd
        arguments[key] = text[pos:end] if flag == 'true">' else _json_value(text[pos:end])
        pos = end + len(PARAMETER_CLOSE)


def _json_value(raw: str) -> Any:
    """A ``string="false"`` value; if the model wrote invalid JSON, keep it as a string
    so that ``arguments`` is always valid JSON and no text is lost."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw
