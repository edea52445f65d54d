"""Chained block hashes and the prefix index."""

import hashlib
import struct

import pytest

from dsv4.cache.prefix import PrefixIndex, block_hashes, hash_block


def test_hash_encoding_is_the_documented_one():
    h0 = hash_block(None, [1, 2, 3, 4])
    assert h0 == hashlib.sha256(struct.pack("<4i", 1, 2, 3, 4)).digest()
    h1 = hash_block(h0, [5, 6, 7, 8])
    assert h1 == hashlib.sha256(h0 + struct.pack("<4i", 5, 6, 7, 8)).digest()
    salted = hash_block(None, [1, 2, 3, 4], "tenant")
    assert salted == hashlib.sha256(b"tenant" + struct.pack("<4i", 1, 2, 3, 4)).digest()
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4) == [h0, h1]


def test_chain_covers_the_whole_prefix():
    a = list(range(12))
    b = list(a)
    b[1] = 99  # first block differs: every later hash must differ too
    c = list(a)
    c[9] = 99  # only the last block differs
    ha, hb, hc = (block_hashes(x, 4) for x in (a, b, c))
    assert all(x != y for x, y in zip(ha, hb))
    assert ha[:2] == hc[:2] and ha[2] != hc[2]


def test_only_full_blocks_are_hashed():
    assert len(block_hashes(list(range(11)), 4)) == 2
    assert block_hashes(list(range(3)), 4) == []
    assert block_hashes(list(range(8)), 4) == block_hashes(list(range(11)), 4)


def test_salt_isolates_every_block():
    tokens = list(range(16))
    plain, s1, s2 = block_hashes(tokens, 4), block_hashes(tokens, 4, "a"), block_hashes(tokens, 4, "b")
    for i in range(4):
        assert len({plain[i], s1[i], s2[i]}) == 3
    with pytest.raises(ValueError, match="first block"):
        hash_block(plain[0], [1, 2, 3, 4], "a")


def test_token_ids_must_fit_int32():
    with pytest.raises(ValueError, match="int32"):
        hash_block(None, [2**31, 0])


def test_index_longest_prefix_and_removal():
    hashes = block_hashes(list(range(16)), 4)
    index = PrefixIndex()
    assert index.insert(hashes[0], 7) and index.insert(hashes[1], 3) and index.insert(hashes[3], 5)
    assert index.lookup(hashes) == [7, 3]  # stops at the first miss (block 2), ignores block 3
    assert index.lookup(hashes[1:]) == [3]
    assert not index.insert(hashes[0], 9)  # same content already cached elsewhere
    assert index.hash_of(9) is None
    with pytest.raises(ValueError, match="already registered"):
        index.insert(hashes[2], 7)
    index.remove(3)
    assert index.lookup(hashes) == [7] and index.hash_of(3) is None and len(index) == 2
