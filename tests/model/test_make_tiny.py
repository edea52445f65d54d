"""Tiny release-format checkpoints: configs, inventory, encodings, determinism, HF loading."""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dsv4.config import ConfigError, load_config, parse_config
from dsv4.model import quant
from dsv4.model.layers.engram import engram_primes
from dsv4.model.make_tiny import tiny_config, write_tiny_checkpoint
from dsv4.model.spec import FP4, FP8, checkpoint_spec
from dsv4.model.weights import load_weights

GOLDEN = Path("/work/shared/golden")


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: write_tiny_checkpoint(root / arch, arch, seed=3) for arch in ("v41", "v4")}


def test_configs_match_the_golden_shapes():
    golden_v41 = json.loads((GOLDEN / "v41-tiny-a" / "config.json").read_text())
    assert tiny_config("v41") == golden_v41
    golden_v4 = json.loads((GOLDEN / "v4-tiny-a" / "config.json").read_text())
    v4 = tiny_config("v4")
    assert v4.pop("layer_types") == ["sliding_attention"] * 2 + ["compressed_sparse_attention", "heavily_compressed_attention"] * 2 + [
        "compressed_sparse_attention"
    ]
    assert v4.pop("compress_rates") == {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}
    golden_v4.pop("transformers_version")
    assert v4 == golden_v4


def test_engram_table_sizes_follow_the_prime_layout():
    layout = json.loads((GOLDEN / "v41-tiny-a" / "golden.json").read_text())["engram_layout"]
    assert engram_primes(parse_config(tiny_config("v41"))) == layout["primes"]
    # the released V4.1-Flash layout: 8 heads, prime search from 16,000,000 (MODEL.md 2.2)
    real = tiny_config("v41", engram_n_heads=8, engram_vocab_size=16_000_000)
    assert real["text_config"]["engram_num_embeddings"] == [384006168, 384016682]


def test_overrides_and_derived_fields():
    cfg = tiny_config("v41", engram_n_heads=3, num_nextn_predict_layers=3, pad_token_id=5)
    text = cfg["text_config"]
    assert cfg["pad_token_id"] == 5 and "pad_token_id" not in text
    assert text["engram_num_embeddings"] == [sum(map(sum, layer)) for layer in engram_primes(parse_config(cfg))]
    assert text["engram_num_embeddings"] != tiny_config("v41")["text_config"]["engram_num_embeddings"]
    assert text["compress_ratios"][-4:] == [1, 0, 0, 0]
    v4 = tiny_config("v4", compress_ratios=[0, 4, 16, 4, 16, 0, 0, 0])
    assert v4["layer_types"][1:3] == ["compressed_sparse_attention", "heavily_compressed_attention"]
    assert v4["compress_rates"]["heavily_compressed_attention"] == 16
    with pytest.raises(ConfigError, match="o_groups"):
        tiny_config("v41", o_groups=3)
    with pytest.raises(ConfigError, match="one HCA compress rate"):  # HF has one rate per layer type
        tiny_config("v4", compress_ratios=[0, 4, 8, 4, 16, 0, 0, 0])


@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_written_checkpoint_is_exactly_the_spec(tiny_dirs, arch):
    folder = tiny_dirs[arch]
    cfg = load_config(folder)
    spec = checkpoint_spec(cfg)
    with safe_open(folder / "model.safetensors", "pt") as f:
        assert set(f.keys()) == set(spec)
        for name in f.keys():
            sl = f.get_slice(name)
            assert sl.get_dtype() == spec[name].dtypes[0] and tuple(sl.get_shape()) == spec[name].shape, name
    loaded = load_weights(folder, cfg, dtype=torch.float32, progress=False)
    assert loaded.draft_stages == cfg.num_nextn_predict_layers == 1
    for file in ("tokenizer.json", "tokenizer_config.json"):
        assert (folder / file).read_bytes() == (GOLDEN / "v4-tiny-a" / file).read_bytes()


def test_v41_with_three_dspark_stages(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "v41x3", "v41", config_overrides={"num_nextn_predict_layers": 3})
    loaded = load_weights(folder, load_config(folder), dtype=torch.bfloat16, compact=True, progress=False)
    assert loaded.draft_stages == 3
    t = loaded.tensors
    assert "mtp.0.main_proj.weight" in t and "mtp.2.markov_head.embed.weight" in t
    assert "mtp.1.main_proj.weight" not in t and "mtp.0.markov_head.head.weight" not in t
    assert t["mtp.1.ffn.experts.3.w2.weight"].dtype == torch.float8_e4m3fn


def test_quantised_encodings_use_amax_scales(tiny_dirs):
    folder = tiny_dirs["v41"]
    cfg = load_config(folder)
    spec = checkpoint_spec(cfg)
    b = cfg.weight_block_size
    with safe_open(folder / "model.safetensors", "pt") as f:
        for name in ("layers.0.attn.wq_b.weight", "layers.4.engram.wkv.weight", "mtp.0.main_proj.weight"):
            assert spec[name].fmt == FP8
            codes = f.get_tensor(name).float().abs()
            # the smallest power-of-two scale that fits the tile: its amax lands in [224, 448] (224 when rounding reaches it)
            for r in range(0, codes.shape[0], b):
                for c in range(0, codes.shape[1], b):
                    assert 224 <= codes[r : r + b, c : c + b].max() <= 448, (name, r, c)
        name = "layers.2.ffn.experts.6.w1.weight"
        assert spec[name].fmt == FP4
        values = quant.fp4_lut(torch.device("cpu"))[quant.unpack_fp4(f.get_tensor(name)).long()].abs()
        group_max = values.unflatten(1, (-1, 32)).amax(-1)
        assert bool(((group_max >= 3) & (group_max <= 6)).all())
        scale = f.get_tensor("layers.1.engram.embed.scale").view(torch.uint8)
        assert len(set(scale.flatten().tolist())) > 1  # per-row scales vary, they must be applied


def test_plain_values_are_sensible(tiny_dirs):
    t = load_weights(tiny_dirs["v4"], load_config(tiny_dirs["v4"]), dtype=torch.float32, progress=False).tensors
    tid = t["layers.1.ffn.gate.tid2eid"]
    assert tid.min() >= 0 and tid.max() < 8
    assert bool((tid[:, 0] != tid[:, 1]).all())  # no expert twice for one token
    assert abs(t["layers.0.attn_norm.weight"].mean() - 1) < 0.1
    assert abs(t["hc_head_scale"] - 1).max() < 0.5
    assert t["layers.2.attn.compressor.ape"].abs().max() < 1
    assert 0.01 < t["layers.3.attn.wq_a.weight"].std() < 0.2


def test_same_seed_same_bytes(tiny_dirs, tmp_path):
    again = write_tiny_checkpoint(tmp_path / "again", "v4", seed=3)
    for file in ("config.json", "model.safetensors"):
        assert (again / file).read_bytes() == (tiny_dirs["v4"] / file).read_bytes()
    other = write_tiny_checkpoint(tmp_path / "other", "v4", seed=4)
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()


# Checkpoint -> transformers 5.23 names for V4 (MODEL.md section 4.3), applied in order.
_HF_V4_RULES = [
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight$", "embed_tokens.weight"), (r"^head\.weight$", "lm_head.weight"),
    (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"), (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."), (r"\.hc_attn_", ".attn_hc."), (r"\.hc_ffn_", ".ffn_hc."),
    (r"\.attn_sink$", ".sinks"), (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."), (r"\.norm\.", ".kv_norm."), (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."), (r"\.wq_b\.", ".q_b_proj."), (r"\.wkv\.", ".kv_proj."), (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."), (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"), (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."), (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]


def _hf_v4_state(ours: dict) -> dict:
    """Our decoded V4 tensors under HF's names, routed experts stacked as HF fuses them."""
    out, experts = {}, {}
    for name, value in ours.items():
        if name.startswith("mtp."):  # HF does not instantiate the MTP layer
            continue
        m = re.fullmatch(r"(layers\.\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight", name)
        if m:
            experts.setdefault(m[1], {})[int(m[2]), m[3]] = value
            continue
        for pattern, repl in _HF_V4_RULES:
            name = re.sub(pattern, repl, name)
        out[name if name == "lm_head.weight" else f"model.{name}"] = value
    for layer, e in experts.items():
        n = 1 + max(i for i, _ in e)
        out[f"model.{layer}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat([e[i, "w1"], e[i, "w3"]]) for i in range(n)])
        out[f"model.{layer}.mlp.experts.down_proj"] = torch.stack([e[i, "w2"] for i in range(n)])
    return out


def test_transformers_loads_tiny_v4_with_equal_parameters(tiny_dirs, monkeypatch):
    transformers = pytest.importorskip("transformers")
    import transformers.quantizers.quantizer_finegrained_fp8 as fp8_quantizer

    # The FP8 quantizer only checks that accelerate is importable; its CPU dequantisation
    # path does not use it, so the check is bypassed when accelerate is not installed.
    monkeypatch.setattr(fp8_quantizer, "is_accelerate_available", lambda: True)
    folder = tiny_dirs["v4"]
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    ours = _hf_v4_state(load_weights(folder, load_config(folder), dtype=torch.float32, progress=False).tensors)
    assert set(hf) == set(ours)
    different = [n for n in hf if not torch.equal(hf[n].to(ours[n].dtype), ours[n])]
    assert not different
    assert parse_config(json.loads((folder / "config.json").read_text())).compress_ratios == (0, 0, 4, 8, 4, 8, 4)
