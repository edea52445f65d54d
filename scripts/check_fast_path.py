#!/usr/bin/env python3
"""Every Triton kernel of the fast path checked against its torch reference on the inputs the
model really gives it: a golden set runs through the engine (prompt logits, then greedy
decode steps) and each kernel call is repeated on the torch code with the same arguments.

Kernel tests (tests/ops) check each kernel on random inputs; this checks the wiring: the
arguments, layouts, strides and dtypes the model passes. Works on CUDA, and on CPU in Triton's
interpreter (slow: tiny prompts only).

    python scripts/check_fast_path.py GOLDEN_FOLDER [--prompts 1,3] [--steps 2]

Prints the largest error per kernel (relative to the reference's largest magnitude; stores,
round trips, top-k and hashes must be exact) and exits 1 if any is out of tolerance.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the kernels run on CPU tensors in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ["DSV4_TRITON_ON_CPU"] = "1"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "ops"))
    import conftest  # noqa: F401  (the interpreter fixes)

from safetensors.torch import load_file

import dsv4.ops
import dsv4.ops.triton as triton_ops
from dsv4.cache.storage import QTensor
from dsv4.engine.sampling_params import SamplingParams
from dsv4.llm import LLM
from dsv4.model import quant
from dsv4.model.layers import attention as attention_layer
from dsv4.model.layers import moe as moe_layer
from dsv4.ops import attention, indexer, kv, mhc, norm, rope
from dsv4.ops.linear import Linear, linear
from dsv4.ops.moe import experts_forward
from dsv4.ops import compressor as compressor_ops
from dsv4.ops.triton import attention as t_attention
from dsv4.ops.triton import compressor as t_compressor
from dsv4.ops.triton import engram as t_engram
from dsv4.ops.triton import fp8_gemm
from dsv4.ops.triton import indexer as t_indexer
from dsv4.ops.triton import kv as t_kv
from dsv4.ops.triton import mhc as t_mhc
from dsv4.ops.triton import router as t_router
from dsv4.ops.triton import rowwise as t_rowwise
from dsv4.ops import moe as moe_ops

# Largest accepted error (relative to the reference's largest magnitude), 0 = bit-exact.
TOLERANCE = {
    "sparse_attention": 2e-2,  # bf16 probabilities rounded before vs after normalising
    # --fp8-activations: the output quantised in the epilogue for wo_a (`fp8_output`), compared
    # as values; the bf16 difference above can move one across an e4m3 rounding boundary (a
    # step is at most 1/8 of its block's largest magnitude)
    "sparse_attention_fp8": 0.13,
    "index_scores": 1e-5, "block_max": 0.0, "topk_ascending": 0.0,
    "rms_norm": 1e-2, "apply_rope_": 0.0, "pool_entries": 0.0,
    # the same libdevice cosf / sinf on the GPU; the interpreter's numpy cos / sin can round an
    # angle the other way (one bf16 unit)
    "rope_tables": 0.0 if torch.cuda.is_available() else 8e-3,
    "hc_mixes": 1e-5, "hc_collapse_norm": 1e-2, "hc_expand": 1e-2, "hc_expand_collapse_norm": 1e-2,
    "store_rows": 0.0, "store_plain": 0.0, "round_trip": 0.0, "rope_queries_": 0.0,
    # rms_norm's sum order (above) can move a kv value across an FP8 rounding boundary: one e4m3
    # step, at most 1/8 of the largest magnitude (a value in [256, 448) of its scaled block)
    "latent_inputs": 0.13,
    "hash_ids": 0.0, "lookup": 0.0, "gate": 1e-2,
    # compact FP8 weights only run on the GPU (CPU runs load dequantised weights)
    "fp8_linear_w8a16": 1e-2, "moe_experts": 2e-2, "moe_experts_dense": 2e-2,
    "fp8_act_fake_quant": 0.0, "fp8_act_quant": 0.0,  # --fp8-activations only (codes and exponents bit for bit)
    # the same experts (else inf); weights bit for bit on the GPU (libdevice is CUDA's libm; fp32
    # sums of 6 bf16 scores of like size are exact in any order), one bf16 unit on the CPU
    "route_logits": 0.0 if torch.cuda.is_available() else 8e-3,
    "route_scores": 1e-5,  # the same experts (else inf); weights to fp32 rounding of the logits (summed in another order than cuBLAS's)
    "compress_entries": 1e-2,  # the norm's sum of squares in another order (as rms_norm); cache bytes: their share
    "overlap_state": 0.0,  # V4's overlap state: gathered values, bit for bit
    "linear_fp32": 1e-5,  # the compressor's fp32 projections: fp32 sums in another order
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if a.shape != b.shape:
        return float("inf")
    finite = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), finite) or not torch.equal(a[~finite], b[~finite]):
        return float("inf")
    if not finite.any():
        return 0.0
    return ((a - b).abs()[finite].max() / b.abs()[finite].max().clamp_min(1e-30)).item()


def _reference(fn, *args, **kwargs):
    with dsv4.ops.torch_only():
        return fn(*args, **kwargs)


def _valid_cols(t: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    cols = torch.arange(t.shape[1], device=t.device)
    return cols.unsqueeze(0) < lengths.clamp(max=t.shape[1]).unsqueeze(1).long()


class Checker:
    def __init__(self):
        self.errors: dict[str, list[float]] = collections.defaultdict(list)

    def wrap(self, module, name: str, reference, compare=None, key=None) -> None:
        """`compare(out, ref, *args)` -> error; default: `_rel(out, ref)`. `key(out)` -> the
        tolerance entry the error counts under (an output form with its own; default: name)."""
        kernel = getattr(module, name)
        compare = compare or (lambda out, ref, *args, **kwargs: _rel(out, ref))

        def checked(*args, **kwargs):
            out = kernel(*args, **kwargs)
            self.errors[key(out) if key else name].append(compare(out, _reference(reference, *args, **kwargs), *args, **kwargs))
            return out

        setattr(module, name, checked)

    def wrap_inplace(self, module, name: str, reference) -> None:
        """An op that changes its first argument in place: the torch code runs on a copy of it
        taken before the kernel."""
        kernel = getattr(module, name)

        def checked(x, *args, **kwargs):
            before = x.clone()
            out = kernel(x, *args, **kwargs)
            self.errors[name].append(_rel(out, _reference(reference, before, *args, **kwargs)))
            return out

        setattr(module, name, checked)

    def wrap_rope_queries(self) -> None:
        """`rope_queries_` rotates q and the indexer's queries in place: the torch code runs on
        copies of both taken before the kernel."""
        kernel = t_rowwise.rope_queries_

        def checked(q, cos, sin, idx_q=None, idx_cos=None, idx_sin=None, fp4=False):
            ref_q, ref_idx = q.clone(), None if idx_q is None else idx_q.clone()
            kernel(q, cos, sin, idx_q, idx_cos, idx_sin, fp4)
            keys = QTensor(codes=q.new_zeros(0)) if fp4 else QTensor(values=q.new_zeros(0))
            _reference(attention.rope_queries_, ref_q, cos, sin, ref_idx, idx_cos, idx_sin, keys)
            pairs = [(q, ref_q)] + ([] if idx_q is None else [(idx_q, ref_idx)])
            self.errors["rope_queries_"].append(max(_rel(out, ref) for out, ref in pairs))

        t_rowwise.rope_queries_ = checked

    def wrap_store(self, name: str, reference) -> None:
        """Stores write in place: run the kernel and the torch code on copies of the target."""
        kernel = getattr(t_kv, name)

        def checked(target, *args):
            tensors = [target.codes, target.scales] if isinstance(target, QTensor) and target.quantized else \
                      [target.values] if isinstance(target, QTensor) else [target]
            before = [t.clone() for t in tensors]
            kernel(target, *args)
            after = [t.clone() for t in tensors]
            for t, b in zip(tensors, before):
                t.copy_(b)
            _reference(reference, target, *args)
            exact = all(torch.equal(a.view(torch.uint8), t.view(torch.uint8)) for a, t in zip(after, tensors))
            self.errors[name].append(0.0 if exact else float("inf"))
            for t, a in zip(tensors, after):  # keep the kernel's result
                t.copy_(a)

        setattr(t_kv, name, checked)


    def wrap_compressor(self) -> None:
        """`compress_entries` returns entries and writes the compressed cache: the torch code
        runs on a copy of the cache taken before the kernel; the error is the entries' (a
        differing emit flag or location is inf; V4's rows that complete no group are zeros on
        both) or, if larger, the share of cache bytes that differ. V4's overlap state update
        (`overlap_state`, the op's second launch) is checked as a store: the same bytes."""
        kernel = t_compressor.compress_entries

        def checked(*args, **kwargs):
            target = next(a for a in args if isinstance(a, QTensor))
            written = [target.codes, target.scales] if target.quantized else [target.values]
            before = [t.clone() for t in written]
            out = kernel(*args, **kwargs)
            after = [t.clone() for t in written]
            for t, b in zip(written, before):
                t.copy_(b)
            ref = _reference(compressor_ops._compress_entries_reference, *args, kwargs.get("v4"))
            emit = ref[2]
            same = torch.equal(out[2], emit) and torch.equal(out[1][1], ref[1][1]) and torch.equal(out[1][0][emit], ref[1][0][emit])
            differing = sum(int((a.view(torch.uint8) != b.view(torch.uint8)).sum()) for a, b in zip(after, written))
            stored = max(1, int(emit.sum()) * sum(t.shape[-1] * t.element_size() for t in written))
            self.errors["compress_entries"].append(max(_rel(out[0], ref[0]), differing / stored) if same else float("inf"))
            for t, a in zip(written, after):  # keep the kernel's result
                t.copy_(a)
            return out

        t_compressor.compress_entries = checked
        state_kernel = t_compressor.overlap_state

        def checked_state(v4, *args):
            before = (v4.prev_kv.clone(), v4.prev_gate.clone())
            state_kernel(v4, *args)
            after = (v4.prev_kv.clone(), v4.prev_gate.clone())
            v4.prev_kv.copy_(before[0])
            v4.prev_gate.copy_(before[1])
            _reference(compressor_ops.update_overlap_state, v4, *args)
            exact = torch.equal(after[0], v4.prev_kv) and torch.equal(after[1], v4.prev_gate)
            self.errors["overlap_state"].append(0.0 if exact else float("inf"))
            v4.prev_kv.copy_(after[0])
            v4.prev_gate.copy_(after[1])

        t_compressor.overlap_state = checked_state


def install(checker: Checker) -> None:
    c = checker
    def attention_error(out, ref, *args, **kwargs):
        if not isinstance(out, tuple):
            return _rel(out, ref)
        # FP8 codes and exponent bytes (`fp8_output`): compared as the values they stand for
        values = [quant.dequantize_fp8_ue8m0(codes.reshape(codes.shape[0], -1), exps, torch.float32) for codes, exps in (out, ref)]
        return _rel(*values) if out[0].shape == ref[0].shape else float("inf")

    c.wrap(t_attention, "sparse_attention", attention.sparse_attention, compare=attention_error,
           key=lambda out: "sparse_attention_fp8" if isinstance(out, tuple) else "sparse_attention")

    def scores(out, ref, *args, **kwargs):
        ok = _valid_cols(out, args[6])
        return _rel(torch.where(ok, out, 0), torch.where(ok, ref, 0))

    def blocks(out, ref, scores_in, lengths, block):
        ok = _valid_cols(out, (lengths + block - 1) // block)
        return _rel(torch.where(ok, out, 0).nan_to_num(posinf=0), torch.where(ok, ref, 0).nan_to_num(posinf=0))

    c.wrap(t_indexer, "index_scores", indexer.index_scores, scores)
    c.wrap(t_indexer, "block_max", indexer.block_max, blocks)
    same = lambda o, r, *a, **kw: 0.0 if torch.equal(o.long(), r.long()) else float("inf")
    c.wrap(t_indexer, "topk_ascending", indexer.topk_ascending, same)
    c.wrap(t_indexer, "pool_entries", indexer.pool_entries, same)
    c.wrap(t_rowwise, "rms_norm", lambda x, w, eps, fp32: norm.rms_norm(x, w, eps, fp32) if w is not None else norm.head_norm(x, eps))
    c.wrap(t_rowwise, "rope_tables", rope.cos_sin, lambda o, r, *a: max(_rel(x, y) for x, y in zip(o, r)))
    c.wrap_inplace(t_rowwise, "apply_rope_", rope.apply_rope_)
    c.wrap(t_rowwise, "latent_inputs", lambda qkv, q_width, q_norm, kv_norm, eps, fp32, cos, sin, fp8: attention.latent_inputs(
        qkv, q_width, q_norm, kv_norm, eps, fp32, cos, sin, QTensor(codes=qkv.new_zeros(0)) if fp8 else QTensor(values=qkv.new_zeros(0))),
        lambda o, r, *a: max(_rel(x, y) for x, y in zip(o, r)))
    c.wrap_rope_queries()
    c.wrap(t_mhc, "hc_mixes", mhc.hc_mixes, lambda o, r, *a: max(_rel(x, y) for x, y in zip(o, r)))
    c.wrap(t_mhc, "hc_collapse_norm", mhc.hc_collapse_norm)
    c.wrap(t_mhc, "hc_expand", lambda y, res, post, comb, fp32: mhc.hc_expand(y, res, post, comb, fp32))
    c.wrap(t_mhc, "hc_expand_collapse_norm", mhc.hc_expand_collapse_norm, lambda o, r, *a: max(_rel(x, y) for x, y in zip(o, r)))
    c.wrap(t_kv, "round_trip", lambda kind, x: kv.round_trip(QTensor(codes=x), x, kind))
    c.wrap_store("store_rows", kv.store_rows)
    c.wrap_store("store_plain", kv.store_plain)
    c.wrap_compressor()
    c.wrap(t_engram, "hash_ids", lambda ids, req, local, pos, prev, tmap, mult, primes, offsets, pad: _hash_reference(ids, req, local, pos, prev, tmap, mult, primes, offsets, pad))
    c.wrap(t_engram, "lookup", lambda table, scale, ids, dtype: _lookup_reference(table, scale, ids, dtype))
    c.wrap(t_engram, "gate", lambda streams, kv_rows, weight, eps: _gate_reference(streams, kv_rows, weight, eps))
    c.wrap(fp8_gemm, "fp8_linear_w8a16", _w8a16_reference)
    c.wrap(triton_ops, "fp8_linear_w8a16", _w8a16_reference)
    c.wrap(fp8_gemm, "fp8_act_fake_quant", lambda x, block: quant.fake_quant_act(x, block))
    same_codes = lambda o, r, *a: 0.0 if torch.equal(o[0].view(torch.uint8), r[0].view(torch.uint8)) and torch.equal(o[1], r[1]) else float("inf")
    c.wrap(fp8_gemm, "fp8_act_quant", _act_quant_reference, same_codes)
    c.wrap(triton_ops, "moe_experts", _moe_reference, _moe_error)
    c.wrap(triton_ops, "moe_experts_dense", _moe_reference, _moe_error)
    c.wrap(attention_layer, "linear_fp32", lambda x, w: linear(x.float(), w))
    c.wrap(t_router, "route_scores", moe_ops.route_scores,
           lambda o, r, *a: _rel(o[0], r[0]) if torch.equal(o[1].cpu(), r[1].cpu()) else float("inf"))
    c.wrap(t_router, "route_logits", moe_ops.route_logits,
           lambda o, r, *a, **kw: _rel(o[0], r[0]) if torch.equal(o[1].cpu(), r[1].cpu()) else float("inf"))


def _moe_error(out, ref, *args, fp8_act=False, **kwargs):
    """`_rel`, or with FP8 activations the error's norm relative to the reference's: the
    kernel and the reference round gate / up in other orders, so now and then an activation
    sits on the other side of an FP8 rounding boundary, and that one code (an FP8 step, 1/16 of
    the value, 32 times a bf16 one) moves the outputs more than the largest-element measure
    allows at the tiny model's few channels; a wrong scale or piece moves the norm as much."""
    if not fp8_act:
        return _rel(out, ref)
    if out.shape != ref.shape or not torch.isfinite(out).all():
        return float("inf")
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _act_quant_reference(x, block):
    """`quant.quantize_fp8_ue8m0` with a partial last block quantised over its columns."""
    k = x.shape[-1]
    codes, exps = quant.quantize_fp8_ue8m0(torch.nn.functional.pad(x, (0, -k % block)), block)
    return codes[..., :k], exps


def _w8a16_reference(x, w, s, block, groups=1, x_scale=None):
    """bf16 GEMMs on the exactly dequantised weight, group by group (FP8 inputs, x_scale:
    their exact bf16 values first)."""
    if x_scale is not None:
        pad = -x.shape[-1] % quant.ACT_BLOCK
        codes = torch.nn.functional.pad(x.view(torch.uint8), (0, pad)).view(torch.float8_e4m3fn)
        x = quant.dequantize_fp8_ue8m0(codes, x_scale, torch.bfloat16, quant.ACT_BLOCK)[..., : x.shape[-1]]
    dense = quant.dequant_fp8_block(w, s, block).to(x.dtype)
    n, k = dense.shape[0] // groups, dense.shape[1]
    return torch.cat([linear(x[..., g * k : (g + 1) * k], dense[g * n : (g + 1) * n]) for g in range(groups)], dim=-1)


def _moe_reference(x, ids, weights, w13, s13, w2, s2, limit, weight_before_down, out_dtype=torch.float32, fp8_act=False, shared=None,
                   shared_after_rounding=False):
    """The per-expert torch loop on the same experts (FP8 or compact FP4), dequantised
    (dsv4.ops.moe), a separate shared expert last; with fp8_act its Linears quantise their
    inputs. (`shared_after_rounding`: V4's loop adds every expert in bf16, the shared one,
    the highest id, last.)"""
    rows = lambda w, s: [Linear(w[e], s[e], 0, row_scales=True, quant_input=fp8_act) for e in range(w.shape[0])]
    w1, wd, w3 = [], [], []
    for w13, s13, w2, s2 in [(w13, s13, w2, s2)] + ([shared] if shared is not None else []):
        inter = w13.shape[1] // 2
        w1 += rows(w13[:, :inter], s13[:, :inter])
        wd += rows(w2, s2)
        w3 += rows(w13[:, inter:], s13[:, inter:])
    return experts_forward(x, weights, ids, w1, wd, w3, limit, weight_before_down).float().to(out_dtype)


# The engram references are methods of the layer objects; these call them on a stand-in.
def _hash_reference(ids, req, local, pos, prev, tmap, mult, primes, offsets, pad):
    from dsv4.model.layers.engram import EngramHasher

    h = EngramHasher.__new__(EngramHasher)
    h.n, h.token_map, h.mult, h.primes, h.offsets, h.pad = mult.shape[1], tmap, mult, primes, offsets, pad
    return h.reference(ids, req, local, pos, prev)


def _lookup_reference(table, scale, ids, dtype):
    from dsv4.model.layers.engram import Engram

    e = Engram.__new__(Engram)
    e.table, e.table_scale = table, scale
    return e.lookup_reference(ids, dtype)


def _gate_reference(streams, kv_rows, weight, eps):
    from types import SimpleNamespace

    from dsv4.model.layers.engram import Engram

    e = Engram.__new__(Engram)
    e.gate_weight = weight
    e.cfg = SimpleNamespace(hidden_size=streams.shape[2], hc_mult=streams.shape[1], rms_norm_eps=eps)
    return e.gate_reference(streams, kv_rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="a golden set (V4.1), e.g. ../shared/golden/v41-tiny-a")
    parser.add_argument("--prompts", default="1,3", help="golden prompt indices")
    parser.add_argument("--steps", type=int, default=2, help="greedy decode steps after the prompts")
    parser.add_argument("--fp8-activations", action="store_true", help="run the model with FP8 activations")
    parser.add_argument("--fp4-experts", action="store_true", help="keep the routed experts FP4 (the MoE kernels' FP4 variant)")
    args = parser.parse_args()
    ref = load_file(Path(args.folder) / "golden.safetensors")
    prompts = [ref[f"prompt{int(i)}.input_ids"].tolist() for i in args.prompts.split(",")]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    checker = Checker()
    install(checker)
    # the tiny experts see a few pairs each: lower the prefill path's threshold so that the
    # prompts take it (the decode steps still take the grouped kernels)
    moe_layer.DENSE_EXPERT_PAIRS = 8
    llm = LLM(args.folder, device=device, dtype="bfloat16", fast_path=True, block_size=16, kv_cache_memory=64 << 20,
              max_num_seqs=4, max_model_len=256, swa_bounded_replay=False, enforce_eager=True, fp8_activations=args.fp8_activations,
              fp4_experts=args.fp4_experts)
    llm.prompt_logits(prompts)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.steps, ignore_eos=True), use_tqdm=False)
    failed = False
    for name in sorted(TOLERANCE):
        errs = checker.errors.get(name)
        if not errs:
            print(f"{name:18s} not called")
            continue
        worst = max(errs)
        bad = worst > TOLERANCE[name]
        failed |= bad
        print(f"{name:18s} calls {len(errs):4d}  max error {worst:.3e}  (tolerance {TOLERANCE[name]:.0e}){'  FAIL' if bad else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
