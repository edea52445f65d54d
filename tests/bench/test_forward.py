"""`dsv4 bench forward`: case grammar, step planning, the roofline floor (checked by hand on a
two-layer config), random weights in the loader's forms, config shrinking, and an end-to-end
CPU run of the command."""

import argparse
import dataclasses
import json
import math
import time

import pytest
import torch

from dsv4.bench.forward import bench_config, build_case, register_forward, time_step
from dsv4.bench.roofline import (
    COMPONENTS,
    HBM_BYTES_PER_S,
    CaseError,
    Group,
    case_floor,
    expected_experts,
    parse_case,
    parse_cases,
    plan_case,
)
from dsv4.config import parse_config
from dsv4.model.make_tiny import tiny_config
from dsv4.model.model import Model
from dsv4.model.random_weights import dense_weight_bytes, random_weights
from dsv4.model.spec import ENGRAM, FP4, FP8, PLAIN, SCALE, checkpoint_spec


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny CPU steps are thousands of small ops: one intra-op thread avoids threads spinning
    against each other on a shared CI machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------ grammar


@pytest.mark.parametrize(
    "text, groups",
    [
        ("decode=64*1@32768", [Group(64, 1, 32768, False, 0)]),
        ("prefill=8192", [Group(1, 8192, 8192, False, 0)]),
        ("hit=1024@100000", [Group(1, 1024, 100000, False, 0)]),
        ("verify=16*6@32768:5", [Group(16, 6, 32768, False, 5)]),
        ("mix=8192,32*1@8192", [Group(1, 8192, 8192, False, 0), Group(32, 1, 8192, False, 0)]),
        ("chunk=2048@10240c", [Group(1, 2048, 10240, True, 0)]),
        ("hit=1024@100k", [Group(1, 1024, 102400, False, 0)]),
        ("long=8*1@1M", [Group(8, 1, 1 << 20, False, 0)]),
        ("mix2=2048@100000,32*1@100000", [Group(1, 2048, 100000, False, 0), Group(32, 1, 100000, False, 0)]),
    ],
)
def test_case_grammar(text, groups):
    case = parse_case(text)
    assert case.name == text.split("=")[0]
    assert list(case.groups) == groups
    assert case.new_tokens == sum(g.requests * g.new_tokens for g in groups)


@pytest.mark.parametrize(
    "text, message",
    [
        ("decode", "expected NAME="),
        ("=1", "expected NAME="),
        ("x=", "no group after '='"),
        ("x=abc", "does not match"),
        ("x=1@", "does not match"),
        ("x=2*1@8,", "does not match"),
        ("bad name=1", "may only hold"),
        ("x=0", "must be >= 1"),
        ("x=2*0@5", "must be >= 1"),
        ("x=8@4", "K must be >= Q"),
        ("x=6@100:6", "must be < Q"),
        ("x=1@100c", "'c'"),
        ("x=8c", "'c'"),
        ("x=8@100c:2", "'c'"),
    ],
)
def test_case_grammar_errors_say_what_is_wrong(text, message):
    with pytest.raises(CaseError, match=message) as err:
        parse_case(text)
    assert repr(text) in str(err.value)


def test_case_names_must_be_unique():
    with pytest.raises(CaseError, match="used twice"):
        parse_cases(["a=1", "a=2"])


# ------------------------------------------------------------------------------ planning


@pytest.fixture(scope="module")
def two_layer():
    """V4.1 with layer 0 window-only and layer 1 the ratio-1 KV / index / candidate source
    (so also the CED split): every mechanism of the floor, small enough to count by hand."""
    return parse_config(tiny_config(
        "v41", num_hidden_layers=2, compress_ratios=[0, 1, 0], kv_source_layer_ids=[1], index_source_layer_ids=[1],
        candidate_source_layer_id=1, engram_layer_ids=[], engram_num_embeddings=[], vocab_size=100, dspark_target_layer_ids=[0],
    ))


def test_plans_of_decode_verify_chunk_and_hit(two_layer):
    cfg = two_layer  # window 8, ratios {1}
    (d,) = set(plan_case(cfg, parse_case("d=2*1@20")))
    assert (d.start, d.rows, d.window_floor, d.decoder_rows, d.decoder_window_floor, d.emit_from, d.logits_rows) == (19, 1, 0, 1, 12, 0, 1)
    (v,) = plan_case(cfg, parse_case("v=6@50:5"))
    assert (v.start, v.rows, v.decoder_rows, v.logits_rows) == (44, 6, 6, 6)
    (c,) = plan_case(cfg, parse_case("c=4@20c"))
    assert (c.start, c.rows, c.window_floor, c.emit_from) == (16, 4, 0, 0)
    # bounded hit: replay the last 8 cached tokens; decoder on the last 8 rows
    (h,) = plan_case(cfg, parse_case("h=4@20"))
    assert (h.start, h.rows, h.window_floor, h.decoder_rows, h.decoder_window_floor, h.emit_from, h.cached) == (8, 12, 8, 8, 12, 16, 16)
    # exact hit: replay 2 layers * 7 = 14 tokens, every row runs the decoder
    (x,) = plan_case(cfg, parse_case("h=4@20"), bounded_replay=False)
    assert (x.start, x.rows, x.window_floor, x.decoder_rows, x.decoder_window_floor, x.emit_from) == (2, 18, 2, 18, 2, 16)
    (p,) = plan_case(cfg, parse_case("p=32"))
    assert (p.start, p.rows, p.window_floor, p.decoder_rows, p.decoder_window_floor, p.emit_from) == (0, 32, 0, 8, 24, 0)
    with pytest.raises(CaseError, match="max_position_embeddings"):
        plan_case(cfg, parse_case("big=1@2M"))


def test_hit_replay_start_is_aligned_to_every_compress_ratio():
    cfg = parse_config(tiny_config("v4"))  # ratios 4 and 8, window 8
    (h,) = plan_case(cfg, parse_case("h=5@30"))
    # cached 25, replay 8 -> 17, rounded down to 16; hits rewrite from group 24 on
    assert (h.start, h.rows, h.window_floor, h.emit_from, h.decoder_rows) == (16, 14, 16, 24, 14)


# ------------------------------------------------------------------------------ roofline


def test_expected_experts():
    assert expected_experts(8, 2, 1) == 2
    assert expected_experts(8, 2, 2) == 8 * (1 - 0.75**2)
    assert expected_experts(384, 6, 10**6) == pytest.approx(384)


def test_floor_of_a_decode_step_counted_by_hand(two_layer):
    """decode=2*1@20 on the two-layer config, bf16. Dimensions: D 32, H 4, head 64, q_lora 96,
    o 2 x 48, window 8, index 4 x 32 top-8, 8 experts top-2 x 64, hc 4 (24 mixes), vocab 100,
    FP8 tiles 32. Entry bytes: window 64 + 2 = 66, compressed 32 + 4 = 36, index keys 16 + 1 = 17.
    Query at position 19; layer 1 (decoder) sees window floor 20 - 8 = 12."""
    f = case_floor(two_layer, "d=2*1@20", torch.bfloat16)
    c = f["components"]
    # attention, per layer: wq_a 96x32 (3072 + 3 scales), wq_b 256x96 (24576 + 24), wkv 64x32
    # (2048 + 2), wo_a 96x128 (12288 + 12), wo_b 32x96 (3072 + 3), q_norm 192, kv_norm 128,
    # attn_sink 16, attn_norm 64 = 45500 bytes, 45056 FP8 parameters. KV per request: 8 window
    # keys read + 1 written per layer, 8 compressed entries (top-8 of 20) at layer 1.
    assert c["attention"]["bytes"] == 2 * 45500 + 2 * 2 * (8 + 1) * 66 + 2 * 8 * 36
    assert c["attention"]["flops_fp8"] == 2 * 2 * 2 * 45056
    assert c["attention"]["flops_bf16"] == 2 * (4 * 4 * 64 * 8 + 4 * 4 * 64 * (8 + 8))
    # indexer (layer 1): wq_b 128x96 (12288 + 12), weights_proj 4x32 bf16 (256 bytes); scores
    # all 20 entries per query (17 bytes each, 2*4*32 FLOPs each)
    assert c["indexer"]["bytes"] == 12300 + 256 + 2 * 20 * 17
    assert c["indexer"]["flops_fp8"] == 2 * 2 * 12288
    assert c["indexer"]["flops_bf16"] == 2 * 2 * 128 + 2 * 2 * 4 * 32 * 20
    # compressor (layer 1): wkv 64x32 bf16 4096, norm 128, indexer wk 32x64 4096, k_norm 64;
    # one new entry per request (36 + 17 bytes written); wkv per row, wk per entry
    assert c["compressor"]["bytes"] == 4096 + 128 + 4096 + 64 + 2 * (36 + 17)
    assert c["compressor"]["flops_bf16"] == 2 * 2 * 2048 + 2 * 2 * 2048
    # moe, per layer: gate 8x32 bf16 512, bias 32 (bias_vl never read), ffn_norm 64, shared
    # w1/w3 64x32 and w2 32x64 (2048 + 2 scales each); an expert = 3 x (2048 + 64 scales),
    # converted to FP8 (kept FP4, fp4_experts: 3 x (1024 + 64)); 2 tokens hit
    # 8 * (1 - (6/8)^2) = 3.5 experts
    assert c["moe"]["bytes"] == 2 * (512 + 32 + 64 + 3 * 2050 + 3.5 * 3 * 2112)
    kept = case_floor(dataclasses.replace(two_layer, fp4_experts=True), "d=2*1@20", torch.bfloat16)["components"]["moe"]["bytes"]
    assert kept == 2 * (512 + 32 + 64 + 3 * 2050 + 3.5 * 3 * 1088)
    assert c["moe"]["flops_fp8"] == 2 * 2 * (2 * 3 * 2048 + 2 * 3 * 2048 * 2)
    assert c["moe"]["flops_bf16"] == 2 * 2 * 2 * 256
    # mhc, per layer: 2 sites x (fn 24x128 fp32 12288 + base 96 + scale 12); streams 4x32 bf16
    # read + written at both sites for each of 2 rows
    assert c["mhc"]["bytes"] == 2 * 2 * (12288 + 96 + 12) + 2 * 2 * 2 * 2 * 4 * 32 * 2
    assert c["mhc"]["flops_bf16"] == 2 * 2 * 2 * 2 * 3072
    # head: 2 embedding rows, head 100x32 bf16, final norm, fp32 logits of 2 rows
    assert c["head"]["bytes"] == 2 * 32 * 2 + 6400 + 64 + 2 * 100 * 4
    assert c["head"]["flops_bf16"] == 2 * 2 * 3200
    assert c["engram"]["bytes"] == 0
    total_bytes = 93952 + 13236 + 8490 + 57868 + 53680 + 7392
    assert f["bytes"] == total_bytes == 234618
    assert (f["flops_fp8"], f["flops_bf16"]) == (557056, 140288)
    assert f["memory_ms"] == pytest.approx(234618 / 4.2e12 * 1e3)
    assert f["compute_ms"] == pytest.approx((557056 / 1365e12 + 140288 / 758e12) * 1e3)
    assert f["floor_ms"] == f["memory_ms"] and f["bound"] == "memory"
    for name in COMPONENTS:
        assert c[name]["floor_ms"] == max(c[name]["memory_ms"], c[name]["compute_ms"])


def test_floor_counts_window_keys_once_per_request(two_layer):
    """A bounded hit h=4@20: layer 0 runs rows 8..19 with floor 8; per-query window keys sum
    to 1+2+...+8 + 4*8 = 68, but only positions 8..19 exist (12 keys) to read."""
    hit = case_floor(two_layer, "h=4@20", torch.bfloat16)["components"]["attention"]["bytes"]
    decode = case_floor(two_layer, "h=1@20", torch.bfloat16)["components"]["attention"]["bytes"]
    weights = 2 * 45500
    # hit: layer 0 reads 12 + writes 8; layer 1 (rows 12..19, floor 12) reads 8 + writes 8,
    # compressed entries: sum over queries 12..19 of min(8, p + 1) = 64, capped at 20 entries
    assert hit == weights + (12 + 8 + 8 + 8) * 66 + 20 * 36
    assert decode == weights + 2 * (8 + 1) * 66 + 8 * 36


def test_real_v41_decode_reads_the_documented_kv_per_token():
    """V4.1 at real size, one decode token at 100k. Attention weights per layer: wq_a
    1280x5120 (+40x160 scales), wq_b 32768x1280 (+1024x40), wkv 512x5120 (+16x160), wo_a
    8192x4096 (+256x128), wo_b 5120x8192 (+160x256), q_norm / kv_norm / attn_norm bf16,
    attn_sink fp32 = 126,753,280 bytes. KV: per layer 128 window entries read + 1 written x
    528 B; 38 compressed layers x 512 entries x 288 B. Indexer: wq_b 4096x1280 (+128x40) and
    weights_proj 32x5120 bf16 on 8 layers; keys scored: 3 ratio-2 sources 50,000 entries,
    layer 20 100,000, 4 reindex layers their 16,384-entry candidate pools, 68 B each."""
    f = case_floor(bench_config("v41"), "d=1@100000", torch.bfloat16)["components"]
    assert f["attention"]["bytes"] == 40 * 126_753_280 + 40 * 129 * 528 + 38 * 512 * 288
    assert f["indexer"]["bytes"] == 8 * (5_242_880 + 5120 + 327_680) + (3 * 50_000 + 100_000 + 4 * 16_384) * 68


# ------------------------------------------------------------------------------ weights


@pytest.mark.parametrize("arch", ["v41", "v4"])
@pytest.mark.parametrize("compact,fp4_experts", [(False, False), (True, False), (True, True)])
def test_random_weights_match_the_loader_forms(arch, compact, fp4_experts):
    cfg = dataclasses.replace(parse_config(tiny_config(arch)), fp4_experts=fp4_experts)
    w = random_weights(cfg, dtype=torch.bfloat16, device="cpu", compact=compact, seed=1)
    spec = {n: s for n, s in checkpoint_spec(cfg).items() if s.group == "model"}
    weights = {n for n, s in spec.items() if s.fmt != SCALE}
    scales = {n for n, s in spec.items() if s.fmt == SCALE and (compact or spec[n.removesuffix(".scale") + ".weight"].fmt == ENGRAM)}
    assert set(w) == weights | scales
    for name, s in spec.items():
        if name not in w:
            continue
        t = w[name]
        if s.fmt == PLAIN:
            want = {"F32": torch.float32, "I64": torch.int64}.get(s.dtypes[0], torch.bfloat16)
            assert t.dtype == want and tuple(t.shape) == s.shape, name
        elif s.fmt == ENGRAM or (compact and s.fmt in (FP8, FP4)):
            cols = s.shape[1] * (2 if s.fmt == FP4 else 1)
            if s.fmt == FP4 and fp4_experts:  # the checkpoint's bytes, in the kernels' layout
                assert t.dtype == torch.uint8 and tuple(t.shape) == s.shape, name
            else:
                assert t.dtype == torch.float8_e4m3fn and tuple(t.shape) == (s.shape[0], cols), name
            scale = w[name.removesuffix(".weight") + ".scale"]
            grid = (s.shape[0], cols // 32) if s.fmt != FP8 else spec[name.removesuffix(".weight") + ".scale"].shape
            assert scale.dtype == torch.uint8 and tuple(scale.shape) == tuple(grid), name
        elif s.fmt in (FP8, FP4):
            assert t.dtype == torch.bfloat16 and tuple(t.shape) == (s.shape[0], s.shape[1] * (2 if s.fmt == FP4 else 1)), name
        assert t.dtype == torch.uint8 or torch.isfinite(t.float()).all(), name
    if arch == "v4":
        tid2eid = w["layers.0.ffn.gate.tid2eid"]
        assert int(tid2eid.max()) < cfg.n_routed_experts
        assert (tid2eid.sort(dim=1).values.diff(dim=1) > 0).all()  # distinct experts per token
    else:
        # one projection's values have the intended spread: ~N(0, 1/fan_in)
        wq_a = w["layers.0.attn.wq_a.weight"].float()
        if compact:
            wq_a = wq_a * 2.0 ** (w["layers.0.attn.wq_a.scale"][0, 0].item() - 127)
        assert 0.5 < wq_a.std().item() * math.sqrt(cfg.hidden_size) < 2
    if not compact:
        assert dense_weight_bytes(cfg, torch.bfloat16) == sum(t.numel() * t.element_size() for t in w.values())
    again = random_weights(cfg, dtype=torch.bfloat16, device="cpu", compact=compact, seed=1)
    assert all(torch.equal(again[n].view(torch.uint8) if again[n].dtype == torch.float8_e4m3fn else again[n],
                           w[n].view(torch.uint8) if w[n].dtype == torch.float8_e4m3fn else w[n]) for n in w)


@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_model_runs_on_random_weights_and_a_random_cache(arch):
    cfg = parse_config(tiny_config(arch))
    w = random_weights(cfg, dtype=torch.float32, device="cpu", compact=False)
    token_map = torch.randint(0, cfg.engram_compressed_vocab_size, (cfg.vocab_size,))
    model = Model(cfg, w, dtype=torch.float32, device="cpu", token_map=token_map)
    plans = plan_case(cfg, parse_case("m=24@40,2*1@64,3@50:2"))
    cache, batch = build_case(cfg, plans, block_size=256, dtype=torch.float32, device=torch.device("cpu"), seed=0)
    assert batch.input_ids.numel() == sum(p.rows for p in plans)
    hidden = model.forward(batch, cache)
    assert hidden.shape == (1 + 2 + 3, cfg.hidden_size)
    assert torch.isfinite(hidden).all()
    assert torch.isfinite(model.logits(hidden)).all()


# ------------------------------------------------------------------------------ configs


def test_num_layers_keeps_every_layer_kind():
    full = bench_config("v41")
    kinds = {r.kind for r in full.roles}
    small = bench_config("v41", num_layers=8, num_experts=16)
    assert small.num_layers == 8 and small.n_routed_experts == 16 and small.num_experts_per_tok == 6
    assert {r.kind for r in small.roles} == kinds  # window, full, reuse, reindex
    assert any(r.engram for r in small.roles) and small.ced_split is not None
    assert {r.compress_ratio for r in small.roles} == {0, 1, 2}
    assert any(r.is_candidate_source for r in small.roles) and any(r.uses_candidates for r in small.roles)
    v4 = bench_config("v4", num_layers=3, num_experts=64)
    assert [r.kind for r in v4.roles] == ["window", "csa", "hca"] and v4.hash_layers == (0, 1)
    assert v4.n_routed_experts == 64
    assert bench_config("v41", num_experts=4).num_experts_per_tok == 4


def test_num_layers_keeps_the_kinds_in_proportion():
    """V4's schedule alternates CSA and HCA layers (21 / 20 of 43): a shrunk model keeps about
    that mix, not what an even spread over the alternation happens to hit."""
    for n in (6, 8, 12, 16):
        kinds = [r.kind for r in bench_config("v4", num_layers=n).roles]
        assert kinds.count("window") >= 1 and abs(kinds.count("csa") - kinds.count("hca")) <= 1, (n, kinds)
    v41 = [r.kind for r in bench_config("v41", num_layers=16).roles]
    assert v41.count("reuse") >= 8  # 31 of the 40 layers


def test_engram_rows_cap_keeps_the_prime_layout_consistent():
    cfg = bench_config("v41", num_layers=4, engram_rows=1 << 20)
    assert cfg.engram_layer_ids and all(0.9 * (1 << 20) < n < 1.1 * (1 << 20) for n in cfg.engram_num_embeddings)
    assert bench_config("tiny-v41", engram_rows=1 << 20).engram_num_embeddings == parse_config(tiny_config("v41")).engram_num_embeddings


# ------------------------------------------------------------------------------ end to end


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dsv4 bench")
    register_forward(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["forward", *argv])
    return args.func(args)


def test_bench_forward_end_to_end_on_cpu(tmp_path, capsys):
    out = tmp_path / "forward.json"
    rc = _run(["--config", "tiny-v41", "--device", "cpu", "--warmup", "0", "--iters", "2", "--json", str(out),
               "decode=2*1@64", "prefill=32", "hit=8@40"])
    assert rc == 0
    printed = capsys.readouterr().out
    for text in ("forward steps", "step time by component", "floor by component", "decode=2*1@64", "hit=8@40"):
        assert text in printed
    doc = json.loads(out.read_text())
    assert {"config", "dtype", "device", "device_name", "torch", "fast_path", "block_size", "bounded_replay", "cases"} <= set(doc)
    assert doc["device"] == "cpu" and doc["config"]["arch"] == "v41" and doc["config"]["num_layers"] == 12
    assert [c["name"] for c in doc["cases"]] == ["decode", "prefill", "hit"]
    for c in doc["cases"]:
        assert {"case", "requests", "new_tokens", "rows", "fast", "floor", "floor_ratio", "reference", "reference_ratio"} <= set(c)
        fast = c["fast"]
        assert len(fast["times_ms"]) == 2 and fast["median_ms"] > 0 and fast["tokens_per_s"] > 0
        assert fast["sync_median_ms"] is None and not fast["cuda_graph"]  # graph timings are CUDA's
        assert set(fast["breakdown_pct"]) == {*COMPONENTS, "other"}
        assert sum(fast["breakdown_pct"].values()) == pytest.approx(100)
        assert fast["breakdown_ms"]["attention"] > 0 and fast["breakdown_ms"]["moe"] > 0
        assert set(c["floor"]["components"]) == set(COMPONENTS) and c["floor"]["floor_ms"] > 0
        assert c["floor_ratio"] == pytest.approx(fast["median_ms"] / c["floor"]["floor_ms"])
        assert "skipped" in c["reference"] and c["reference_ratio"] is None  # no baseline by default on CPU
        assert f" {c['floor_ratio']:,.2f} " in printed  # the ratio the targets are read at (1.43x), to 2 decimals
    assert f"floor: the H200's, whatever GPU ran the steps ({HBM_BYTES_PER_S / 1e12:.1f} TB/s HBM" in printed
    assert [c["rows"] for c in doc["cases"]] == [2, 32, 16]  # the hit replays 8 tokens
    assert doc["cases"][1]["fast"]["breakdown_ms"]["compressor"] > 0
    assert doc["cases"][0]["fast"]["breakdown_ms"]["engram"] > 0


def test_back_to_back_timing_counts_every_call_of_each_burst():
    calls = []
    times = time_step(lambda: calls.append(time.perf_counter()) or time.sleep(0.002), torch.device("cpu"), warmup=1, iters=2, burst=4)
    assert len(calls) == 1 + 2 * 4 and len(times) == 2
    assert all(1.9 < t < 50 for t in times)  # ms per call, not per burst


def test_bench_forward_v4_with_baseline_and_bad_input(tmp_path, capsys):
    out = tmp_path / "v4.json"
    argv = ["--config", "tiny-v4", "--device", "cpu", "--warmup", "0", "--iters", "1", "--no-swa-bounded-replay",
            "--baseline", "--no-breakdown", "--json", str(out), "mix=12@40,2*1@30"]
    assert _run(argv) == 0
    printed = capsys.readouterr().out
    assert "reference: mix=12@40,2*1@30" in printed and "step time by component" not in printed
    (case,) = json.loads(out.read_text())["cases"]
    assert case["reference"]["median_ms"] > 0 and case["reference_ratio"] > 0 and case["fast"]["breakdown_ms"] is None
    assert _run(["--config", "tiny-v41", "--device", "cpu", "bad=8@4"]) == 2
    assert "K must be >= Q" in capsys.readouterr().out
    assert _run(["--config", "tiny-v41", "--device", "cpu", "q=3@2:1c"]) == 2
    assert "does not match [N*]Q[@K][c][:D]" in capsys.readouterr().out  # the grammar printed whole, not eaten as markup
    assert _run(["--config", "tiny-v41", "--device", "cpu", "--block-size", "3", "d=1@8"]) == 2
    assert "--block-size" in capsys.readouterr().out
    assert _run(["--config", "no/such/config.json", "d=1"]) == 2
    assert "neither a built-in" in capsys.readouterr().out
    assert _run(["--config", "tiny-v4", "--device", "cpu", "--fp8-activations", "d=1@8"]) == 2
    assert "--fp8-activations: V4.1 configs only" in capsys.readouterr().out


def test_bench_forward_fp8_activations_on_cpu(tmp_path, capsys):
    """The flag reaches the model (both paths quantise their FP8/FP4 GEMM inputs) and the JSON."""
    out = tmp_path / "fp8.json"
    assert _run(["--config", "tiny-v41", "--device", "cpu", "--warmup", "0", "--iters", "1", "--no-breakdown", "--fp8-activations",
                 "--json", str(out), "decode=2*1@64"]) == 0
    doc = json.loads(out.read_text())
    assert doc["fp8_activations"] and "FP8 activations" in doc["fast_path"] and "FP8 activations" in capsys.readouterr().out


def test_bench_forward_fp4_experts(tmp_path, capsys):
    """The flag reaches the config (the floor counts the experts' FP4 bytes; on the GPU the
    weights are kept FP4) and the JSON; with FP8 activations it is a clear error."""
    docs = {}
    for flag in ("--no-fp4-experts", "--fp4-experts"):
        out = tmp_path / f"{flag}.json"
        assert _run(["--config", "tiny-v41", "--device", "cpu", "--warmup", "0", "--iters", "1", "--no-breakdown", "--no-baseline", flag,
                     "--json", str(out), "decode=2*1@64"]) == 0
        docs[flag] = json.loads(out.read_text())
    assert docs["--fp4-experts"]["fp4_experts"] and not docs["--no-fp4-experts"]["fp4_experts"]
    assert "FP4 experts" in docs["--fp4-experts"]["fast_path"] and "FP4 experts" in capsys.readouterr().out
    moe_bytes = {f: d["cases"][0]["floor"]["components"]["moe"]["bytes"] for f, d in docs.items()}
    assert moe_bytes["--fp4-experts"] < moe_bytes["--no-fp4-experts"]
    assert _run(["--config", "tiny-v41", "--device", "cpu", "--fp4-experts", "--fp8-activations", "d=1@8"]) == 2
    assert "--fp4-experts: not with --fp8-activations" in capsys.readouterr().out


def test_bench_forward_reports_a_failing_case_and_runs_the_rest(tmp_path, capsys, monkeypatch):
    """A case that raises is an error row (its type and message) and the other cases still run."""
    from dsv4.bench import forward

    real = forward.build_case

    def flaky(cfg, plans, **kw):
        if sum(p.new_tokens for p in plans) == 3:
            raise RuntimeError("boom at three tokens")
        return real(cfg, plans, **kw)

    monkeypatch.setattr(forward, "build_case", flaky)
    out = tmp_path / "forward.json"
    assert _run(["--config", "tiny-v41", "--device", "cpu", "--warmup", "0", "--iters", "1", "--no-breakdown", "--json", str(out), "bad=3*1@16", "good=2*1@16"]) == 0
    bad, good = json.loads(out.read_text())["cases"]
    assert bad["fast"]["error"] == "failed: RuntimeError: boom at three tokens"
    assert good["fast"]["median_ms"] > 0
    assert "boom at three tokens" in capsys.readouterr().out


def test_bench_forward_v4_fast_path_runs_every_case_kind(tmp_path):
    """V4-Flash's fast path (its torch code on CPU) through the case kinds a run may ask for:
    verify rows, a decode batch beside a chunked prefill, decode at 1M tokens of context
    (HCA's widest tables), a prefix hit, one token at position 0 — each a finite step."""
    out = tmp_path / "v4fast.json"
    cases = ["v=4*3@3000:2", "mix=8*1@1600,100@800c", "k=1*1@1M", "hit=40@500", "h=1*1@1"]
    argv = ["--config", "tiny-v4", "--device", "cpu", "--fast-path", "--warmup", "0", "--iters", "1", "--no-breakdown", "--no-baseline",
            "--json", str(out), *cases]
    assert _run(argv) == 0
    got = json.loads(out.read_text())["cases"]
    assert [c["case"] for c in got] == cases
    assert all("error" not in c["fast"] and c["fast"]["median_ms"] > 0 for c in got), got
