"""Encode OpenAI-style chat requests into DeepSeek-V4 prompt strings.

DeepSeek-V4 ships no Jinja chat template; DeepSeek publishes a Python reference
encoder (``encoding_dsv4.py``) instead, and the model was trained on exactly the
strings that encoder produces.  A single stray newline or a different JSON spacing
moves the prompt off the training distribution and also defeats prefix-cache reuse
between the turns of an agent session, so this module reproduces the reference
byte for byte (``tests/server/test_chat_format.py`` checks it against the reference
on hand-written and randomly generated conversations).

The reference works on DeepSeek's internal message dialect; this module accepts
the OpenAI chat-completions dialect and maps it the way vLLM does:

* request-level ``tools`` are attached to a leading system/developer message, or to
  a new empty system message placed first, so the tool prompt follows the system
  prompt;
* ``tool`` messages and the user messages next to them form one user turn whose
  pieces are joined by a blank line, tool results wrapped in ``<tool_result>`` and
  reordered to follow the order of the preceding assistant's tool calls;
* in thinking mode without tools, reasoning and ``developer`` messages that come
  before the last user turn are dropped (the model only ever saw its latest
  reasoning); with tools every turn keeps its reasoning, because an agent's tool
  loop depends on it.

Inputs the reference would mis-encode or crash on are rejected with
:class:`ChatFormatError` naming the offending field instead.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ASSISTANT_TOKEN",
    "BOS_TOKEN",
    "EOS_TOKEN",
    "INVOKE_CLOSE",
    "INVOKE_OPEN_PREFIX",
    "PARAMETER_CLOSE",
    "PARAMETER_OPEN_PREFIX",
    "REASONING_EFFORTS",
    "THINK_END",
    "THINK_START",
    "TOOL_CALLS_CLOSE",
    "TOOL_CALLS_OPEN",
    "TOOL_CALLS_SEPARATOR",
    "USER_TOKEN",
    "ChatFormatError",
    "ChatOptions",
    "chat_options_from_request",
    "encode_chat",
    "generation_starts_in_reasoning",
]

# --- Markers of the wire format (shared with output_parser) -------------------

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"

_DSML = "｜DSML｜"
TOOL_CALLS_OPEN = f"<{_DSML}tool_calls>"
TOOL_CALLS_CLOSE = f"</{_DSML}tool_calls>"
INVOKE_OPEN_PREFIX = f"<{_DSML}invoke"
INVOKE_CLOSE = f"</{_DSML}invoke>"
PARAMETER_OPEN_PREFIX = f"<{_DSML}parameter"
PARAMETER_CLOSE = f"</{_DSML}parameter>"
# What the encoder puts between an assistant's text and its tool-call block.
TOOL_CALLS_SEPARATOR = "\n\n"

# Reasoning-effort levels the reference encoder accepts.  Only "max" changes the
# prompt (a fixed preamble in thinking mode); "high" and None encode identically.
REASONING_EFFORTS: tuple[str | None, ...] = (None, "high", "max")

_ROLES = ("system", "developer", "user", "assistant", "tool")

# --- Fixed prompt texts.  These are the model's training format, so they are
# reproduced character for character; do not re-wrap or "fix" them. ----------

_EFFORT_MAX_PREAMBLE = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the "
    "problem to resolve the root cause, rigorously stress-testing your logic against "
    "all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every "
    "intermediate step, considered alternative, and rejected hypothesis to ensure "
    "absolutely no assumption is left unchecked.\n\n"
)

_TOOLS_PROMPT_HEAD = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. "
    f'You can invoke tools by writing a "{TOOL_CALLS_OPEN}" block like the following:\n\n'
    f"{TOOL_CALLS_OPEN}\n"
    f'{INVOKE_OPEN_PREFIX} name="$TOOL_NAME">\n'
    f'{PARAMETER_OPEN_PREFIX} name="$PARAMETER_NAME" string="true|false">'
    f"$PARAMETER_VALUE{PARAMETER_CLOSE}\n"
    "...\n"
    f"{INVOKE_CLOSE}\n"
    f'{INVOKE_OPEN_PREFIX} name="$TOOL_NAME2">\n'
    "...\n"
    f"{INVOKE_CLOSE}\n"
    f"{TOOL_CALLS_CLOSE}\n\n"
    'String parameters should be specified as is and set `string="true"`. '
    "For all other types (numbers, booleans, arrays, objects), pass the value in JSON "
    'format and set `string="false"`.\n\n'
    f"If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your "
    f"complete reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or "
    "final response.\n\n"
    f"Otherwise, output directly after {THINK_END} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
_TOOLS_PROMPT_TAIL = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas "
    "to invoke tool calls.\n"
)


class ChatFormatError(ValueError):
    """A chat request that cannot be encoded; the message names the offending field.

    A ``ValueError`` so that the HTTP layer can map it to a 400 response.
    """


# --- Request options ----------------------------------------------------------


@dataclass(frozen=True)
class ChatOptions:
    """Per-request encoding switches, resolved from the request body."""

    thinking: bool
    reasoning_effort: str | None


# OpenAI / DeepSeek-API effort names folded onto the reference encoder's levels.
# "none" is not a level: it switches thinking off.
_EFFORT_ALIASES = {
    "minimal": "high",
    "low": "high",
    "medium": "high",
    "high": "high",
    "xhigh": "max",
    "max": "max",
}


def chat_options_from_request(
    request: Mapping[str, Any], *, default_thinking: bool = False
) -> ChatOptions:
    """Resolve thinking mode and reasoning effort from a chat-completions body.

    Clients switch thinking in several dialects, so all are accepted, most specific
    first: ``chat_template_kwargs.thinking`` or ``chat_template_kwargs.enable_thinking``
    (what vLLM users send), then a top-level ``thinking`` that is either a bool or
    DeepSeek-API style ``{"type": "enabled" | "disabled"}``; null means "not given".
    ``reasoning_effort`` accepts the OpenAI and DeepSeek-API names, folded onto
    ``"high"``/``"max"`` (the levels the model knows); ``"none"`` turns thinking off.
    ``default_thinking`` applies when the request says nothing.
    """
    thinking = default_thinking
    kwargs = request.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise ChatFormatError("chat_template_kwargs: expected an object")
    kwargs = kwargs or {}
    if kwargs.get("thinking") is not None:
        thinking = _as_bool(kwargs["thinking"], "chat_template_kwargs.thinking")
    elif kwargs.get("enable_thinking") is not None:
        thinking = _as_bool(kwargs["enable_thinking"], "chat_template_kwargs.enable_thinking")
    elif request.get("thinking") is not None:
        top = request["thinking"]
        if isinstance(top, Mapping):
            kind = top.get("type")
            if kind not in ("enabled", "disabled"):
                raise ChatFormatError(
                    f"thinking.type: expected 'enabled' or 'disabled'; got {kind!r}"
                )
            thinking = kind == "enabled"
        else:
            thinking = _as_bool(top, "thinking")

    effort = request.get("reasoning_effort")
    if effort is None:
        return ChatOptions(thinking, None)
    if effort == "none":
        return ChatOptions(False, None)
    if effort not in _EFFORT_ALIASES:
        names = ", ".join(repr(n) for n in ("none", *_EFFORT_ALIASES))
        raise ChatFormatError(f"reasoning_effort: expected one of {names}; got {effort!r}")
    return ChatOptions(thinking, _EFFORT_ALIASES[effort])


def _as_bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ChatFormatError(f"{where}: expected true or false; got {value!r}")
    return value


# --- Encoding -------------------------------------------------------------------


@dataclass
class _Piece:
    """One piece of a user turn: plain text or the result of a tool call."""

    text: str
    is_result: bool = False
    call_id: str = ""


@dataclass
class _Turn:
    """A message after validation and after tool results were folded into user turns."""

    role: str  # "system", "developer", "user" or "assistant"
    text: str = ""
    pieces: list[_Piece] = field(default_factory=list)  # user turns only
    reasoning: str = ""
    # Assistant tool calls as (call id, function name, decoded arguments).
    calls: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)


def encode_chat(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    thinking: bool = False,
    reasoning_effort: str | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """Return the DeepSeek-V4 prompt for an OpenAI-style conversation.

    ``thinking`` selects thinking mode (the assistant turn opens with ``<think>``)
    versus chat mode (it opens with ``</think>``).  ``reasoning_effort`` is one of
    :data:`REASONING_EFFORTS`.  With ``add_generation_prompt=False`` the assistant
    header that would follow a final user/tool/developer message is left off (the
    Hugging Face ``apply_chat_template`` flag, e.g. for counting a conversation's
    tokens).

    Raises :class:`ChatFormatError` for invalid input.
    """
    if reasoning_effort not in REASONING_EFFORTS:
        names = ", ".join(repr(e) for e in REASONING_EFFORTS)
        raise ChatFormatError(
            f"reasoning_effort: expected one of {names}; got {reasoning_effort!r}"
        )
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ChatFormatError("messages: expected a list")
    if not messages:
        raise ChatFormatError("messages: must not be empty")

    turns = _fold_turns(messages)
    functions = _validate_tools(tools)
    if functions:
        if turns[0].role in ("system", "developer"):
            turns[0].tools = functions
        else:
            turns.insert(0, _Turn("system", tools=functions))
    _order_tool_results(turns)

    # Dropping earlier reasoning is the reference's default; a tool-using
    # conversation keeps it everywhere.
    drop_history = thinking and not functions
    last_user = _last_user_index(turns)
    if drop_history:
        turns = [t for i, t in enumerate(turns) if t.role != "developer" or i >= last_user]
        last_user = _last_user_index(turns)

    out = [BOS_TOKEN]
    if thinking and reasoning_effort == "max":
        out.append(_EFFORT_MAX_PREAMBLE)
    for i, turn in enumerate(turns):
        shows_reasoning = thinking and (not drop_history or i > last_user)
        out.append(_render_turn(turn, shows_reasoning))
        is_last = i + 1 == len(turns)
        if turn.role not in ("user", "developer"):
            continue
        if is_last and not add_generation_prompt:
            continue
        if is_last or turns[i + 1].role == "assistant":
            opens_thinking = thinking and (not drop_history or i >= last_user)
            out.append(ASSISTANT_TOKEN + (THINK_START if opens_thinking else THINK_END))
    return "".join(out)


def generation_starts_in_reasoning(prompt: str) -> bool:
    """Whether text generated after ``prompt`` begins inside a reasoning block.

    True exactly when the prompt ends by opening a thinking block, i.e. a
    thinking-mode prompt with a generation header; the output parser then treats
    everything up to ``</think>`` as ``reasoning_content``.
    """
    return prompt.endswith(ASSISTANT_TOKEN + THINK_START)


def _last_user_index(turns: list[_Turn]) -> int:
    for i in range(len(turns) - 1, -1, -1):
        if turns[i].role in ("user", "developer"):
            return i
    return -1


def _fold_turns(messages: Sequence[Mapping[str, Any]]) -> list[_Turn]:
    """Validate messages and merge each run of user/tool messages into one user turn."""
    turns: list[_Turn] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise ChatFormatError(f"{where}: expected an object")
        role = msg.get("role")
        if role not in _ROLES:
            names = ", ".join(repr(r) for r in _ROLES)
            raise ChatFormatError(f"{where}.role: expected one of {names}; got {role!r}")

        if role in ("user", "tool"):
            text = _content(msg, where, required=True)
            if role == "user":
                piece = _Piece(text)
            else:
                call_id = msg.get("tool_call_id")
                if not isinstance(call_id, str):
                    raise ChatFormatError(f"{where}.tool_call_id: expected a string")
                piece = _Piece(text, is_result=True, call_id=call_id)
            if turns and turns[-1].role == "user":
                turns[-1].pieces.append(piece)
            else:
                turns.append(_Turn("user", pieces=[piece]))
        elif role == "assistant":
            reasoning = msg.get("reasoning_content")
            if reasoning is not None and not isinstance(reasoning, str):
                raise ChatFormatError(f"{where}.reasoning_content: expected a string")
            turns.append(
                _Turn(
                    "assistant",
                    text=_content(msg, where, required=False),
                    reasoning=reasoning or "",
                    calls=_validate_calls(msg.get("tool_calls"), f"{where}.tool_calls"),
                )
            )
        elif role == "developer":
            text = _content(msg, where, required=True)
            if not text:
                raise ChatFormatError(f"{where}.content: must not be empty for a developer message")
            turns.append(_Turn("developer", text=text))
        else:
            turns.append(_Turn("system", text=_content(msg, where, required=False)))
    return turns


def _content(msg: Mapping[str, Any], where: str, *, required: bool) -> str:
    """Message content as one string; text parts are joined by a blank line.

    The blank line matches how the reference joins the text parts of a tool result
    and the messages of one user turn.  Non-text parts are rejected: the model is
    text-only and silently dropping an image would change the question.
    """
    content = msg.get("content")
    if content is None:
        if required:
            raise ChatFormatError(f"{where}.content: required for a {msg.get('role')} message")
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatFormatError(f"{where}.content: expected a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") != "text":
            raise ChatFormatError(f"{where}.content[{j}]: only text parts are supported")
        text = part.get("text")
        if not isinstance(text, str):
            raise ChatFormatError(f"{where}.content[{j}].text: expected a string")
        texts.append(text)
    return "\n\n".join(texts)


def _validate_calls(calls: Any, where: str) -> list[tuple[str, str, dict[str, Any]]]:
    """Check OpenAI tool calls and decode their JSON arguments.

    Arguments that are not valid JSON are kept, as the reference does, as a single
    string parameter named ``arguments``, so a model's own malformed call can still
    be replayed in history.  Valid JSON that is not an object cannot be expressed
    as named parameters and is rejected.
    """
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise ChatFormatError(f"{where}: expected a list")
    result = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, Mapping):
            raise ChatFormatError(f"{at}: expected an object")
        if call.get("type", "function") != "function":
            raise ChatFormatError(f"{at}.type: expected 'function'; got {call.get('type')!r}")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise ChatFormatError(f"{at}.id: expected a string")
        function = call.get("function")
        if not isinstance(function, Mapping):
            raise ChatFormatError(f"{at}.function: expected an object")
        name = function.get("name")
        if not isinstance(name, str):
            raise ChatFormatError(f"{at}.function.name: expected a string")
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            raise ChatFormatError(f"{at}.function.arguments: expected a JSON string")
        try:
            decoded = json.loads(arguments)
        except ValueError:
            decoded = {"arguments": arguments}
        if not isinstance(decoded, dict):
            raise ChatFormatError(f"{at}.function.arguments: must encode a JSON object")
        result.append((call_id or "", name, decoded))
    return result


def _validate_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """Return the ``function`` objects of OpenAI tool definitions."""
    if tools is None:
        return []
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise ChatFormatError("tools: expected a list")
    functions = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise ChatFormatError(f"tools[{i}]: expected an object")
        if tool.get("type", "function") != "function":
            raise ChatFormatError(f"tools[{i}].type: expected 'function'; got {tool.get('type')!r}")
        function = tool.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ChatFormatError(f"tools[{i}].function: expected an object with a string name")
        try:
            _json(function)
        except (TypeError, ValueError) as exc:
            raise ChatFormatError(f"tools[{i}].function: not JSON-serializable ({exc})") from None
        functions.append(dict(function))
    return functions


def _order_tool_results(turns: list[_Turn]) -> None:
    """Reorder tool results inside each user turn to follow the calls' order.

    Clients may return parallel tool results in completion order; the model was
    trained with them in call order.  Text pieces keep their positions; results
    fill the result positions, stably sorted by the index of their call in the most
    recent assistant turn that made calls (unknown ids sort as index 0).
    """
    order: dict[str, int] = {}
    for turn in turns:
        if turn.role == "assistant" and turn.calls:
            order = {call_id: k for k, (call_id, _, _) in enumerate(turn.calls) if call_id}
        elif turn.role == "user" and order:
            slots = [k for k, p in enumerate(turn.pieces) if p.is_result]
            if len(slots) > 1:
                results = sorted(
                    (turn.pieces[k] for k in slots), key=lambda p: order.get(p.call_id, 0)
                )
                for k, piece in zip(slots, results):
                    turn.pieces[k] = piece


def _render_turn(turn: _Turn, shows_reasoning: bool) -> str:
    if turn.role == "user":
        return USER_TOKEN + "\n\n".join(
            f"<tool_result>{p.text}</tool_result>" if p.is_result else p.text for p in turn.pieces
        )
    if turn.role == "assistant":
        reasoning = turn.reasoning + THINK_END if shows_reasoning else ""
        calls = ""
        if turn.calls:
            invokes = "\n".join(_render_invoke(name, args) for _, name, args in turn.calls)
            calls = f"{TOOL_CALLS_SEPARATOR}{TOOL_CALLS_OPEN}\n{invokes}\n{TOOL_CALLS_CLOSE}"
        return reasoning + turn.text + calls + EOS_TOKEN
    head = USER_TOKEN + turn.text if turn.role == "developer" else turn.text
    if turn.tools:
        schemas = "\n".join(_json(f) for f in turn.tools)
        head += "\n\n" + _TOOLS_PROMPT_HEAD + schemas + _TOOLS_PROMPT_TAIL
    return head


def _render_invoke(name: str, arguments: dict[str, Any]) -> str:
    """One DSML invoke: strings verbatim with ``string="true"``, other values as JSON."""
    params = "\n".join(
        f'{PARAMETER_OPEN_PREFIX} name="{key}" string="true">{value}{PARAMETER_CLOSE}'
        if isinstance(value, str)
        else f'{PARAMETER_OPEN_PREFIX} name="{key}" string="false">{_json(value)}{PARAMETER_CLOSE}'
        for key, value in arguments.items()
    )
    return f'{INVOKE_OPEN_PREFIX} name="{name}">\n{params}\n{INVOKE_CLOSE}'


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
