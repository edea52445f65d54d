"""Random weights in exactly the in-memory forms `load_weights` produces, made on the device.

`dsv4 bench forward` times the real network at real dimensions without a 500 GB checkpoint,
so it needs every tensor the model reads, in the same dtype and layout as a loaded release
(the fast path must see FP8 codes and exponent bytes, not a convenient stand-in), with values
that keep activations finite through dozens of layers. Generating on the device matters: one
real V4.1 layer holds ~13.6 G expert parameters (384 experts), and a host-side generator
plus a copy would take minutes per layer.

Forms (see `dsv4.model.weights`): F32 tensors fp32; BF16 tensors in `dtype`; `tid2eid` int64;
dense FP8 and FP4 experts either dequantised to `dtype` (`compact=False`, the CPU form) or
kept compact (`compact=True`: float8_e4m3fn `X.weight` + uint8 exponent bytes `X.scale`, with
one exponent per weight tile for dense FP8 and one per 32 inputs for experts, already
converted from FP4, or with `cfg.fp4_experts` random FP4 bytes in the kernels' layout); engram tables always compact (FP8 rows + one exponent byte per 32
channels).

Values: projections ~N(0, 1/fan_in) (unit-RMS inputs give unit-RMS outputs), embeddings
N(0, 1), norm gains and hc scales 1, hc bases / attention sinks / router biases / V4 `ape` 0,
`hc_*_fn` 10x smaller than a projection (so the mHC mixes start near their bases: pre 0.5,
post 1, comb uniform), hash routing `tid2eid` distinct random experts per token. Compact
weights use one exponent per tensor (any valid byte is a valid format; the values' spread is
what matters for timing and for staying finite).
"""

from __future__ import annotations

import math

import torch

from dsv4.config import ModelConfig
from dsv4.model import quant
from dsv4.model.spec import ENGRAM, FP4, FP8, PLAIN, SCALE, TensorSpec, checkpoint_spec

# Standard deviation of the FP8 codes themselves: well inside e4m3's +-448 (14 sigma), with
# enough range for the normal distribution's shape to survive the 3-bit mantissa.
CODE_STD = 32.0
# Elements generated per randn call: bounds the temporary (bf16) memory of huge tensors
# (an engram table, a real expert) to 128 MiB.
CHUNK = 1 << 26
# RMS of uniformly random e2m1 codes (the compact FP4 experts' random bytes)
FP4_CODE_RMS = math.sqrt(sum(v * v for v in quant.FP4_VALUES) / len(quant.FP4_VALUES))
HC_FN_GAIN = 0.1  # hc_*_fn std relative to a projection's 1/sqrt(fan_in)


def fp8_normal_(out: torch.Tensor, code_std: float, gen: torch.Generator) -> torch.Tensor:
    """Fill a float8_e4m3fn tensor in place with N(0, code_std^2) codes, chunk by chunk."""
    flat = out.view(-1)
    for i in range(0, flat.numel(), CHUNK):
        n = min(CHUNK, flat.numel() - i)
        chunk = torch.randn(n, generator=gen, device=out.device, dtype=torch.bfloat16) * code_std
        flat[i : i + n] = chunk.to(torch.float8_e4m3fn)
    return out


def _exponent_byte(std: float) -> int:
    """The E8M0 byte whose scale turns CODE_STD-sized codes into values of about `std`."""
    return 127 + round(math.log2(std / CODE_STD))


def _compact(shape: tuple[int, int], scale_shape: tuple[int, int], std: float, gen: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    codes = fp8_normal_(torch.empty(shape, dtype=torch.float8_e4m3fn, device=device), CODE_STD, gen)
    scale = torch.full(scale_shape, _exponent_byte(std), dtype=torch.uint8, device=device)
    return codes, scale


def _dense(shape: tuple[int, ...], std: float, dtype: torch.dtype, gen: torch.Generator, device) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=device, dtype=dtype) * std


def _plain(spec: TensorSpec, cfg: ModelConfig, dtype: torch.dtype, gen: torch.Generator, device) -> torch.Tensor:
    name, shape = spec.name, spec.shape
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "tid2eid":
        vocab, k = shape
        scores = torch.rand((vocab, cfg.n_routed_experts), generator=gen, device=device)
        return scores.argsort(dim=1)[:, :k].contiguous()
    out_dtype = torch.float32 if spec.dtypes[0] == "F32" else dtype
    ones = name.endswith("norm.weight") or leaf in ("q_weight", "k_weight") or (leaf.startswith("hc_") and leaf.endswith("_scale"))
    if ones:
        return torch.ones(shape, dtype=out_dtype, device=device)
    if leaf in ("attn_sink", "bias", "bias_vl", "ape") or (leaf.startswith("hc_") and leaf.endswith("_base")):
        return torch.zeros(shape, dtype=out_dtype, device=device)
    if name == "embed.weight":
        std = 1.0
    elif leaf.startswith("hc_") and leaf.endswith("_fn"):
        std = HC_FN_GAIN / math.sqrt(shape[-1])
    else:  # a projection [out, in]: head, router, compressor, indexer weights_proj / wk
        std = 1.0 / math.sqrt(shape[-1])
    return _dense(shape, std, out_dtype, gen, device)


def random_weights(cfg: ModelConfig, *, dtype: torch.dtype, device="cpu", compact: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor `Model(cfg, weights)` reads for `checkpoint_spec(cfg)` (group "model"; the
    draft stages are not part of the forward), keyed and shaped like `load_weights` output.

    Deterministic for (cfg, dtype, device, compact, seed) on a given device type."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, s in checkpoint_spec(cfg).items():
        if s.group != "model" or s.fmt == SCALE:
            continue
        scale_name = name.removesuffix(".weight") + ".scale"
        if s.fmt == PLAIN:
            out[name] = _plain(s, cfg, dtype, gen, device)
        elif s.fmt == ENGRAM:  # table rows, embedding-like values, always compact
            rows, width = s.shape
            out[name], out[scale_name] = _compact((rows, width), (rows, width // 32), 1.0, gen, device)
        else:
            rows, cols = s.shape[0], s.shape[1] * (2 if s.fmt == FP4 else 1)
            std = 1.0 / math.sqrt(cols)
            if not compact:
                out[name] = _dense((rows, cols), std, dtype, gen, device)
            elif s.fmt == FP8:
                b = cfg.weight_block_size
                out[name], out[scale_name] = _compact((rows, cols), (-(-rows // b), -(-cols // b)), std, gen, device)
            elif cfg.fp4_experts:  # FP4 expert in the kernels' layout: random codes
                out[name] = torch.randint(0, 256, (rows, cols // 2), generator=gen, device=device, dtype=torch.uint8)
                out[scale_name] = torch.full((rows, cols // 32), 127 + round(math.log2(std / FP4_CODE_RMS)), dtype=torch.uint8, device=device)
            else:  # FP4 expert converted to FP8, one exponent per 32 inputs
                out[name], out[scale_name] = _compact((rows, cols), (rows, cols // 32), std, gen, device)
    return out


def dense_weight_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes `random_weights(..., compact=False)` allocates: what the dequantised reference
    path needs on the device, checked before building it."""
    size = torch.empty((), dtype=dtype).element_size()
    total = 0
    for s in checkpoint_spec(cfg).values():
        if s.group != "model":
            continue
        n = math.prod(s.shape)
        if s.fmt == SCALE:  # only the engram tables keep their exponent bytes
            total += n if s.name.endswith("engram.embed.scale") else 0
        elif s.fmt == ENGRAM:
            total += n
        elif s.fmt == FP4:
            total += 2 * n * size
        elif s.fmt == FP8:
            total += n * size
        else:
            total += n * (4 if s.dtypes[0] == "F32" else 8 if s.dtypes[0] == "I64" else size)
    return total
