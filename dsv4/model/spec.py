"""The released checkpoint's tensor inventory, derived from a ModelConfig.

One entry per stored tensor: its release name (no `model.` prefix), the dtype(s) it may be
stored in, its shape and its storage format. The loader validates a checkpoint against this
list (reporting every problem at once) and `dsv4 make-tiny` writes exactly this list.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv4.config import ModelConfig

# storage formats
PLAIN = "plain"  # BF16 / F32 / I64 used as stored
FP8 = "fp8"  # F8_E4M3 weight with a sibling `.scale` (E8M0, one per block x block tile)
FP4 = "fp4"  # I8 packed e2m1 [out, in/2] with a sibling `.scale` (E8M0 [out, in/32])
ENGRAM = "engram"  # F8_E4M3 rows with a sibling `.scale` (E8M0 per 32 channels)
SCALE = "scale"  # the E8M0 scale of one of the three above


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtypes: tuple[str, ...]  # safetensors dtype names accepted
    shape: tuple[int, ...]
    fmt: str
    group: str = "model"  # "model" tensors are required; "mtp.K" stages are optional as a whole


def _fp8(out: dict, name: str, rows: int, cols: int, block: int, group: str) -> None:
    out[f"{name}.weight"] = TensorSpec(f"{name}.weight", ("F8_E4M3",), (rows, cols), FP8, group)
    grid = (-(-rows // block), -(-cols // block))
    out[f"{name}.scale"] = TensorSpec(f"{name}.scale", ("F8_E8M0",), grid, SCALE, group)


def _fp4(out: dict, name: str, rows: int, cols: int, group: str) -> None:
    out[f"{name}.weight"] = TensorSpec(f"{name}.weight", ("I8",), (rows, cols // 2), FP4, group)
    out[f"{name}.scale"] = TensorSpec(f"{name}.scale", ("F8_E8M0",), (rows, cols // 32), SCALE, group)


def _plain(out: dict, name: str, shape: tuple[int, ...], dtypes: tuple[str, ...], group: str) -> None:
    out[name] = TensorSpec(name, dtypes, shape, PLAIN, group)


BF16 = ("BF16",)
F32 = ("F32",)


def _hc(out: dict, prefix: str, cfg: ModelConfig, group: str) -> None:
    hc, d = cfg.hc_mult, cfg.hidden_size
    mix = (2 + hc) * hc
    for site in ("attn", "ffn"):
        _plain(out, f"{prefix}hc_{site}_fn", (mix, hc * d), F32, group)
        _plain(out, f"{prefix}hc_{site}_base", (mix,), F32, group)
        _plain(out, f"{prefix}hc_{site}_scale", (3,), F32, group)


def _attention(out: dict, prefix: str, cfg: ModelConfig, group: str) -> None:
    d, h, hd, b = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.weight_block_size
    a = f"{prefix}attn."
    _fp8(out, a + "wq_a", cfg.q_lora_rank, d, b, group)
    _plain(out, a + "q_norm.weight", (cfg.q_lora_rank,), BF16, group)
    _fp8(out, a + "wq_b", h * hd, cfg.q_lora_rank, b, group)
    _fp8(out, a + "wkv", hd, d, b, group)
    _plain(out, a + "kv_norm.weight", (hd,), BF16, group)
    _fp8(out, a + "wo_a", cfg.o_groups * cfg.o_lora_rank, h * hd // cfg.o_groups, b, group)
    _fp8(out, a + "wo_b", d, cfg.o_groups * cfg.o_lora_rank, b, group)
    _plain(out, a + "attn_sink", (h,), F32, group)
    _plain(out, f"{prefix}attn_norm.weight", (d,), BF16, group)
    _plain(out, f"{prefix}ffn_norm.weight", (d,), BF16, group)


def _moe(out: dict, prefix: str, cfg: ModelConfig, n_experts: int, top_k: int, hash_moe: bool, group: str) -> None:
    d, inter, b = cfg.hidden_size, cfg.moe_intermediate_size, cfg.weight_block_size
    f = f"{prefix}ffn."
    _plain(out, f + "gate.weight", (n_experts, d), BF16, group)
    if hash_moe:
        _plain(out, f + "gate.tid2eid", (cfg.vocab_size, top_k), ("I64", "I32"), group)
    else:
        _plain(out, f + "gate.bias", (n_experts,), F32, group)
        if cfg.arch == "v41":
            _plain(out, f + "gate.bias_vl", (n_experts,), F32, group)
    for e in range(n_experts):
        _fp4(out, f"{f}experts.{e}.w1", inter, d, group)
        _fp4(out, f"{f}experts.{e}.w3", inter, d, group)
        _fp4(out, f"{f}experts.{e}.w2", d, inter, group)
    _fp8(out, f + "shared_experts.w1", inter, d, b, group)
    _fp8(out, f + "shared_experts.w3", inter, d, b, group)
    _fp8(out, f + "shared_experts.w2", d, inter, b, group)


def _compressor_v4(out: dict, prefix: str, cfg: ModelConfig, ratio: int, width: int, overlap: bool) -> None:
    coff = 2 if overlap else 1
    _plain(out, prefix + "ape", (ratio, coff * width), F32, "model")
    _plain(out, prefix + "norm.weight", (width,), BF16, "model")
    _plain(out, prefix + "wgate.weight", (coff * width, cfg.hidden_size), BF16, "model")
    _plain(out, prefix + "wkv.weight", (coff * width, cfg.hidden_size), BF16, "model")


def checkpoint_spec(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every tensor of a released checkpoint for this config, keyed by name."""
    out: dict[str, TensorSpec] = {}
    d, b = cfg.hidden_size, cfg.weight_block_size
    _plain(out, "embed.weight", (cfg.vocab_size, d), BF16, "model")
    _plain(out, "head.weight", (cfg.vocab_size, d), BF16, "model")
    _plain(out, "norm.weight", (d,), BF16, "model")
    if cfg.arch == "v4":
        _plain(out, "hc_head_fn", (cfg.hc_mult, cfg.hc_mult * d), F32, "model")
        _plain(out, "hc_head_base", (cfg.hc_mult,), F32, "model")
        _plain(out, "hc_head_scale", (1,), F32, "model")
    ihd, ih = cfg.index_head_dim, cfg.index_n_heads
    for role in cfg.roles:
        p = f"layers.{role.index}."
        _attention(out, p, cfg, "model")
        _hc(out, p, cfg, "model")
        _moe(out, p, cfg, cfg.n_routed_experts, cfg.num_experts_per_tok, role.hash_moe, "model")
        a = p + "attn."
        if cfg.arch == "v41":
            if role.owns_compressor:
                _plain(out, a + "compressor.wkv.weight", (cfg.head_dim, d), BF16, "model")
                if role.compress_ratio > 1:
                    _plain(out, a + "compressor.wgate.weight", (cfg.head_dim, d), BF16, "model")
                _plain(out, a + "compressor.norm.weight", (cfg.head_dim,), BF16, "model")
                _plain(out, a + "indexer.wk.weight", (ihd, cfg.head_dim), BF16, "model")
                _plain(out, a + "indexer.k_norm.weight", (ihd,), BF16, "model")
            if role.runs_indexer:
                _fp8(out, a + "indexer.wq_b", ih * ihd, cfg.q_lora_rank, b, "model")
                _plain(out, a + "indexer.weights_proj.weight", (ih, d), BF16, "model")
            if role.engram:
                k = cfg.engram_layer_ids.index(role.index)
                rows, ehd = cfg.engram_num_embeddings[k], cfg.engram_head_dim
                e = p + "engram."
                out[e + "embed.weight"] = TensorSpec(e + "embed.weight", ("F8_E4M3",), (rows, ehd), ENGRAM)
                out[e + "embed.scale"] = TensorSpec(e + "embed.scale", ("F8_E8M0",), (rows, ehd // 32), SCALE)
                cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * ehd
                _fp8(out, e + "wkv", d * (cfg.hc_mult + 1), cols, b, "model")
                _plain(out, e + "q_weight", (cfg.hc_mult, d), ("BF16", "F32"), "model")
                _plain(out, e + "k_weight", (cfg.hc_mult, d), ("BF16", "F32"), "model")
        elif role.kind in ("csa", "hca"):
            _compressor_v4(out, a + "compressor.", cfg, role.compress_ratio, cfg.head_dim, role.kind == "csa")
            if role.kind == "csa":
                _compressor_v4(out, a + "indexer.compressor.", cfg, role.compress_ratio, ihd, True)
                _fp8(out, a + "indexer.wq_b", ih * ihd, cfg.q_lora_rank, b, "model")
                _plain(out, a + "indexer.weights_proj.weight", (ih, d), BF16, "model")
    out.update(draft_spec(cfg))
    return out


def draft_spec(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """The draft stages (`mtp.K.*`): V4's MTP layer, V4.1's DSpark stages. Each stage is an
    optional group: absent entirely is fine (no speculative decoding), partial is an error."""
    out: dict[str, TensorSpec] = {}
    d, b = cfg.hidden_size, cfg.weight_block_size
    n = cfg.num_nextn_predict_layers
    for k in range(n):
        p, g = f"mtp.{k}.", f"mtp.{k}"
        stage: dict[str, TensorSpec] = {}
        _attention(stage, p, cfg, g)
        _hc(stage, p, cfg, g)
        if cfg.arch == "v4":
            _moe(stage, p, cfg, cfg.n_routed_experts, cfg.num_experts_per_tok, False, g)
            _fp8(stage, p + "e_proj", d, d, b, g)
            _fp8(stage, p + "h_proj", d, d, b, g)
            for norm in ("enorm", "hnorm", "norm"):
                _plain(stage, f"{p}{norm}.weight", (d,), BF16, g)
            _plain(stage, p + "hc_head_fn", (cfg.hc_mult, cfg.hc_mult * d), F32, g)
            _plain(stage, p + "hc_head_base", (cfg.hc_mult,), F32, g)
            _plain(stage, p + "hc_head_scale", (1,), F32, g)
        else:
            _moe(stage, p, cfg, cfg.dspark_n_routed_experts, cfg.dspark_num_experts_per_tok, False, g)
            if k == 0:
                _fp8(stage, p + "main_proj", d, len(cfg.dspark_target_layer_ids) * d, b, g)
                _plain(stage, p + "main_norm.weight", (d,), BF16, g)
            if k == n - 1:
                rank = cfg.dspark_markov_rank
                _plain(stage, p + "norm.weight", (d,), BF16, g)
                _plain(stage, p + "markov_head.embed.weight", (cfg.vocab_size, rank), BF16, g)
                _plain(stage, p + "markov_head.head.weight", (cfg.vocab_size, rank), BF16, g)
                _plain(stage, p + "confidence_head.proj.weight", (1, d + rank), BF16, g)
        out.update(stage)
    return out


IGNORED_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline")
