"""Tiny random DeepSeek-V4.1 / V4 checkpoints in the exact release format (behind `dsv4 make-tiny`).

`tiny_config` returns a released-format config.json dict with the sizes of the golden sets
(hidden 32, 4 heads, 8 experts, ...) and their layer schedules; `write_tiny_checkpoint` writes
that config, a `model.safetensors` holding exactly the tensors of `checkpoint_spec` (draft
stages included) in the release dtypes, encoded with the real quantisers, and the real
DeepSeek-V4 tokenizer files. Everything is deterministic for a seed, so tests can build
checkpoints on the fly instead of storing them.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file

from dsv4.config import ConfigError, ModelConfig, parse_config
from dsv4.model import quant
from dsv4.model.layers.engram import engram_primes
from dsv4.model.spec import ENGRAM, FP4, FP8, SCALE, TensorSpec, checkpoint_spec
from dsv4.model.tokenizer import (
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    packaged_tokenizer_dir,
)

# Backbone attention schedules of the golden sets (draft-stage zeros are appended per config).
V41_RATIOS = [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1]
V4_RATIOS = [0, 0, 4, 8, 4, 8, 4]

# V4.1 composite configs keep these at the top level; every other override goes to text_config.
_V41_TOP_LEVEL = {
    "architectures", "model_type", "dtype", "bos_token_id", "eos_token_id", "pad_token_id",
    "image_token_id", "tie_word_embeddings", "quantization_config",
}


# ------------------------------------------------------------------------------ configs


def hf_v4_extras(config: dict) -> dict:
    """`layer_types` and `compress_rates` for a flat V4 config, so transformers 5.23 reads it.

    HF 5.23 maps legacy `compress_ratios` only for the released ratios 0 / 4 / 128; with the
    explicit fields any HCA ratio works. Ratio 4 is CSA (overlapping compressor + indexer),
    any other nonzero ratio HCA, as in `dsv4.config`; HF has one rate per layer type, so all
    HCA layers must share one ratio."""
    n = config["num_hidden_layers"]
    ratios = config["compress_ratios"][:n]
    hca = sorted({r for r in ratios if r not in (0, 4)})
    if len(hca) > 1:
        raise ConfigError(f"config.json: HF's config has one HCA compress rate, but compress_ratios uses {hca}")
    names = {0: "sliding_attention", 4: "compressed_sparse_attention"}
    return {
        "layer_types": [names.get(r, "heavily_compressed_attention") for r in ratios],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": hca[0] if hca else 128},
    }


def _v41_text() -> dict:
    return {
        "model_type": "deepseek_v41_text",
        "vocab_size": 129280,
        "hidden_size": 32,
        "moe_intermediate_size": 64,
        "num_hidden_layers": len(V41_RATIOS),
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 96,
        "o_lora_rank": 48,
        "o_groups": 2,
        "hidden_act": "silu",
        "swiglu_limit": 10.0,
        "rms_norm_eps": 1e-20,
        "attention_bias": False,
        "max_position_embeddings": 1048576,
        "rope_theta": 10000,
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 65536},
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "sliding_window": 8,
        "compress_rope_theta": 160000,
        "kv_source_layer_ids": [2, 4, 6],
        "index_source_layer_ids": [2, 4, 6, 8, 10],
        "index_n_heads": 4,
        "index_head_dim": 32,
        "index_topk": 8,
        "candidate_source_layer_id": 6,
        "candidate_topk_blocks": 3,
        "candidate_block_size": 4,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-06,
        "engram_layer_ids": [1, 4],
        "engram_max_ngram_size": 4,
        "engram_vocab_size": 600,
        "engram_n_heads": 2,
        "engram_head_dim": 64,
        "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": 99092,
        "num_nextn_predict_layers": 1,
        "dspark_block_size": 5,
        "dspark_noise_token_id": 128799,
        "dspark_target_layer_ids": [9, 10, 11],
        "dspark_markov_rank": 16,
        "dspark_n_routed_experts": 4,
        "dspark_num_experts_per_tok": 2,
    }


def _v41_config(overrides: dict) -> dict:
    text = _v41_text()
    top = {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "image_token_id": 129264,
        "tie_word_embeddings": False,
        "quantization_config": {
            "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
            "scale_fmt": "ue8m0", "expert_dtype": "fp4",
        },
    }
    for key, value in overrides.items():
        (top if key in _V41_TOP_LEVEL else text)[key] = copy.deepcopy(value)
    if "compress_ratios" not in overrides:
        text["compress_ratios"] = V41_RATIOS + [0] * text["num_nextn_predict_layers"]
    config = {**top, "text_config": text}
    if "engram_num_embeddings" not in overrides:
        # A table has one row per hash bucket: the sum of its layer's primes (MODEL.md 2.2).
        # Without the field parse_config takes sizes of 0, which the prime layout ignores.
        primes = engram_primes(parse_config(config))
        text["engram_num_embeddings"] = [sum(sum(p) for p in layer) for layer in primes]
    return config


def _v4_config(overrides: dict) -> dict:
    config = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "expert_dtype": "fp4",
        "hc_eps": 1e-06,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 32,
        "index_head_dim": 32,
        "index_n_heads": 4,
        "index_topk": 4,
        "initializer_range": 0.02,
        "max_position_embeddings": 1048576,
        "moe_intermediate_size": 64,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts_per_tok": 2,
        "num_hash_layers": 3,
        "num_hidden_layers": len(V4_RATIOS),
        "num_key_value_heads": 1,
        "num_nextn_predict_layers": 1,
        "o_groups": 2,
        "o_lora_rank": 48,
        "q_lora_rank": 96,
        "qk_rope_head_dim": 16,
        "quantization_config": {
            "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
            "weight_block_size": [128, 128],
        },
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536, "type": "yarn"},
        "rope_theta": 10000,
        "routed_scaling_factor": 1.5,
        "scoring_func": "sqrtsoftplus",
        "sliding_window": 8,
        "swiglu_limit": 10.0,
        "tie_word_embeddings": False,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 129280,
        "compress_rope_theta": 160000,
    }
    config.update(copy.deepcopy(overrides))
    if "compress_ratios" not in overrides:
        config["compress_ratios"] = V4_RATIOS + [0] * config["num_nextn_predict_layers"]
    for key, value in hf_v4_extras(config).items():
        if key not in overrides:
            config[key] = value
    return config


def tiny_config(arch: Literal["v41", "v4"], **overrides) -> dict:
    """A released-format config.json dict for a tiny model shaped like the golden sets.

    "v41": composite (top level + `text_config`), 12 layers with the golden CSA2 schedule,
    engram on layers 1 and 4 (`engram_num_embeddings` = sums of the prime layout), one
    DSpark stage. "v4": flat, 7 layers [0,0,4,8,4,8,4] + one MTP layer, 3 hash layers, plus the
    HF fields `layer_types` / `compress_rates` (see `hf_v4_extras`).

    Overrides replace fields (V4.1: top-level keys such as `quantization_config` at the top,
    the rest in `text_config`). Derived fields (`compress_ratios` draft tail, engram table
    sizes, V4 HF fields) follow the overridden values unless given themselves. The result is
    checked with `parse_config`, so an inconsistent override raises ConfigError."""
    if arch == "v41":
        config = _v41_config(overrides)
    elif arch == "v4":
        config = _v4_config(overrides)
    else:
        raise ValueError(f"arch must be 'v41' or 'v4', got {arch!r}")
    parse_config(config)
    return config


# ------------------------------------------------------------------------------ values


def _normal(gen: torch.Generator, shape: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean


def _plain_value(spec: TensorSpec, cfg: ModelConfig, gen: torch.Generator) -> torch.Tensor:
    """A sensible random value for a BF16 / F32 / I64 tensor, chosen by its role."""
    name, shape = spec.name, spec.shape
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "tid2eid":  # hash routing: distinct experts per token
        vocab, k = shape
        return torch.rand((vocab, cfg.n_routed_experts), generator=gen).argsort(dim=1)[:, :k].contiguous()
    if name.endswith("norm.weight") or leaf in ("q_weight", "k_weight") or (leaf.startswith("hc_") and leaf.endswith("_scale")):
        value = _normal(gen, shape, 0.1, 1.0)  # gains around 1
    elif (leaf.startswith("hc_") and leaf.endswith("_base")) or leaf == "attn_sink":
        value = _normal(gen, shape, 0.3)
    elif leaf in ("bias", "bias_vl", "ape"):
        value = _normal(gen, shape, 0.1)
    elif name in ("embed.weight", "head.weight") or name.endswith("markov_head.embed.weight"):
        value = _normal(gen, shape, 1.0 if "embed" in name else 0.5)  # head 0.5: logits of a few units
    else:  # projection [out, in] (incl. hc_*_fn): keep outputs O(1) for unit-RMS inputs
        value = _normal(gen, shape, 0.5 / math.sqrt(shape[-1]))
    return value.to(torch.bfloat16 if spec.dtypes[0] == "BF16" else torch.float32)


def quantize_fp8_tiles(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense weight -> (float8_e4m3fn codes, uint8 E8M0 exponents per `block` x `block` tile).

    Each tile's exponent is the smallest power of two that brings its amax within the e4m3
    range (448); edge tiles may be partial, like the released scale grids."""
    rows, cols = w.shape
    gr, gc = -(-rows // block), -(-cols // block)
    padded = torch.zeros(gr * block, gc * block)
    padded[:rows, :cols] = w
    tiles = padded.view(gr, block, gc, block)
    amax = tiles.abs().amax(dim=(1, 3)).clamp_min(2.0**-100)
    exp = quant.pow2_ceil_exponent(amax / quant.FP8_MAX)
    scale = torch.exp2(exp.to(torch.float32))[:, None, :, None]
    codes = (tiles / scale).clamp(-quant.FP8_MAX, quant.FP8_MAX).to(torch.float8_e4m3fn)
    return codes.view(gr * block, gc * block)[:rows, :cols].contiguous(), (exp + 127).to(torch.uint8)


def _quantised_value(spec: TensorSpec, cfg: ModelConfig, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, E8M0 scale) in their stored dtypes for an FP8 / FP4 / engram tensor."""
    if spec.fmt == FP8:
        codes, exps = quantize_fp8_tiles(_normal(gen, spec.shape, 0.5 / math.sqrt(spec.shape[1])), cfg.weight_block_size)
    elif spec.fmt == FP4:
        out, half = spec.shape
        codes, exps = quant.quantize_fp4(_normal(gen, (out, 2 * half), 0.5 / math.sqrt(2 * half)), 32, e4m3_scale=False)
        codes = codes.view(torch.int8)
    else:  # ENGRAM table rows, embedding-like
        codes, exps = quant.quantize_fp8_ue8m0(_normal(gen, spec.shape, 1.0), 32)
    return codes, exps.view(torch.float8_e8m0fnu)


def tiny_tensors(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of `checkpoint_spec(cfg)` in its release dtype, random but deterministic."""
    spec = checkpoint_spec(cfg)
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name in sorted(spec):
        s = spec[name]
        if s.fmt == SCALE:
            continue  # written with its weight
        if s.fmt in (FP8, FP4, ENGRAM):
            out[name], out[name.removesuffix(".weight") + ".scale"] = _quantised_value(s, cfg, gen)
        else:
            out[name] = _plain_value(s, cfg, gen)
    return out


def write_tiny_checkpoint(out_dir: str | Path, arch: Literal["v41", "v4"], seed: int = 0, config_overrides: dict | None = None) -> Path:
    """Write config.json, model.safetensors and the tokenizer files of a tiny `arch` model to
    `out_dir` (created if needed) and return its path. Same arguments -> identical bytes."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config(arch, **(config_overrides or {}))
    cfg = parse_config(config)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tiny_tensors(cfg, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    source = packaged_tokenizer_dir()
    for name in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE):
        shutil.copyfile(source / name, out / name)
    return out
