"""Building blocks of the two networks (norm, rope, mHC, attention, compressor, indexer, MoE,
engram); `dsv4.model.model` assembles them."""
