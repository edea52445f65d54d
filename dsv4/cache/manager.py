"""Hybrid KV cache manager: the owner of cache memory that the scheduler asks for room.

Two kinds of state, two allocators:

* paged global KV (compressed KV and indexer keys of every KV-source layer) lives in blocks
  of one logical size (`block_size` tokens). A block id addresses that block's entries in
  every source layer's tensors at once (a ratio-r layer holds block_size / r entries), so one
  pool of ids serves every layer and nothing here branches on a compression ratio. Full
  blocks are registered in a prefix index and stay reusable after their request ends, until
  the memory is needed (LRU eviction).
* fixed-size per-request state (window rings of every layer, compressor tails) lives in a
  state slot, taken when a request starts running and given back when it stops.

Request lifecycle (the scheduler drives it; the runner only reads tables and slots):

    blocks, n_cached = mgr.get_computed_blocks(req_id, prompt, cache_salt)  # prefix hit
    slot = mgr.allocate_slot(req_id)                 # None: no slot free, retry later
    ok = mgr.allocate_for(req_id, n_tokens_after_step)   # False: no room, nothing changed
    ... forward writes KV into mgr.block_table(req_id) ...
    mgr.commit_full_blocks(req_id, tokens_whose_kv_is_written)
    mgr.free(req_id)                                 # finish, abort or preemption

The engine writes only blocks a request owns alone: a prefix hit covers whole blocks and never
the last prompt token (the step must compute at least one position to sample from), so every
block written after a hit is freshly allocated.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from dsv4.cache.prefix import PrefixIndex, block_hashes, hash_block
from dsv4.cache.storage import KVCacheStorage
from dsv4.config import ModelConfig

# ------------------------------------------------------------------------------- sizes


@dataclass(frozen=True)
class CacheSizes:
    """Byte costs of the cache, taken from the storage's own layout math."""

    block_size: int
    block_bytes: int  # one block id across every KV-source layer (compressed KV + indexer keys)
    slot_bytes: dict[str, int]  # one state slot, by kind ("window_rings", "compressor_tails")
    bytes_per_token: dict[str, float]  # paged state, by kind ("compressed_kv", "indexer_keys", "total")

    @property
    def slot_bytes_total(self) -> int:
        return sum(self.slot_bytes.values())

    @classmethod
    def from_storage(cls, storage: KVCacheStorage) -> CacheSizes:
        return cls(storage.block_size, storage.block_bytes(), storage.slot_bytes(), storage.global_bytes_per_token())

    @classmethod
    def for_config(cls, cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> CacheSizes:
        """Sizes without allocating: a one-block, one-slot storage on the meta device has the
        real shapes and dtypes but no memory, so the accounting is the storage's own."""
        meta = KVCacheStorage(cfg, num_slots=1, num_blocks=1, block_size=block_size, dtype=dtype, device="meta")
        return cls.from_storage(meta)


def plan_capacity(
    cfg: ModelConfig,
    block_size: int,
    kv_cache_memory_bytes: int,
    num_slots: int,
    dtype: torch.dtype,
    max_model_len: int | None = None,
) -> int:
    """Number of blocks that fit a memory budget. The state slots (one per concurrently
    running request) are fixed costs and come off the budget first; the rest is blocks.
    A budget that cannot hold the slots plus one request of `max_model_len` tokens (default:
    the model's max_position_embeddings) could never run such a request, so it is an error."""
    sizes = CacheSizes.for_config(cfg, block_size, dtype)
    max_len = cfg.max_position_embeddings if max_model_len is None else max_model_len
    slots_total = num_slots * sizes.slot_bytes_total
    if kv_cache_memory_bytes < slots_total:
        raise ValueError(
            f"kv_cache_memory_bytes: {kv_cache_memory_bytes} B cannot hold {num_slots} state slots of "
            f"{sizes.slot_bytes_total} B each ({slots_total} B: {sizes.slot_bytes}); "
            f"lower max_num_seqs or raise the KV cache memory"
        )
    num_blocks = (kv_cache_memory_bytes - slots_total) // sizes.block_bytes
    needed = math.ceil(max_len / block_size)
    if num_blocks < needed:
        raise ValueError(
            f"kv_cache_memory_bytes: {kv_cache_memory_bytes} B leaves room for {num_blocks} blocks of "
            f"{block_size} tokens ({sizes.block_bytes} B each) after {num_slots} state slots ({slots_total} B), "
            f"but one request of max_model_len={max_len} tokens needs {needed} blocks "
            f"({needed * sizes.block_bytes + slots_total} B in all); lower max_model_len or max_num_seqs, "
            f"or raise the KV cache memory"
        )
    return num_blocks


# -------------------------------------------------------------------------------- blocks


class BlockPool:
    """Fixed set of block ids with reference counts.

    Every block is in exactly one of three states:
    * free: unreferenced, no cached content (the free list);
    * cached: unreferenced but registered in the prefix index, kept for reuse in LRU order
      (least recently released first);
    * used: referenced by at least one request (ref count > 1: shared by a prefix hit).
    """

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.index = PrefixIndex()
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._lru: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take now (free, or cached and evictable)."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_available

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def is_shared(self, block: int) -> bool:
        """Referenced by more than one request: its KV must not be written."""
        return self._ref[block] > 1

    def allocate(self, n: int) -> list[int] | None:
        """`n` exclusively owned blocks (ref count 1), or None if fewer are available (then
        nothing changes). Free blocks go first; only then are cached ones evicted, least
        recently released first, and forgotten by the prefix index."""
        if n < 0:
            raise ValueError(f"n: must be >= 0, got {n}")
        if n > self.num_available:
            return None
        blocks = []
        while len(blocks) < n:
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._lru.popitem(last=False)
                self.index.remove(block)
            self._ref[block] = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[int]) -> None:
        """Take a reference on blocks found by a prefix lookup; a cached block leaves the LRU
        so that it cannot be evicted while in use."""
        for block in blocks:
            if self.index.hash_of(block) is None:
                raise ValueError(f"block {block}: touch is for cached blocks, this one holds no registered prefix")
            if self._ref[block] == 0:
                del self._lru[block]
            self._ref[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference per listed block. A block reaching 0 becomes cached (most
        recently released end of the LRU) if it holds a registered prefix, else free."""
        blocks = list(blocks)
        for block, n in Counter(blocks).items():
            if self._ref[block] < n:
                raise ValueError(f"block {block}: freed {n} time(s) but holds {self._ref[block]} reference(s)")
        for block in blocks:
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if self.index.hash_of(block) is not None:
                    self._lru[block] = None
                else:
                    self._free.append(block)

    def register(self, block: int, block_hash: bytes) -> bool:
        """Record that `block` (held by its writer) now holds the full block `block_hash`.
        False when that content is already cached elsewhere; this copy then stays private."""
        if self._ref[block] == 0:
            raise ValueError(f"block {block}: only a referenced (just written) block can be registered")
        return self.index.insert(block_hash, block)

    def check(self) -> None:
        """Raise AssertionError unless free, cached and used partition the pool and the
        prefix index agrees with the block states."""
        free, cached = set(self._free), set(self._lru)
        assert len(free) == len(self._free), "duplicate block in the free list"
        assert not free & cached, "block both free and cached"
        for block, ref in enumerate(self._ref):
            assert ref >= 0, f"block {block}: negative ref count {ref}"
            assert (ref == 0) == (block in free or block in cached), f"block {block}: ref {ref} vs free/cached state"
            if block in free:
                assert self.index.hash_of(block) is None, f"free block {block} is still in the prefix index"
            if block in cached:
                assert self.index.hash_of(block) is not None, f"cached block {block} has no prefix hash"
        for block_hash, block in self.index.items():
            assert self.index.hash_of(block) == block_hash, f"block {block}: index maps disagree"
            assert block not in free, f"indexed block {block} is on the free list"


# --------------------------------------------------------------------------------- slots


class StateSlots:
    """Fixed set of per-request state slots (window rings, compressor tails)."""

    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"num_slots: must be > 0, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"slot {slot}: not allocated (double free or never taken)")
        self._used.remove(slot)
        self._free.append(slot)

    def check(self) -> None:
        assert len(self._free) + len(self._used) == self.num_slots, "slots lost or duplicated"
        assert not set(self._free) & self._used, "slot both free and used"


# ------------------------------------------------------------------------------- manager


@dataclass
class _RequestCache:
    slot: int | None = None
    blocks: list[int] = field(default_factory=list)  # block table: block i holds tokens [i*bs, (i+1)*bs)
    # Chained hashes of blocks[:len(hashes)] (hit or committed). None until the request has
    # been looked up, which is where its cache salt is learnt.
    hashes: list[bytes] | None = None
    cache_salt: str | None = None


class KVCacheManager:
    def __init__(
        self,
        cfg: ModelConfig,
        storage_or_sizes: KVCacheStorage | CacheSizes,
        block_size: int,
        num_blocks: int,
        num_slots: int,
        enable_prefix_caching: bool = True,
    ):
        if isinstance(storage_or_sizes, KVCacheStorage):
            s = storage_or_sizes
            if (s.block_size, s.num_blocks, s.num_slots) != (block_size, num_blocks, num_slots):
                raise ValueError(
                    f"storage has block_size={s.block_size}, num_blocks={s.num_blocks}, num_slots={s.num_slots}; "
                    f"the manager was given {block_size}, {num_blocks}, {num_slots}"
                )
            sizes = CacheSizes.from_storage(s)
        else:
            sizes = storage_or_sizes
            if sizes.block_size != block_size:
                raise ValueError(f"block_size: sizes were computed for {sizes.block_size}, got {block_size}")
        self.cfg, self.sizes = cfg, sizes
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.slots = StateSlots(num_slots)
        self._requests: dict[str, _RequestCache] = {}
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found in the cache

    # -------------------------------------------------------------------- per request
    def allocate_slot(self, req_id: str) -> int | None:
        """A state slot for `req_id`, or None when every slot is taken."""
        req = self._requests.get(req_id)
        if req is not None and req.slot is not None:
            raise ValueError(f"request {req_id!r} already holds slot {req.slot}")
        slot = self.slots.allocate()
        if slot is not None:
            self._requests.setdefault(req_id, _RequestCache()).slot = slot
        return slot

    def get_computed_blocks(self, req_id: str, token_ids: Sequence[int], cache_salt: str | None = None) -> tuple[list[int], int]:
        """Look up the longest cached prefix of a request's prompt and make those blocks the
        start of its block table (taking a reference on each). Returns (blocks, number of
        cached tokens). Call once per admission, before `allocate_for`; it also records the
        request's cache salt for later commits. The last token is never covered (the step
        must compute at least one position), so a prompt of k full blocks hits at most k - 1."""
        req = self._requests.setdefault(req_id, _RequestCache())
        if req.hashes is not None:
            raise ValueError(f"request {req_id!r}: get_computed_blocks called twice (free the request to re-admit it)")
        req.cache_salt = cache_salt
        if not self.enable_prefix_caching:
            req.hashes = []
            return [], 0
        hashes = block_hashes(token_ids[: len(token_ids) - 1], self.block_size, cache_salt)
        hit = self.pool.index.lookup(hashes)
        self.pool.touch(hit)
        req.blocks = list(hit)
        req.hashes = hashes[: len(hit)]
        self.prefix_queries += len(token_ids)
        self.prefix_hits += len(hit) * self.block_size
        return list(hit), len(hit) * self.block_size

    def allocate_for(self, req_id: str, num_total_tokens: int) -> bool:
        """Grow the request's block table to cover `num_total_tokens` tokens. False when the
        pool cannot supply the missing blocks; the request is then left unchanged."""
        req = self._looked_up(req_id)
        if num_total_tokens > self.cfg.max_position_embeddings:
            raise ValueError(f"request {req_id!r}: {num_total_tokens} tokens exceed max_position_embeddings {self.cfg.max_position_embeddings}")
        missing = math.ceil(num_total_tokens / self.block_size) - len(req.blocks)
        if missing <= 0:
            return True
        new = self.pool.allocate(missing)
        if new is None:
            return False
        req.blocks.extend(new)
        return True

    def commit_full_blocks(self, req_id: str, token_ids: Sequence[int]) -> None:
        """Register the request's newly completed full blocks in the prefix index. Call after a
        forward with the tokens whose KV is now written (never with draft tokens that may
        still be rejected): a registered block can be shared at once."""
        req = self._looked_up(req_id)
        if not self.enable_prefix_caching:
            return
        num_full = len(token_ids) // self.block_size
        if num_full > len(req.blocks):
            raise ValueError(f"request {req_id!r}: {len(token_ids)} tokens span {num_full} full blocks but it holds {len(req.blocks)}")
        bs = self.block_size
        for i in range(len(req.hashes), num_full):
            parent = req.hashes[-1] if req.hashes else None
            h = hash_block(parent, token_ids[i * bs : (i + 1) * bs], req.cache_salt if i == 0 else None)
            self.pool.register(req.blocks[i], h)
            req.hashes.append(h)

    def block_table(self, req_id: str) -> list[int]:
        return list(self._requests[req_id].blocks)

    def free(self, req_id: str) -> None:
        """Release everything the request holds (finish, abort or preemption). Its registered
        blocks stay cached. Blocks are released tail first so that, under LRU, a request's
        private tail is evicted before the prefix heads other requests are likely to share."""
        req = self._requests.pop(req_id)
        self.pool.free(reversed(req.blocks))
        if req.slot is not None:
            self.slots.free(req.slot)

    def is_shared(self, block: int) -> bool:
        return self.pool.is_shared(block)

    def _looked_up(self, req_id: str) -> _RequestCache:
        req = self._requests.get(req_id)
        if req is None or req.hashes is None:
            raise ValueError(f"request {req_id!r}: call get_computed_blocks first (it records the prefix hit and cache salt)")
        return req

    # ------------------------------------------------------------------------ counters
    @property
    def blocks_total(self) -> int:
        return self.pool.num_blocks

    @property
    def blocks_used(self) -> int:
        """Blocks referenced by at least one request."""
        return self.pool.num_used

    @property
    def blocks_cached_free(self) -> int:
        """Unreferenced blocks kept for prefix reuse (evictable)."""
        return self.pool.num_cached

    @property
    def blocks_available(self) -> int:
        """Blocks an allocation may take now: free plus evictable cached."""
        return self.pool.num_available

    @property
    def num_free_slots(self) -> int:
        return self.slots.num_free

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    @property
    def prefix_hit_rate(self) -> float:
        """Fraction of looked-up prompt tokens served from the cache."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def usage(self) -> float:
        """Fraction of blocks referenced by requests (cached-but-unreferenced count as free)."""
        return self.pool.num_used / self.pool.num_blocks

    def bytes_per_token(self) -> dict[str, float]:
        return dict(self.sizes.bytes_per_token)

    def slot_bytes(self) -> dict[str, int]:
        return dict(self.sizes.slot_bytes)

    def check_invariants(self) -> None:
        """Raise AssertionError unless pool, slots, index and request tables agree: every
        reference is held by exactly the requests that list the block."""
        self.pool.check()
        self.slots.check()
        refs = Counter(b for req in self._requests.values() for b in req.blocks)
        for block in range(self.pool.num_blocks):
            assert self.pool.ref_count(block) == refs[block], f"block {block}: ref {self.pool.ref_count(block)} but {refs[block]} holder(s)"
        slots = [req.slot for req in self._requests.values() if req.slot is not None]
        assert len(slots) == len(set(slots)) == self.slots.num_slots - self.slots.num_free, "slot table disagrees with the slot pool"
        for req_id, req in self._requests.items():
            for block, h in zip(req.blocks, req.hashes or []):
                cached = self.pool.index.hash_of(block)
                assert cached in (None, h), f"request {req_id!r}: block {block} indexed under another prefix"
