"""Block pool, state slots, KV cache manager, capacity planning and byte accounting."""

import copy
import random

import pytest
import torch

from dsv4.cache.manager import (
    BlockPool,
    CacheSizes,
    KVCacheManager,
    StateSlots,
    plan_capacity,
)
from dsv4.cache.prefix import block_hashes
from dsv4.cache.reference_configs import released_v4_config, released_v41_config
from dsv4.cache.storage import KVCacheStorage
from dsv4.config import parse_config


def tiny_v41_config(max_len: int = 4096):
    """The released V4.1 schedule shrunk to 6 layers (window, window+engram, Full ratio 2,
    Reuse, Full ratio 1 + candidate source, Reindex) with small widths."""
    raw = copy.deepcopy(released_v41_config())
    raw["text_config"].update(
        hidden_size=64, num_hidden_layers=6, num_attention_heads=4, head_dim=64, qk_rope_head_dim=16,
        q_lora_rank=32, o_groups=2, o_lora_rank=32, sliding_window=8, max_position_embeddings=max_len,
        compress_ratios=[0, 0, 2, 2, 1, 1, 0, 0, 0], kv_source_layer_ids=[2, 4],
        index_source_layer_ids=[2, 4, 5], candidate_source_layer_id=4, index_n_heads=2, index_head_dim=32,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, engram_layer_ids=[1],
        engram_num_embeddings=[1000], dspark_target_layer_ids=[3, 4, 5],
    )
    return parse_config(raw)


def make_manager(num_blocks=16, num_slots=4, block_size=8, prefix=True, max_len=4096):
    cfg = tiny_v41_config(max_len)
    sizes = CacheSizes.for_config(cfg, block_size, torch.bfloat16)
    return KVCacheManager(cfg, sizes, block_size, num_blocks, num_slots, enable_prefix_caching=prefix)


def run_request(mgr, req_id, tokens, salt=None):
    """Admit, compute the whole prompt in one step and commit; returns the cached-token count."""
    _, cached = mgr.get_computed_blocks(req_id, tokens, salt)
    assert mgr.allocate_slot(req_id) is not None
    assert mgr.allocate_for(req_id, len(tokens))
    mgr.commit_full_blocks(req_id, tokens)
    mgr.check_invariants()
    return cached


# --------------------------------------------------------------------------- block pool


def test_pool_allocate_free_refcount():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert sorted(a) == [0, 1, 2] and pool.num_used == 3 and pool.num_free == 1
    assert all(pool.ref_count(b) == 1 for b in a)
    assert pool.allocate(2) is None and pool.num_free == 1  # never a partial allocation
    assert pool.allocate(0) == []
    pool.free(a[:2])
    assert pool.num_free == 3 and pool.num_used == 1
    with pytest.raises(ValueError, match="freed 2 time"):
        pool.free([a[2], a[2]])
    assert pool.ref_count(a[2]) == 1  # the failed free changed nothing
    pool.free([a[2]])
    with pytest.raises(ValueError, match="freed 1 time"):
        pool.free([a[2]])
    pool.check()


def test_pool_lru_eviction_order_and_free_list_first():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    hashes = block_hashes(list(range(32)), 8)
    for b, h in zip(blocks, hashes):
        assert pool.register(b, h)
    pool.free([blocks[2]])
    pool.free([blocks[0]])
    pool.free([blocks[3]])
    assert pool.num_cached == 3 and pool.num_free == 0
    # Least recently released first: 2, then 0; their prefixes leave the index.
    assert pool.allocate(1) == [blocks[2]]
    assert pool.index.hash_of(blocks[2]) is None and pool.index.lookup(hashes[2:3]) == []
    pool.touch([blocks[0]])  # a hit takes it out of the LRU
    assert pool.allocate(1) == [blocks[3]]
    assert pool.allocate(1) is None  # blocks[0] and blocks[1] are referenced: never evicted
    assert pool.index.lookup(hashes[:2]) == blocks[:2]
    new = BlockPool(3)
    b = new.allocate(1)
    new.register(b[0], hashes[0])
    new.free(b)
    assert new.allocate(2) == [1, 2] and new.num_cached == 1  # free blocks go before cached ones
    pool.check()
    new.check()


def test_pool_touch_and_register_guards():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="touch is for cached blocks"):
        pool.touch([0])
    with pytest.raises(ValueError, match="referenced"):
        pool.register(0, b"x" * 32)


def test_state_slots():
    slots = StateSlots(2)
    assert slots.allocate() == 0 and slots.allocate() == 1 and slots.allocate() is None
    slots.free(0)
    assert slots.num_free == 1
    with pytest.raises(ValueError, match="not allocated"):
        slots.free(0)
    with pytest.raises(ValueError, match="not allocated"):
        slots.free(5)
    assert slots.allocate() == 0
    slots.check()


# ------------------------------------------------------------------------------ manager


def test_prefix_hits_are_block_granular():
    mgr = make_manager()
    rng = random.Random(0)
    prompt = [rng.randrange(1000) for _ in range(29)]  # 3 full blocks of 8 + 5 tokens
    assert run_request(mgr, "a", prompt) == 0
    assert len(mgr.pool.index) == 3  # the partial last block is not cached
    table_a = mgr.block_table("a")
    blocks, cached = mgr.get_computed_blocks("b", prompt[:27] + [7, 7])
    assert cached == 24 and blocks == table_a[:3]
    blocks, cached = mgr.get_computed_blocks("c", prompt[:20])
    assert cached == 16 and blocks == table_a[:2]  # block 2 only partly matches: no hit
    # A prompt of exactly k full blocks hits k - 1: its last token must be computed.
    blocks, cached = mgr.get_computed_blocks("d", prompt[:24])
    assert cached == 16
    assert all(mgr.is_shared(b) for b in table_a[:2]) and not mgr.is_shared(table_a[3])
    assert mgr.prefix_queries == 29 + 29 + 20 + 24 and mgr.prefix_hits == 24 + 16 + 16
    assert mgr.prefix_hit_rate == pytest.approx(56 / 102)
    mgr.check_invariants()


def test_salt_isolation():
    mgr = make_manager()
    prompt = list(range(40))
    run_request(mgr, "a", prompt, salt="alice")
    assert mgr.get_computed_blocks("b", prompt, "bob")[1] == 0
    assert mgr.get_computed_blocks("c", prompt)[1] == 0
    assert mgr.get_computed_blocks("d", prompt, "alice")[1] == 32
    mgr.check_invariants()


def test_shared_blocks_survive_their_writer():
    mgr = make_manager(num_blocks=6)
    prompt = list(range(20))
    run_request(mgr, "a", prompt)
    shared = mgr.block_table("a")[:2]
    assert run_request(mgr, "b", prompt + [1, 2]) == 16
    assert mgr.block_table("b")[:2] == shared
    assert [mgr.pool.ref_count(b) for b in shared] == [2, 2]
    mgr.free("a")
    assert [mgr.pool.ref_count(b) for b in shared] == [1, 1]
    assert mgr.blocks_used == 3 and mgr.blocks_cached_free == 0
    # Exhausting the pool must not take the blocks b still references.
    assert mgr.get_computed_blocks("c", [5] * 40)[1] == 0
    assert not mgr.allocate_for("c", 40)  # 5 blocks needed, 3 available
    assert mgr.block_table("c") == [] and mgr.blocks_used == 3  # unchanged
    assert mgr.allocate_for("c", 24)
    assert not set(mgr.block_table("c")) & set(mgr.block_table("b"))
    mgr.free("b")
    assert mgr.blocks_cached_free == 2 and mgr.blocks_used == 3  # b's committed blocks stay cached
    mgr.free("c")
    assert mgr.blocks_used == 0 and mgr.num_free_slots == 4
    mgr.check_invariants()


def test_concurrent_duplicate_stays_private():
    mgr = make_manager()
    prompt = list(range(16, 33))
    for r in ("a", "b"):  # both admitted before either commits: no hit for b
        mgr.get_computed_blocks(r, prompt)
        assert mgr.allocate_for(r, len(prompt))
    mgr.commit_full_blocks("a", prompt)
    mgr.commit_full_blocks("b", prompt)
    assert len(mgr.pool.index) == 2
    mgr.check_invariants()
    mgr.free("b")
    assert mgr.pool.num_cached == 0  # b's copies were never registered: back to the free list
    mgr.free("a")
    assert mgr.pool.num_cached == 2
    mgr.check_invariants()


def test_growth_commit_and_free():
    mgr = make_manager(num_blocks=4)
    tokens = list(range(10))
    mgr.get_computed_blocks("a", tokens)
    slot = mgr.allocate_slot("a")
    assert mgr.allocate_for("a", 10) and len(mgr.block_table("a")) == 2
    assert mgr.allocate_for("a", 16) and len(mgr.block_table("a")) == 2
    mgr.commit_full_blocks("a", tokens)
    tokens += [3] * 23
    assert not mgr.allocate_for("a", 33) and len(mgr.block_table("a")) == 2
    assert mgr.allocate_for("a", 32)
    with pytest.raises(ValueError, match="full blocks"):
        mgr.commit_full_blocks("a", tokens + [0] * 7)  # 5 full blocks, 4 held
    mgr.commit_full_blocks("a", tokens[:32])
    assert len(mgr.pool.index) == 4 and mgr.usage() == 1.0 and mgr.capacity_tokens == 32
    with pytest.raises(ValueError, match="already holds slot"):
        mgr.allocate_slot("a")
    mgr.free("a")
    assert mgr.num_free_slots == 4 and mgr.allocate_slot("z") == slot
    with pytest.raises(KeyError):
        mgr.free("a")
    mgr.check_invariants()


def test_lifecycle_errors():
    mgr = make_manager(max_len=64)
    with pytest.raises(ValueError, match="get_computed_blocks first"):
        mgr.allocate_for("a", 8)
    mgr.allocate_slot("a")
    with pytest.raises(ValueError, match="get_computed_blocks first"):
        mgr.commit_full_blocks("a", [1] * 8)
    mgr.get_computed_blocks("a", [1] * 8)
    with pytest.raises(ValueError, match="twice"):
        mgr.get_computed_blocks("a", [1] * 8)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        mgr.allocate_for("a", 65)


def test_prefix_caching_disabled():
    mgr = make_manager(prefix=False)
    prompt = list(range(40))
    run_request(mgr, "a", prompt)
    mgr.free("a")
    assert run_request(mgr, "b", prompt) == 0
    assert len(mgr.pool.index) == 0 and mgr.prefix_queries == 0 and mgr.prefix_hit_rate == 0.0
    mgr.free("b")
    assert mgr.blocks_cached_free == 0 and mgr.pool.num_free == 16


def test_storage_must_match_manager():
    cfg = tiny_v41_config()
    storage = KVCacheStorage(cfg, num_slots=2, num_blocks=3, block_size=8, dtype=torch.float32)
    mgr = KVCacheManager(cfg, storage, 8, 3, 2)
    assert mgr.bytes_per_token() == storage.global_bytes_per_token()
    with pytest.raises(ValueError, match="num_blocks=3"):
        KVCacheManager(cfg, storage, 8, 4, 2)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(cfg, CacheSizes.for_config(cfg, 8, torch.float32), 16, 3, 2)


# ----------------------------------------------------------------------- stress


def test_randomized_stress():
    """Random admissions (prompts from a few shared prefixes, two salts), chunked growth,
    commits, finishes, aborts and preemptions on a small pool. After every operation the
    invariants hold; every hit block holds exactly the prefix it is hit for; no written
    block is ever shared; at the end everything is free or cached-unreferenced."""
    rng = random.Random(1234)
    bs, num_blocks, num_slots = 8, 40, 5
    mgr = make_manager(num_blocks=num_blocks, num_slots=num_slots, block_size=bs)
    prefixes = [[rng.randrange(30) for _ in range(rng.randrange(8, 48))] for _ in range(3)]
    content: dict[int, tuple] = {}  # block -> (salt, every token up to the block's end) once committed
    running: dict[str, dict] = {}  # req_id -> {tokens, computed, salt}
    evicted_reused = 0
    for step in range(4000):
        op = rng.random()
        if op < 0.3 or not running:
            req_id = f"r{step}"
            salt = rng.choice([None, None, "s"])
            prompt = list(rng.choice(prefixes)) + [rng.randrange(30) for _ in range(rng.randrange(1, 20))]
            hit, cached = mgr.get_computed_blocks(req_id, prompt, salt)
            assert cached == len(hit) * bs and cached < len(prompt)
            for i, b in enumerate(hit):
                assert content[b] == (salt, tuple(prompt[: (i + 1) * bs])), "hit block holds another prefix"
            if rng.random() < 0.1 or mgr.allocate_slot(req_id) is None:
                mgr.free(req_id)  # aborted, or no slot: back out
            else:
                running[req_id] = {"tokens": prompt, "computed": cached, "salt": salt}
        elif op < 0.8:
            req_id = rng.choice(sorted(running))
            req = running[req_id]
            n = rng.randrange(1, 20)
            while len(req["tokens"]) < req["computed"] + n:
                req["tokens"].append(rng.randrange(30))  # generated tokens
            available = mgr.blocks_available
            if not mgr.allocate_for(req_id, req["computed"] + n):
                assert mgr.blocks_available == available
                victim = rng.choice(sorted(running))  # preempt someone (maybe itself)
                mgr.free(victim)
                del running[victim]
            else:
                table = mgr.block_table(req_id)
                for pos in range(req["computed"], req["computed"] + n):
                    block = table[pos // bs]
                    assert mgr.pool.ref_count(block) == 1, "writing into a block someone else holds"
                    if block in content:
                        evicted_reused += 1
                        del content[block]
                req["computed"] += n
                done = req["tokens"][: req["computed"]]
                mgr.commit_full_blocks(req_id, done)
                for i in range(req["computed"] // bs):
                    content.setdefault(table[i], (req["salt"], tuple(done[: (i + 1) * bs])))
        else:
            req_id = rng.choice(sorted(running))
            mgr.free(req_id)
            del running[req_id]
        mgr.check_invariants()
    for req_id in list(running):
        mgr.free(req_id)
    mgr.check_invariants()
    assert mgr.blocks_used == 0 and mgr.num_free_slots == num_slots
    assert mgr.pool.num_free + mgr.blocks_cached_free == num_blocks
    assert mgr.blocks_cached_free == len(mgr.pool.index)
    assert mgr.prefix_hits > 0 and evicted_reused > 0  # the run exercised both hits and eviction


# ------------------------------------------------------------------ sizes and capacity


def test_v41_released_global_kv_is_890_bytes_per_token():
    cfg = parse_config(released_v41_config())
    assert cfg.kv_source_layers == (2, 8, 14, 20)
    sizes = CacheSizes.for_config(cfg, 256, torch.bfloat16)
    assert sizes.bytes_per_token == {"compressed_kv": 720.0, "indexer_keys": 170.0, "total": 890.0}
    assert sizes.block_bytes == 890 * 256
    # 40 FP8 rings of 128 x (512 + 16 ue8m0) bytes; fp32 kv + gate tails [2, 512] at the
    # three ratio-2 sources (the ratio-1 source has no partial group).
    assert sizes.slot_bytes == {"window_rings": 40 * 128 * 528, "compressor_tails": 3 * 2 * 2 * 512 * 4}


def test_v4_released_accounting_in_compute_dtype():
    """V4 KV is stored unquantised in the compute dtype: 21 ratio-4 CSA layers (KV + indexer
    keys) and 20 ratio-128 HCA layers (KV only)."""
    cfg = parse_config(released_v4_config())
    sizes = CacheSizes.for_config(cfg, 256, torch.bfloat16)
    ckv = 21 * 512 * 2 / 4 + 20 * 512 * 2 / 128
    idx = 21 * 128 * 2 / 4
    assert sizes.bytes_per_token == {"compressed_kv": ckv, "indexer_keys": idx, "total": ckv + idx}
    assert sizes.bytes_per_token["total"] == 6880.0
    assert sizes.block_bytes == 6880 * 256
    csa_tails = 21 * 4 * 4 * 2 * (2 * 512 + 512 + 2 * 128 + 128)  # kv/idx tails (2x wide) + prev halves
    hca_tails = 20 * 128 * 512 * 4 * 2
    assert sizes.slot_bytes == {"window_rings": 43 * 128 * 512 * 2, "compressor_tails": csa_tails + hca_tails}


def test_meta_accounting_matches_allocated_storage():
    cfg = tiny_v41_config()
    for dtype in (torch.float32, torch.bfloat16):
        real = KVCacheStorage(cfg, num_slots=3, num_blocks=5, block_size=16, dtype=dtype)
        assert CacheSizes.for_config(cfg, 16, dtype) == CacheSizes.from_storage(real)
        meta = CacheSizes.for_config(cfg, 16, dtype)
        assert meta.block_bytes == meta.bytes_per_token["total"] * 16


def test_plan_capacity_math():
    cfg = tiny_v41_config(max_len=64)
    sizes = CacheSizes.for_config(cfg, 8, torch.bfloat16)
    slot, block = sizes.slot_bytes_total, sizes.block_bytes
    budget = 4 * slot + 10 * block + block - 1
    assert plan_capacity(cfg, 8, budget, 4, torch.bfloat16) == 10
    assert plan_capacity(cfg, 8, 4 * slot + 8 * block, 4, torch.bfloat16) == 8  # exactly one 64-token request
    with pytest.raises(ValueError, match="max_model_len=64 tokens needs 8 blocks"):
        plan_capacity(cfg, 8, 4 * slot + 8 * block - 1, 4, torch.bfloat16)
    assert plan_capacity(cfg, 8, 4 * slot + 2 * block, 4, torch.bfloat16, max_model_len=16) == 2
    with pytest.raises(ValueError, match="cannot hold 4 state slots"):
        plan_capacity(cfg, 8, 4 * slot - 1, 4, torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of every compress ratio"):
        plan_capacity(cfg, 7, budget, 4, torch.bfloat16)


def test_plan_capacity_v41_real():
    cfg = parse_config(released_v41_config())
    budget = 8 << 30
    n = plan_capacity(cfg, 256, budget, 64, torch.bfloat16)
    slot = 40 * 128 * 528 + 24576
    assert n == (budget - 64 * slot) // (890 * 256)
    # A 1M-token request needs 4096 blocks (0.87 GiB of global KV).
    with pytest.raises(ValueError, match="needs 4096 blocks"):
        plan_capacity(cfg, 256, 64 * slot + 4095 * 890 * 256, 64, torch.bfloat16)
