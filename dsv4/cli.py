"""Command line: `dsv4 serve | generate | bench serve|plot|forward | make-tiny`."""

from __future__ import annotations

import argparse
import sys


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """Engine options with vLLM's flag names; the same names as `LLM(...)` keyword arguments."""
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache (blocks + state slots)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--swa-bounded-replay", action=argparse.BooleanOptionalAction, default=True,
                   help="rebuild window state by replaying only the last `window` tokens (approximate, the authors' method); "
                        "--no-swa-bounded-replay recomputes the exact cone (bit-identical to a cold run)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-prefix-loads-per-step", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (decode buckets and piecewise prefill; on by default on the fast path)")
    p.add_argument("--fast-path", action=argparse.BooleanOptionalAction, default=None,
                   help="device-metadata path with the Triton kernels (default: wherever it can run: CUDA, bfloat16, V4.1); "
                        "--no-fast-path runs the reference ops")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="build and launch each step before the previous step's sampled tokens reach the host, so the host's "
                        "work overlaps the GPU's (default: on where steps replay CUDA graphs)")
    p.add_argument("--fp8-activations", action=argparse.BooleanOptionalAction, default=False,
                   help="quantise the inputs of the FP8/FP4 GEMMs to FP8 per 32 columns, as DeepSeek's reference does "
                        "(V4.1; FP8 x FP8 expert GEMMs on the fast path); default off: HF's numerics (the golden data)")
    p.add_argument("--fp4-experts", action=argparse.BooleanOptionalAction, default=False,
                   help="keep the routed experts FP4 on the GPU as released (half their memory, the same results; "
                        "faster expert kernels, but the shared expert's own launches slow batch 1); default: converted exactly to FP8 at load")


ENGINE_KEYS = ("device", "dtype", "block_size", "kv_cache_memory", "gpu_memory_utilization", "enable_prefix_caching",
               "swa_bounded_replay", "max_num_seqs", "max_num_batched_tokens", "scheduling_policy", "max_model_len",
               "max_prefix_loads_per_step", "seed", "enforce_eager", "fast_path", "async_scheduling", "fp8_activations",
               "fp4_experts")


def engine_options(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in ENGINE_KEYS}


def _make_tiny(args: argparse.Namespace) -> int:
    from dsv4.model.make_tiny import write_tiny_checkpoint

    path = write_tiny_checkpoint(args.out, args.arch, seed=args.seed)
    print(f"wrote a tiny random {args.arch} checkpoint to {path}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from dsv4.engine.sampling_params import SamplingParams
    from dsv4.llm import LLM

    llm = LLM(args.model, **engine_options(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens, seed=args.sample_seed)
    for out in llm.generate(list(args.prompts), params):
        print(f"--- {out.prompt!r}")
        print(out.text)
        print(f"[{len(out.token_ids)} tokens, finish_reason={out.outputs[0].finish_reason}]")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    """Print the layer roles and the cache accounting of a model folder or a released config."""
    import torch
    from rich.console import Console
    from rich.table import Table

    from dsv4.cache.manager import CacheSizes
    from dsv4.cache.reference_configs import released_v4_config, released_v41_config
    from dsv4.config import load_config, parse_config

    builtin = {"v41": released_v41_config, "v4": released_v4_config}
    cfg = parse_config(builtin[args.model]()) if args.model in builtin else load_config(args.model)
    console = Console(width=max(Console().width, 120))
    roles = Table(title=f"{cfg.arch}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, window {cfg.window}")
    for col in ("layer", "kind", "ratio", "rope", "KV from", "top-k from", "extras"):
        roles.add_column(col)
    for r in cfg.roles:
        extras = [x for x, on in (("candidate source", r.is_candidate_source), ("uses candidates", r.uses_candidates), ("engram", r.engram), ("hash MoE", r.hash_moe), ("CED split", r.index == cfg.ced_split)) if on]
        roles.add_row(str(r.index), r.kind, str(r.compress_ratio), r.rope, str(r.kv_source if r.kv_source is not None else "-"), str(r.index_source if r.index_source is not None else "-"), ", ".join(extras))
    console.print(roles)
    sizes = CacheSizes.for_config(cfg, args.block_size, getattr(torch, args.dtype))
    acct = Table(title=f"cache accounting (block {args.block_size} tokens, compute dtype {args.dtype})")
    acct.add_column("kind")
    acct.add_column("bytes")
    for kind, value in sizes.bytes_per_token.items():
        acct.add_row(f"global KV per token: {kind}", f"{value:,.1f}")
    for kind, value in sizes.slot_bytes.items():
        acct.add_row(f"per request slot: {kind}", f"{value:,}")
    acct.add_row("per block (all KV-source layers)", f"{sizes.block_bytes:,}")
    console.print(acct)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv4", description="DeepSeek-V4.1-Flash / V4-Flash inference and serving")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny", help="write a random tiny checkpoint in the released format")
    p.add_argument("--arch", choices=["v41", "v4"], required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_make_tiny)

    p = sub.add_parser("inspect", help="layer roles and cache accounting of a model folder or a released config")
    p.add_argument("model", help="a model folder, or 'v41' / 'v4' for the released configs")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.set_defaults(func=_inspect)

    p = sub.add_parser("generate", help="generate completions offline")
    p.add_argument("--model", required=True)
    p.add_argument("prompts", nargs="+")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sample-seed", type=int, default=None)
    add_engine_flags(p)
    p.set_defaults(func=_generate)

    try:
        from dsv4.server.cli import register as register_serve
    except ImportError:  # the server needs its optional pieces; the rest of the CLI works without
        register_serve = None
    if register_serve is not None:
        register_serve(sub)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from dsv4.bench.cli import register as register_bench_serve

    register_bench_serve(bench_sub)
    try:
        from dsv4.bench.forward import register_forward
    except ImportError:
        register_forward = None
    if register_forward is not None:
        register_forward(bench_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:  # ConfigError, CheckpointError, bad options: the message names the field
        print(f"dsv4: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
