"""Prefix index: chained SHA-256 hashes of full token blocks, mapped to the cache blocks
that hold their global KV (compressed KV and indexer keys of every KV-source layer).

A block's hash covers its own tokens and, through the parent hash, every token before it,
so equal hashes mean equal prefixes and a hit is always a whole prefix. Only full blocks are
hashed: a partly filled block is still being written and cannot be shared.

    hash_0 = sha256(salt || tokens_0)
    hash_i = sha256(hash_{i-1} || tokens_i)            (tokens as little-endian int32)

The optional per-request `cache_salt` (UTF-8) enters the first block only; it makes requests
with different salts never share, while every later block inherits it through the chain.
Every block holds exactly `block_size` tokens, so a salted first block never has the same
message length as an unsalted one, and two salts of equal length differ in their bytes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def hash_block(parent: bytes | None, tokens: Sequence[int], cache_salt: str | None = None) -> bytes:
    """Hash of one full block; `parent` is the previous block's hash (None for the first
    block, the only one that takes the salt)."""
    if parent is not None and cache_salt is not None:
        raise ValueError("cache_salt: only the first block (parent None) takes the salt")
    h = hashlib.sha256()
    if parent is not None:
        h.update(parent)
    if cache_salt is not None:
        h.update(cache_salt.encode("utf-8"))
    try:
        h.update(struct.pack(f"<{len(tokens)}i", *tokens))
    except struct.error:
        raise ValueError(f"token_ids: every id must fit in int32, got a block {list(tokens)!r}") from None
    return h.digest()


def block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[bytes]:
    """Chained hashes of every full block of `token_ids` (a partial last block is skipped)."""
    hashes: list[bytes] = []
    for i in range(len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        salt = cache_salt if i == 0 else None
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], salt))
    return hashes


class PrefixIndex:
    """Two-way map between block hashes and the block ids holding that content.

    It holds no reference counts: the block pool decides which blocks are reusable and
    removes a block's entry when it evicts the block for new content.
    """

    def __init__(self) -> None:
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}

    def __len__(self) -> int:
        return len(self._block_of)

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """Blocks of the longest cached prefix of `hashes` (stops at the first miss: a later
        block's KV depends on every earlier token, so it is useless without them)."""
        blocks = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def insert(self, block_hash: bytes, block: int) -> bool:
        """Register `block` as holding `block_hash`. False (nothing changes) when that content
        is already cached in another block, e.g. two requests computed the same prefix at
        once; the caller's copy then stays private and is recycled when released."""
        if block_hash in self._block_of:
            return False
        if block in self._hash_of:
            raise ValueError(f"block {block} is already registered in the prefix index")
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash
        return True

    def remove(self, block: int) -> None:
        """Forget `block`'s content (it is about to be overwritten)."""
        del self._block_of[self._hash_of.pop(block)]

    def hash_of(self, block: int) -> bytes | None:
        return self._hash_of.get(block)

    def items(self) -> list[tuple[bytes, int]]:
        return list(self._block_of.items())
