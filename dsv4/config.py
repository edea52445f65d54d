"""Model configuration parsed from a released `config.json` (V4.1 composite or flat, V4 flat),
with the per-layer role table derived from its fields.

Every role comes from the config (compress ratios, source lists, engram ids, hash layers),
never from hard-coded layer indices; a missing or inconsistent field raises `ConfigError`
naming the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

V41_ARCHS = {"DeepseekV41ForCausalLM", "DeepseekV41ForConditionalGeneration"}
V4_ARCHS = {"DeepseekV4ForCausalLM"}
V41_MODEL_TYPES = {"deepseek_v41", "deepseek_v41_text"}
V4_MODEL_TYPES = {"deepseek_v4"}


class ConfigError(ValueError):
    """The config cannot describe a model dsv4 serves; the message names the field."""


@dataclass(frozen=True)
class Yarn:
    factor: float
    beta_fast: float
    beta_slow: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LayerRole:
    """What one layer does. `kind` is one of:

    * "window": sliding window only (ratio 0);
    * V4.1 CSA2: "full" (owns the compressor and the indexer keys, runs the indexer),
      "reindex" (own indexer query over the source's keys), "reuse" (reuses the latest
      top-k), "source" (owns a compressor but runs no indexer; unusual schedules);
    * V4: "csa" (overlapping ratio-4 compressor + own indexer), "hca" (dense over its own
      non-overlapping compressed entries).
    """

    index: int
    kind: str
    compress_ratio: int
    rope: str  # "main" (ratio 0) or "compress"
    kv_source: int | None  # layer whose compressed cache this layer attends
    index_source: int | None  # layer whose top-k selection this layer uses (None: dense / none)
    is_candidate_source: bool = False
    uses_candidates: bool = False
    engram: bool = False
    hash_moe: bool = False

    @property
    def owns_compressor(self) -> bool:
        return self.kv_source == self.index and self.compress_ratio > 0

    @property
    def runs_indexer(self) -> bool:
        return self.index_source == self.index


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "v41" or "v4"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    rope_theta: float
    compress_rope_theta: float
    yarn: Yarn | None
    max_position_embeddings: int
    window: int
    compress_ratios: tuple[int, ...]  # backbone layers only
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    candidate_topk_blocks: int
    candidate_block_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float
    gate_temp: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    weight_block_size: int
    expert_dtype: str
    bos_token_id: int | None
    eos_token_id: int
    pad_token_id: int | None
    num_nextn_predict_layers: int
    roles: tuple[LayerRole, ...]
    # engram (V4.1)
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_vocab_size: int = 16000000
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    # DSpark (V4.1)
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 0
    dspark_num_experts_per_tok: int = 0
    # numerics, chosen by the engine (not read from config.json): quantise the input of every
    # GEMM over FP8/FP4 checkpoint weights to FP8 per 32 columns, as DeepSeek's reference (and
    # the checkpoint's `activation_scheme: dynamic`) do; False: HF's unquantised inputs, the
    # golden data's numerics
    fp8_activations: bool = False
    # storage, chosen by the engine: compact (GPU) weights keep the routed experts FP4 as
    # released (half the bytes: V4.1's 40 layers of experts 272 instead of 544 GB; the MoE
    # kernels' FP4 variant, the same results; its kernels beat FP8's by 7-11% at 384 experts, but
    # the FP8 shared expert then takes its own launches: docs/PERF.md, tenth session) instead of
    # converting them exactly to FP8; not with fp8_activations (its kernels multiply FP8 codes)
    fp4_experts: bool = False
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    # ----------------------------------------------------------------------------- derived
    @property
    def kv_source_layers(self) -> tuple[int, ...]:
        return tuple(r.index for r in self.roles if r.owns_compressor)

    @property
    def last_kv_source(self) -> int | None:
        sources = self.kv_source_layers
        return sources[-1] if sources else None

    @property
    def ced_split(self) -> int | None:
        """V4.1 causal encoder-decoder: the last KV source. Its compressor runs on every prompt
        token; its attention / FFN and all later layers only need the last `window` tokens
        (bounded replay). None for V4 (every compressed layer owns its compressor)."""
        if self.arch != "v41":
            return None
        return self.last_kv_source

    @property
    def compress_ratio_set(self) -> tuple[int, ...]:
        return tuple(sorted({r for r in self.compress_ratios if r > 0}))

    @property
    def hash_layers(self) -> tuple[int, ...]:
        return tuple(r.index for r in self.roles if r.hash_moe)


# ------------------------------------------------------------------------------------ parsing


def _get(cfg: dict, key: str, expected: type | tuple, default=..., where: str = "config.json"):
    if key not in cfg or cfg[key] is None:
        if default is ...:
            raise ConfigError(f"{where}: missing required field '{key}'")
        return default
    value = cfg[key]
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        names = expected.__name__ if isinstance(expected, type) else "/".join(t.__name__ for t in expected)
        raise ConfigError(f"{where}: field '{key}' must be {names}, got {type(value).__name__} {value!r}")
    return value


def _positive(cfg: dict, key: str, where: str, default=...) -> int:
    value = _get(cfg, key, int, default, where)
    if value <= 0:
        raise ConfigError(f"{where}: field '{key}' must be > 0, got {value}")
    return value


def _int_list(cfg: dict, key: str, where: str, default=...) -> list[int]:
    value = _get(cfg, key, list, default, where)
    if any(not isinstance(v, int) or isinstance(v, bool) for v in value):
        raise ConfigError(f"{where}: field '{key}' must be a list of integers, got {value!r}")
    return list(value)


def _yarn(cfg: dict, where: str) -> Yarn | None:
    scaling = cfg.get("rope_scaling")
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise ConfigError(f"{where}: field 'rope_scaling' must be an object, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise ConfigError(f"{where}: field 'rope_scaling.type' must be 'yarn', got {kind!r}")
    for key in ("factor", "original_max_position_embeddings"):
        if key not in scaling:
            raise ConfigError(f"{where}: missing required field 'rope_scaling.{key}'")
    return Yarn(
        factor=float(scaling["factor"]),
        beta_fast=float(scaling.get("beta_fast") or 32),
        beta_slow=float(scaling.get("beta_slow") or 1),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def _quant(top: dict, text: dict, where: str) -> tuple[int, str]:
    q = top.get("quantization_config") or text.get("quantization_config")
    if q is None:
        raise ConfigError(f"{where}: missing required field 'quantization_config' (the FP8 block size must come from it)")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and block[0] == block[1] and isinstance(block[0], int) and block[0] > 0):
        raise ConfigError(f"{where}: field 'quantization_config.weight_block_size' must be [b, b] with b > 0, got {block!r}")
    if q.get("quant_method", "fp8") != "fp8":
        raise ConfigError(f"{where}: field 'quantization_config.quant_method' must be 'fp8', got {q.get('quant_method')!r}")
    if q.get("scale_fmt", "ue8m0") != "ue8m0":
        raise ConfigError(f"{where}: field 'quantization_config.scale_fmt' must be 'ue8m0', got {q.get('scale_fmt')!r}")
    expert_dtype = q.get("expert_dtype", top.get("expert_dtype", text.get("expert_dtype", "fp4")))
    if expert_dtype != "fp4":
        raise ConfigError(f"{where}: field 'expert_dtype' must be 'fp4', got {expert_dtype!r}")
    return block[0], expert_dtype


def _common(text: dict, where: str) -> dict:
    c = dict(
        vocab_size=_positive(text, "vocab_size", where),
        hidden_size=_positive(text, "hidden_size", where),
        num_layers=_positive(text, "num_hidden_layers", where),
        num_heads=_positive(text, "num_attention_heads", where),
        head_dim=_positive(text, "head_dim", where),
        rope_dim=_positive(text, "qk_rope_head_dim", where),
        q_lora_rank=_positive(text, "q_lora_rank", where),
        o_groups=_positive(text, "o_groups", where),
        o_lora_rank=_positive(text, "o_lora_rank", where),
        rope_theta=_get(text, "rope_theta", float, 10000.0, where),
        compress_rope_theta=_get(text, "compress_rope_theta", float, 160000.0, where),
        yarn=_yarn(text, where),
        max_position_embeddings=_positive(text, "max_position_embeddings", where),
        window=_positive(text, "sliding_window", where),
        index_n_heads=_positive(text, "index_n_heads", where),
        index_head_dim=_positive(text, "index_head_dim", where),
        index_topk=_positive(text, "index_topk", where),
        n_routed_experts=_positive(text, "n_routed_experts", where),
        num_experts_per_tok=_positive(text, "num_experts_per_tok", where),
        n_shared_experts=_get(text, "n_shared_experts", int, 1, where),
        moe_intermediate_size=_positive(text, "moe_intermediate_size", where),
        scoring_func=_get(text, "scoring_func", str, "sqrtsoftplus", where),
        norm_topk_prob=_get(text, "norm_topk_prob", bool, True, where),
        routed_scaling_factor=_get(text, "routed_scaling_factor", float, 1.0, where),
        swiglu_limit=_get(text, "swiglu_limit", float, 0.0, where),
        gate_temp=_get(text, "gate_temp", float, 1.0, where),
        hc_mult=_positive(text, "hc_mult", where),
        hc_sinkhorn_iters=_positive(text, "hc_sinkhorn_iters", where),
        hc_eps=_get(text, "hc_eps", float, 1e-6, where),
        rms_norm_eps=_get(text, "rms_norm_eps", float, ..., where),
        bos_token_id=_get(text, "bos_token_id", int, 0, where),
        eos_token_id=_get(text, "eos_token_id", int, 1, where),
        pad_token_id=_get(text, "pad_token_id", int, None, where),
        num_nextn_predict_layers=_get(text, "num_nextn_predict_layers", int, 0, where),
    )
    if c["scoring_func"] != "sqrtsoftplus":
        raise ConfigError(f"{where}: field 'scoring_func' must be 'sqrtsoftplus', got {c['scoring_func']!r}")
    topk_method = _get(text, "topk_method", str, "noaux_tc", where)
    if topk_method != "noaux_tc":
        raise ConfigError(f"{where}: field 'topk_method' must be 'noaux_tc', got {topk_method!r}")
    if _get(text, "num_key_value_heads", int, 1, where) != 1:
        raise ConfigError(f"{where}: field 'num_key_value_heads' must be 1 (shared-KV MQA)")
    if _get(text, "hidden_act", str, "silu", where) != "silu":
        raise ConfigError(f"{where}: field 'hidden_act' must be 'silu'")
    if c["rope_dim"] > c["head_dim"] or c["rope_dim"] % 2:
        raise ConfigError(f"{where}: field 'qk_rope_head_dim' must be even and <= head_dim, got {c['rope_dim']}")
    if c["rope_dim"] > c["index_head_dim"]:
        raise ConfigError(f"{where}: field 'index_head_dim' must be >= qk_rope_head_dim ({c['rope_dim']})")
    if c["num_heads"] % c["o_groups"]:
        raise ConfigError(f"{where}: field 'o_groups' ({c['o_groups']}) must divide num_attention_heads ({c['num_heads']})")
    if c["num_experts_per_tok"] > c["n_routed_experts"]:
        raise ConfigError(f"{where}: field 'num_experts_per_tok' must be <= n_routed_experts")
    if c["n_shared_experts"] != 1:
        raise ConfigError(f"{where}: field 'n_shared_experts' must be 1, got {c['n_shared_experts']}")
    if c["moe_intermediate_size"] % 32 or c["hidden_size"] % 32:
        raise ConfigError(f"{where}: 'hidden_size' and 'moe_intermediate_size' must be multiples of 32 (FP4 expert scales)")
    return c


def _backbone_ratios(text: dict, n: int, n_draft: int, where: str) -> list[int]:
    ratios = _int_list(text, "compress_ratios", where)
    if len(ratios) < n or len(ratios) > n + max(n_draft, 1):
        raise ConfigError(
            f"{where}: field 'compress_ratios' has {len(ratios)} entries; expected num_hidden_layers ({n})"
            f" plus at most {max(n_draft, 1)} trailing draft-layer entries"
        )
    if any(r < 0 for r in ratios):
        raise ConfigError(f"{where}: field 'compress_ratios' entries must be >= 0, got {ratios}")
    if any(r != 0 for r in ratios[n:]):
        raise ConfigError(f"{where}: field 'compress_ratios' draft-layer entries (after layer {n - 1}) must be 0")
    return ratios[:n]


def _v41_roles(text: dict, n: int, ratios: list[int], where: str) -> tuple[tuple[LayerRole, ...], dict]:
    kv_sources = text.get("kv_source_layer_ids")
    if kv_sources is None:
        # HF's rule for custom schedules: the first layer of each run of equal nonzero ratios.
        kv_sources = [i for i in range(n) if ratios[i] > 0 and (i == 0 or ratios[i - 1] != ratios[i])]
    kv_sources = sorted(_int_list({"kv_source_layer_ids": kv_sources}, "kv_source_layer_ids", where))
    index_sources = text.get("index_source_layer_ids")
    index_sources = sorted(_int_list({"index_source_layer_ids": index_sources if index_sources is not None else kv_sources}, "index_source_layer_ids", where))
    for key, ids in (("kv_source_layer_ids", kv_sources), ("index_source_layer_ids", index_sources)):
        bad = [i for i in ids if not 0 <= i < n or ratios[i] == 0]
        if bad:
            raise ConfigError(f"{where}: field '{key}' entries {bad} must be layers in [0, {n}) with compress_ratios > 0")
    candidate = text.get("candidate_source_layer_id")
    if candidate is None:
        candidate = kv_sources[-1] if kv_sources else -1
    if not isinstance(candidate, int) or isinstance(candidate, bool):
        raise ConfigError(f"{where}: field 'candidate_source_layer_id' must be an integer, got {candidate!r}")
    if candidate >= 0 and candidate not in index_sources:
        raise ConfigError(f"{where}: field 'candidate_source_layer_id' ({candidate}) must be one of index_source_layer_ids {index_sources}")
    engram_ids = _int_list(text, "engram_layer_ids", where, [])
    bad = [i for i in engram_ids if not 0 <= i < n]
    if bad:
        raise ConfigError(f"{where}: field 'engram_layer_ids' entries {bad} out of range [0, {n})")
    roles = []
    for i in range(n):
        r = ratios[i]
        if r == 0:
            roles.append(LayerRole(i, "window", 0, "main", None, None, engram=i in engram_ids))
            continue
        kv = max((s for s in kv_sources if s <= i), default=None)
        if kv is None:
            raise ConfigError(f"{where}: layer {i} has compress_ratios {r} but no kv_source_layer_ids entry at or before it")
        if ratios[kv] != r:
            raise ConfigError(f"{where}: layer {i} (compress ratio {r}) reads KV source {kv} whose compress ratio is {ratios[kv]}")
        idx = max((s for s in index_sources if s <= i), default=None)
        if idx is not None and idx < kv:
            if i == kv or i in index_sources:
                raise ConfigError(f"{where}: layer {i}: its latest index source {idx} precedes its KV source {kv}")
            idx = None  # HF: a compressed branch with no index source attends no compressed entry
        if i == kv:
            kind = "full" if i in index_sources else "source"
        elif i in index_sources:
            kind = "reindex"
        else:
            kind = "reuse"
        roles.append(
            LayerRole(
                i, kind, r, "compress", kv, idx,
                is_candidate_source=i == candidate,
                uses_candidates=i in index_sources and 0 <= candidate < i,
                engram=i in engram_ids,
            )
        )
    extra = dict(engram_layer_ids=tuple(engram_ids))
    return tuple(roles), dict(extra, candidate=candidate)


def _v4_roles(text: dict, n: int, ratios: list[int], where: str) -> tuple[LayerRole, ...]:
    n_hash = _get(text, "num_hash_layers", int, 0, where)
    if not 0 <= n_hash <= n:
        raise ConfigError(f"{where}: field 'num_hash_layers' must be in [0, {n}], got {n_hash}")
    roles = []
    for i in range(n):
        r = ratios[i]
        if r == 0:
            roles.append(LayerRole(i, "window", 0, "main", None, None, hash_moe=i < n_hash))
        elif r == 4:  # the reference's rule: ratio 4 overlaps windows and runs an indexer
            roles.append(LayerRole(i, "csa", r, "compress", i, i, hash_moe=i < n_hash))
        else:
            roles.append(LayerRole(i, "hca", r, "compress", i, None, hash_moe=i < n_hash))
    return tuple(roles)


def parse_config(raw: dict) -> ModelConfig:
    """Parse a released config.json dict (V4.1 composite/flat text config, or V4 flat)."""
    if not isinstance(raw, dict):
        raise ConfigError("config.json: top level must be a JSON object")
    archs = raw.get("architectures") or []
    model_type = raw.get("model_type")
    if set(archs) & V41_ARCHS or model_type in V41_MODEL_TYPES:
        arch = "v41"
    elif set(archs) & V4_ARCHS or model_type in V4_MODEL_TYPES:
        arch = "v4"
    else:
        raise ConfigError(
            f"config.json: unknown architecture (architectures={archs!r}, model_type={model_type!r}); "
            f"dsv4 serves {sorted(V41_ARCHS | V4_ARCHS)}"
        )
    if arch == "v41" and "text_config" in raw:
        text = raw["text_config"]
        if not isinstance(text, dict):
            raise ConfigError("config.json: field 'text_config' must be an object")
        where = "config.json text_config"
        top_ids = {k: raw[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in raw}
        text = {**top_ids, **text}
    else:
        text, where = raw, "config.json"
    block, expert_dtype = _quant(raw, text, where)
    c = _common(text, where)
    n = c["num_layers"]
    ratios = _backbone_ratios(text, n, c["num_nextn_predict_layers"], where)
    c.update(weight_block_size=block, expert_dtype=expert_dtype, compress_ratios=tuple(ratios), raw=raw)
    if arch == "v4":
        roles = _v4_roles(text, n, ratios, where)
        return ModelConfig(arch="v4", roles=roles, candidate_topk_blocks=0, candidate_block_size=1, **c)

    roles, extra = _v41_roles(text, n, ratios, where)
    engram_ids = extra["engram_layer_ids"]
    num_emb = _int_list(text, "engram_num_embeddings", where, [0] * len(engram_ids))
    if len(num_emb) != len(engram_ids):
        raise ConfigError(f"{where}: field 'engram_num_embeddings' (len {len(num_emb)}) must match engram_layer_ids (len {len(engram_ids)})")
    pad_key = "engram_pad_token_id" if "engram_pad_token_id" in text else "engram_pad_id"
    draft_targets = text.get("dspark_target_layer_ids")
    if draft_targets is None:
        sources = {r.index for r in roles if r.owns_compressor}
        draft_targets = sorted(i for i in range(n) if i not in sources)[-3:]
    draft_targets = _int_list({"dspark_target_layer_ids": draft_targets}, "dspark_target_layer_ids", where)
    if any(not 0 <= i < n for i in draft_targets):
        raise ConfigError(f"{where}: field 'dspark_target_layer_ids' entries must be in [0, {n}), got {draft_targets}")
    cfg = ModelConfig(
        arch="v41",
        roles=roles,
        candidate_topk_blocks=_positive(text, "candidate_topk_blocks", where, 2048),
        candidate_block_size=_positive(text, "candidate_block_size", where, 8),
        engram_layer_ids=engram_ids,
        engram_num_embeddings=tuple(num_emb),
        engram_max_ngram_size=_positive(text, "engram_max_ngram_size", where, 4),
        engram_n_heads=_positive(text, "engram_n_heads", where, 8),
        engram_head_dim=_positive(text, "engram_head_dim", where, 256),
        engram_vocab_size=_positive(text, "engram_vocab_size", where, 16000000),
        engram_pad_id=_get(text, pad_key, int, 2, where),
        engram_compressed_vocab_size=_positive(text, "engram_compressed_vocab_size", where, 99092),
        dspark_block_size=_positive(text, "dspark_block_size", where, 5),
        dspark_noise_token_id=_get(text, "dspark_noise_token_id", int, 128799, where),
        dspark_target_layer_ids=tuple(draft_targets),
        dspark_markov_rank=_positive(text, "dspark_markov_rank", where, 256),
        dspark_n_routed_experts=_positive(text, "dspark_n_routed_experts", where, 128),
        dspark_num_experts_per_tok=_positive(text, "dspark_num_experts_per_tok", where, 3),
        **c,
    )
    if engram_ids and cfg.engram_max_ngram_size < 2:
        raise ConfigError(f"{where}: field 'engram_max_ngram_size' must be >= 2")
    if engram_ids and cfg.engram_head_dim % 32:
        raise ConfigError(f"{where}: field 'engram_head_dim' must be a multiple of 32 (E8M0 scale per 32 channels)")
    return cfg


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: not found (a model folder needs config.json)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: invalid JSON ({exc})") from None
    return parse_config(raw)


def yarn_ramp_bounds(dim: int, base: float, yarn: Yarn) -> tuple[float, float]:
    """YaRN correction range (dims with fewer than beta_fast rotations interpolate fully,
    more than beta_slow extrapolate)."""

    def corr(rotations: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    return max(math.floor(corr(yarn.beta_fast)), 0), min(math.ceil(corr(yarn.beta_slow)), dim - 1)


# ------------------------------------------------------------------------------ engine

SCHEDULING_POLICIES = ("fcfs", "priority")
DTYPES = ("float32", "bfloat16")


@dataclass
class EngineConfig:
    """Every engine option, with vLLM's names where the concept is the same. One home: the
    `LLM` keyword arguments and the `dsv4 serve` / `dsv4 generate` flags map onto these."""

    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 256
    kv_cache_memory: int | None = None  # bytes for blocks + state slots; None: see gpu_memory_utilization
    gpu_memory_utilization: float = 0.9  # fraction of free GPU memory when kv_cache_memory is None
    enable_prefix_caching: bool = True
    swa_bounded_replay: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    scheduling_policy: str = "fcfs"
    max_model_len: int | None = None
    max_prefix_loads_per_step: int | None = None  # cap on requests admitted with a prefix hit per step
    seed: int = 0
    enforce_eager: bool = False  # no CUDA graphs (decode buckets, piecewise prefill; fast path on CUDA)
    fast_path: bool | None = None  # None: the fast path where it can run (CUDA, bf16, V4.1); False: reference ops
    # build and launch step N+1 before reading step N's sampled tokens (vLLM's --async-scheduling);
    # None: on where steps replay CUDA graphs (the fast path on CUDA without enforce_eager)
    async_scheduling: bool | None = None
    # FP8-quantised inputs of the FP8/FP4 GEMMs (`ModelConfig.fp8_activations`, DeepSeek's
    # reference numerics); off: HF's numerics, which the golden data holds
    fp8_activations: bool = False
    # keep the routed experts FP4 on the GPU (`ModelConfig.fp4_experts`: half their memory, a
    # MoE as fast or faster but at batch 1, docs/PERF.md); off: converted exactly to FP8 at load
    fp4_experts: bool = False

    def __post_init__(self) -> None:
        def fail(field_name: str, expected: str, got) -> None:
            raise ConfigError(f"{field_name}: expected {expected}, got {got!r}")

        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            fail("device", "'cpu' or 'cuda'", self.device)
        if self.dtype not in DTYPES:
            fail("dtype", f"one of {DTYPES}", self.dtype)
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            fail("block_size", "a positive integer", self.block_size)
        if self.kv_cache_memory is not None and (not isinstance(self.kv_cache_memory, int) or self.kv_cache_memory <= 0):
            fail("kv_cache_memory", "a positive number of bytes", self.kv_cache_memory)
        if not 0 < self.gpu_memory_utilization <= 1:
            fail("gpu_memory_utilization", "a fraction in (0, 1]", self.gpu_memory_utilization)
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs <= 0:
            fail("max_num_seqs", "a positive integer", self.max_num_seqs)
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens <= 0:
            fail("max_num_batched_tokens", "a positive integer", self.max_num_batched_tokens)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            fail("scheduling_policy", f"one of {SCHEDULING_POLICIES}", self.scheduling_policy)
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len <= 0):
            fail("max_model_len", "a positive integer", self.max_model_len)
        if self.max_prefix_loads_per_step is not None and self.max_prefix_loads_per_step <= 0:
            fail("max_prefix_loads_per_step", "a positive integer or None", self.max_prefix_loads_per_step)
        if not isinstance(self.enforce_eager, bool):
            fail("enforce_eager", "a bool", self.enforce_eager)
        if self.fast_path is not None and not isinstance(self.fast_path, bool):
            fail("fast_path", "True, False or None", self.fast_path)
        if not isinstance(self.fp8_activations, bool):
            fail("fp8_activations", "a bool", self.fp8_activations)
        if not isinstance(self.fp4_experts, bool):
            fail("fp4_experts", "a bool", self.fp4_experts)
        if self.fp4_experts and self.fp8_activations:
            fail("fp4_experts", "off with fp8_activations (its expert kernels multiply FP8 weight codes)", self.fp4_experts)
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            fail("async_scheduling", "True, False or None", self.async_scheduling)

    @property
    def torch_dtype(self):
        import torch

        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.dtype]
