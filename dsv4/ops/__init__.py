"""Hot operations, one function each. Every function here is the torch reference; on CUDA the
same signature is served by a Triton kernel where one exists (see docs/architecture.md)."""
