"""Checkpoint loading: golden sets, exact decoding, compact forms and every corruption case."""

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv4.config import load_config
from dsv4.model import quant
from dsv4.model.spec import ENGRAM, FP4, FP8, PLAIN, checkpoint_spec
from dsv4.model.weights import INDEX_FILE, CheckpointError, load_weights

GOLDEN = Path("/work/shared/golden")
SETS = ["v41-tiny-a", "v41-tiny-a-nofp8kv", "v4-tiny-a"]
FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


@pytest.fixture(scope="module")
def raw_v4():
    return load_file(GOLDEN / "v4-tiny-a" / "model.safetensors")


@pytest.fixture(scope="module")
def raw_v41():
    return load_file(GOLDEN / "v41-tiny-a-nofp8kv" / "model.safetensors")


def _write(folder: Path, golden_set: str, tensors: dict) -> Path:
    """A checkpoint folder with the golden set's config and the given tensors."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(GOLDEN / golden_set / "config.json", folder / "config.json")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _load(folder, cfg=None, **kw) -> dict:
    return load_weights(folder, cfg or load_config(folder), dtype=kw.pop("dtype", torch.float32), progress=False, **kw)


def _exp2(byte) -> float:
    return 2.0 ** (int(byte) - 127)


# ------------------------------------------------------------------------------ golden sets


@pytest.mark.parametrize("name", SETS)
def test_golden_sets_load_with_release_names_and_dtypes(name):
    folder = GOLDEN / name
    cfg = load_config(folder)
    loaded = load_weights(folder, cfg, dtype=torch.bfloat16, progress=name == "v4-tiny-a")
    spec = checkpoint_spec(cfg)
    t = loaded.tensors
    expected = {n for n, s in spec.items() if s.fmt != "scale" and (s.group == "model" or cfg.arch == "v4")}
    expected |= {n for n, s in spec.items() if s.fmt == "scale" and spec[n.removesuffix(".scale") + ".weight"].fmt == ENGRAM}
    assert set(t) == expected
    # V4.1 goldens carry no DSpark weights; the V4 golden has its MTP layer
    assert loaded.draft_stages == (1 if cfg.arch == "v4" else 0)
    for n, s in spec.items():
        if n not in t:
            continue
        if s.fmt == ENGRAM:
            assert t[n].dtype == torch.float8_e4m3fn and t[n.removesuffix(".weight") + ".scale"].dtype == torch.uint8
        elif s.fmt in (FP8, FP4):
            assert t[n].dtype == torch.bfloat16 and tuple(t[n].shape) == (s.shape[0], s.shape[1] * (2 if s.fmt == FP4 else 1))
        elif s.fmt == PLAIN:
            want = {"F32": torch.float32, "BF16": torch.bfloat16, "I64": torch.int64}[s.dtypes[0]]
            assert t[n].dtype == want, n  # fp32 islands stay fp32 under dtype=bf16
    assert t["layers.0.hc_attn_fn"].dtype == torch.float32
    assert t["layers.0.attn.attn_sink"].dtype == torch.float32


def test_fp8_partial_edge_tiles_dequantise_exactly(raw_v41, tmp_path):
    # -nofp8kv's attn.wkv has 48 rows: one full and one half 32-row block. Its golden scales are
    # equal in both blocks, so a copy with a distinct second-block scale checks the tile mapping.
    name = "layers.0.attn.wkv"
    tensors = dict(raw_v41)
    tensors[f"{name}.scale"] = torch.tensor([[119], [123]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    for folder in (GOLDEN / "v41-tiny-a-nofp8kv", _write(tmp_path / "ck", "v41-tiny-a-nofp8kv", tensors)):
        w = _load(folder).tensors[f"{name}.weight"]
        raw = load_file(folder / "model.safetensors")
        codes, scale = raw[f"{name}.weight"], raw[f"{name}.scale"].view(torch.uint8)
        assert w.shape == (48, 32) and w.dtype == torch.float32
        for r in range(48):
            row_scale = _exp2(scale[r // 32, 0])
            expected = torch.tensor([float(c) * row_scale for c in codes[r].float().tolist()])
            assert torch.equal(w[r], expected)
    assert not torch.equal(w[0] / codes[0].float(), w[40] / codes[40].float())


def test_v4_fp8_block_is_128_from_config():
    # V4's block is 128: a [256, 96] matrix has a 2 x 1 grid; rows 128.. use the second scale.
    t = _load(GOLDEN / "v4-tiny-a").tensors["layers.2.attn.wq_b.weight"]
    raw = load_file(GOLDEN / "v4-tiny-a" / "model.safetensors")
    codes, scale = raw["layers.2.attn.wq_b.weight"].float(), raw["layers.2.attn.wq_b.scale"].view(torch.uint8)
    assert scale.shape == (2, 1) and scale[0, 0] != scale[1, 0]
    assert torch.equal(t[:128], codes[:128] * _exp2(scale[0, 0]))
    assert torch.equal(t[128:], codes[128:] * _exp2(scale[1, 0]))


def test_fp4_expert_dequantises_exactly():
    folder = GOLDEN / "v41-tiny-a"
    name = "layers.3.ffn.experts.5.w2"
    w = _load(folder, dtype=torch.float32).tensors[f"{name}.weight"]
    raw = load_file(folder / "model.safetensors")
    packed, scale = raw[f"{name}.weight"].view(torch.uint8), raw[f"{name}.scale"].view(torch.uint8)
    rows, half = packed.shape
    assert w.shape == (rows, 2 * half)
    for r in range(0, rows, 7):
        expected = []
        for c, byte in enumerate(packed[r].tolist()):
            for code in (byte & 0xF, byte >> 4):  # low nibble first: even column
                sign = -1.0 if code & 8 else 1.0
                expected.append(sign * FP4_VALUES[code & 7] * _exp2(scale[r, (2 * c) // 32]))
        assert w[r].tolist() == expected


def test_engram_table_always_compact():
    folder = GOLDEN / "v41-tiny-a"
    raw = load_file(folder / "model.safetensors")
    for compact in (False, True):
        t = _load(folder, compact=compact, dtype=torch.bfloat16).tensors
        for layer in (1, 4):
            w, s = t[f"layers.{layer}.engram.embed.weight"], t[f"layers.{layer}.engram.embed.scale"]
            assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.uint8
            assert torch.equal(w.view(torch.uint8), raw[f"layers.{layer}.engram.embed.weight"].view(torch.uint8))
            assert torch.equal(s, raw[f"layers.{layer}.engram.embed.scale"].view(torch.uint8))


@pytest.mark.parametrize("name", ["v41-tiny-a", "v4-tiny-a"])
def test_compact_mode_is_the_exact_fp8_form(name):
    folder = GOLDEN / name
    cfg = load_config(folder)
    full = _load(folder).tensors
    compact = _load(folder, compact=True).tensors
    b = cfg.weight_block_size
    dense = "layers.2.attn.wq_b"
    w, s = compact[f"{dense}.weight"], compact[f"{dense}.scale"]
    assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.uint8
    assert tuple(s.shape) == (-(-w.shape[0] // b), -(-w.shape[1] // b))
    scale = torch.exp2(s.float() - 127).repeat_interleave(b, 0)[: w.shape[0]].repeat_interleave(b, 1)[:, : w.shape[1]]
    assert torch.equal(w.float() * scale, full[f"{dense}.weight"])
    expert = "layers.3.ffn.experts.1.w1"
    w, s = compact[f"{expert}.weight"], compact[f"{expert}.scale"]
    inter, d = cfg.moe_intermediate_size, cfg.hidden_size
    assert w.dtype == torch.float8_e4m3fn and w.shape == (inter, d)
    assert s.dtype == torch.uint8 and s.shape == (inter, d // 32)
    assert torch.equal(w.float() * torch.exp2(s.float() - 127).repeat_interleave(32, 1), full[f"{expert}.weight"])
    assert f"{dense}.scale" not in full and f"{expert}.scale" not in full
    # fp4_experts: the released FP4 bytes kept, in the kernels' layout, with the same exponents
    kept = _load(folder, compact=True, cfg=dataclasses.replace(cfg, fp4_experts=True)).tensors
    w4, s4 = kept[f"{expert}.weight"], kept[f"{expert}.scale"]
    assert w4.dtype == torch.uint8 and w4.shape == (inter, d // 2) and torch.equal(s4, s)
    assert torch.equal(quant.dequant_fp4_kernel_layout(w4, s4), full[f"{expert}.weight"])


def test_v4_hash_routing_table_is_int64():
    t = _load(GOLDEN / "v4-tiny-a").tensors
    tid = t["layers.0.ffn.gate.tid2eid"]
    assert tid.dtype == torch.int64 and tid.shape == (129280, 2)
    assert "layers.0.ffn.gate.bias" not in t and t["layers.3.ffn.gate.bias"].dtype == torch.float32


def test_sharded_copy_loads_identical_tensors(raw_v4, tmp_path):
    folder = tmp_path / "sharded"
    folder.mkdir()
    shutil.copy(GOLDEN / "v4-tiny-a" / "config.json", folder)
    names = sorted(raw_v4)
    weight_map = {}
    for i in range(3):
        shard = f"model-{i + 1:05d}-of-00003.safetensors"
        part = {n: raw_v4[n] for n in names[i::3]}
        save_file(part, str(folder / shard), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, shard)
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    a, b = _load(folder), _load(GOLDEN / "v4-tiny-a")
    assert a.draft_stages == b.draft_stages == 1
    assert a.tensors.keys() == b.tensors.keys()
    assert all(torch.equal(a.tensors[n], b.tensors[n]) for n in a.tensors)


def test_transformers_loader_agrees_on_golden_v4(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from dsv4.model.make_tiny import hf_v4_extras

    import transformers.quantizers.quantizer_finegrained_fp8 as fp8_quantizer

    # The FP8 quantizer only checks that accelerate is importable; its CPU dequantisation
    # path does not use it, so the check is bypassed when accelerate is not installed.
    monkeypatch.setattr(fp8_quantizer, "is_accelerate_available", lambda: True)
    folder = tmp_path / "hf"
    folder.mkdir()
    config = json.loads((GOLDEN / "v4-tiny-a" / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | hf_v4_extras(config)))
    (folder / "model.safetensors").symlink_to(GOLDEN / "v4-tiny-a" / "model.safetensors")
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    ours = _load(GOLDEN / "v4-tiny-a").tensors
    assert torch.equal(hf["model.layers.2.self_attn.q_b_proj.weight"], ours["layers.2.attn.wq_b.weight"])
    gate_up = torch.cat([ours["layers.4.ffn.experts.3.w1.weight"], ours["layers.4.ffn.experts.3.w3.weight"]])
    assert torch.equal(hf["model.layers.4.mlp.experts.gate_up_proj"][3], gate_up)


# ------------------------------------------------------------------------------ corruption


def test_inventory_problems_are_all_reported_at_once(raw_v4, tmp_path):
    tensors = dict(raw_v4)
    del tensors["layers.3.attn.wq_b.scale"]  # (a) missing
    tensors["layers.2.attn.kv_norm.weight"] = torch.ones(63, dtype=torch.bfloat16)  # (b) wrong shape
    tensors["hc_head_fn"] = tensors["hc_head_fn"].to(torch.bfloat16)  # (c) wrong dtype
    tensors["layers.0.attn.bogus.weight"] = torch.zeros(2)  # (d) unexpected
    tensors["vision.patch_embed.weight"] = torch.zeros(2)  # ignored prefix: not a problem
    folder = _write(tmp_path / "bad", "v4-tiny-a", tensors)
    with pytest.raises(CheckpointError) as err:
        _load(folder)
    msg = str(err.value)
    assert len(err.value.problems) == 4, msg
    assert "layers.3.attn.wq_b.scale: missing (expected F8_E8M0 [2, 1])" in msg
    assert "layers.2.attn.kv_norm.weight: wrong shape: expected [64], got [63]" in msg
    assert "hc_head_fn: wrong dtype: expected F32, got BF16" in msg
    assert "layers.0.attn.bogus.weight: unexpected tensor" in msg
    assert "vision" not in msg


def test_truncated_shard_is_named(tmp_path):
    folder = tmp_path / "cut"
    folder.mkdir()
    shutil.copy(GOLDEN / "v4-tiny-a" / "config.json", folder)
    data = (GOLDEN / "v4-tiny-a" / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated shard"):
        _load(folder)


def test_unreadable_header_is_named(tmp_path):
    folder = tmp_path / "garbage"
    folder.mkdir()
    shutil.copy(GOLDEN / "v4-tiny-a" / "config.json", folder)
    (folder / "model.safetensors").write_bytes((20).to_bytes(8, "little") + b"{not json at all!!!}" + b"\0" * 16)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: unreadable header"):
        _load(folder)


def test_index_pointing_at_missing_shard(raw_v4, tmp_path):
    folder = tmp_path / "sharded"
    folder.mkdir()
    shutil.copy(GOLDEN / "v4-tiny-a" / "config.json", folder)
    names = sorted(raw_v4)
    save_file({n: raw_v4[n] for n in names[::2]}, str(folder / "model-00001-of-00002.safetensors"))
    weight_map = {n: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, n in enumerate(names)}
    (folder / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors: shard file not found"):
        _load(folder)


@pytest.mark.parametrize(
    "golden_set,scale,compact",
    [
        ("v4-tiny-a", "layers.0.attn.wkv.scale", False),
        ("v4-tiny-a", "layers.0.attn.wkv.scale", True),
        ("v4-tiny-a", "layers.5.ffn.experts.2.w3.scale", False),
        ("v4-tiny-a", "layers.5.ffn.experts.2.w3.scale", True),
        ("v41-tiny-a-nofp8kv", "layers.4.engram.embed.scale", False),
    ],
)
def test_nan_scale_byte_is_named(raw_v4, raw_v41, tmp_path, golden_set, scale, compact):
    tensors = dict(raw_v4 if golden_set == "v4-tiny-a" else raw_v41)
    raw = tensors[scale].view(torch.uint8).clone()
    raw.view(-1)[-1] = 0xFF
    tensors[scale] = raw.view(torch.float8_e8m0fnu)
    folder = _write(tmp_path / "nan", golden_set, tensors)
    with pytest.raises(CheckpointError, match=re.escape(f"{scale}: E8M0 scale byte 0xFF")):
        _load(folder, compact=compact)


@pytest.mark.parametrize(
    "scale",
    [
        "layers.0.attn.wkv.scale",  # a dense FP8 weight kept for the kernels
        "layers.4.ffn.experts.1.w2.scale",  # an FP4 expert converted to FP8
    ],
)
def test_fp8_kernel_scale_range_is_checked_when_kept_compact(raw_v41, tmp_path, scale):
    """Compact FP8 weights go to kernels that take scale bytes 1 .. FP8_MAX_SCALE_BYTE
    (`quant.check_fp8_scales`): one byte above is refused, the scale named; dequantised
    in torch (not compact) the same checkpoint loads."""
    tensors = dict(raw_v41)
    raw = tensors[scale].view(torch.uint8).clone()
    raw.view(-1)[-1] = quant.FP8_MAX_SCALE_BYTE + 1
    tensors[scale] = raw.view(torch.float8_e8m0fnu)
    folder = _write(tmp_path / "big", "v41-tiny-a-nofp8kv", tensors)
    with pytest.raises(CheckpointError, match=re.escape(f"{scale}: an FP8 weight scale outside")):
        _load(folder, compact=True)
    assert _load(folder).tensors


def test_partial_draft_stage(raw_v4, tmp_path):
    tensors = {n: t for n, t in raw_v4.items() if n != "mtp.0.e_proj.weight"}
    folder = _write(tmp_path / "mtp", "v4-tiny-a", tensors)
    with pytest.raises(CheckpointError) as err:
        _load(folder)
    assert len(err.value.problems) == 1
    assert "mtp.0.e_proj.weight: missing" in str(err.value) and "draft stage mtp.0 is only partly present" in str(err.value)
    # the whole stage absent is fine: no draft model
    folder = _write(tmp_path / "nomtp", "v4-tiny-a", {n: t for n, t in raw_v4.items() if not n.startswith("mtp.")})
    assert _load(folder).draft_stages == 0
