"""Request-level engine pieces: sampling parameters, the batched sampler and detokenization."""
