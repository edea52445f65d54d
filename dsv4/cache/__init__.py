"""Hybrid paged KV cache: storage tensors, block pool, state slots, prefix index."""
