"""`dsv4 bench forward`: time exact batches of the model, the way `vllm bench forward` does.

Each case (grammar in `dsv4.bench.roofline`) becomes one ForwardBatch on random weights
(`dsv4.model.random_weights`) and a KV cache pre-filled with random valid codes, so a decode
at 1M tokens of context costs no prefill. A step is `Model.forward` plus the LM head over the
logits rows. Per case it prints the median step time of `--iters` runs after `--warmup`,
tokens/s (new tokens only), the roofline floor and time/floor, and where the time goes:
the model's sections (dsv4.model.sections: attention without the nested indexer, indexer,
compressor, moe, mhc, engram, head), timed by CUDA events on the GPU (inside the captured
graph for graph-replayed cases, in an eager step otherwise) or by the wall clock on CPU;
"other" is the rest of the step (embedding, final norm, the host's metadata preparation and
launch gaps outside the sections).

The fast path runs the weights the way the engine loads them on the device (compact FP8 on
CUDA, dequantised on CPU) and the model's fast path (device metadata, Triton kernels; on CPU
only with `--fast-path`, which runs its torch references). Cases on CUDA are also timed as
CUDA-graph replays, which is then the step time (`--no-cuda-graphs`: eager only), as the
engine would run them: decode-shaped ones as one graph of their batch size
(dsv4.engine.cuda_graphs.DecodeGraphs), the others (prefill, hits, mixed) as the two pieces
of `PiecewiseGraphs` padded to its default row and request buckets. The step time of a
graph case is that of `--iters` steps issued back to back, each preparing its metadata on the
host (and resolving the pending-token placeholders, `engine.runner.PendingTokens`) while
the previous one runs — how the engine runs under async scheduling; the synchronous step
(the host's preparation, then the replay, nothing overlapped: the engine without async
scheduling) and the eager step are printed beside it. With `--baseline` (default on CUDA) the same
cases also run on the reference path: the same model with dequantised dense weights, dense
`dtype` GEMMs and every op on its torch code (`dsv4.ops.torch_only`: the HF-style
computation), reported as a ratio; it is skipped, saying so, when its weights do not fit in
free device memory.

Configs: a path (folder with config.json, or the file), or a built-in: `v41` / `v4` (the
released V4.1-Flash / V4-Flash configs) and `tiny-v41` / `tiny-v4` (the golden sets' shapes,
for CPU and CI). Shrinking the real ones to fit one GPU:

* `--num-layers N` keeps N layers of the schedule, chosen so every kind of layer stays when N
  allows: first the V4.1 CED split layer (the last KV source), the first KV source of each
  compress ratio, the first reindex, engram, window-only, hash-routed, CSA and HCA layers,
  then the first reuse layer of each KV source kept so far, then the rest by kind (role and
  compress ratio): each kind gets a share of the remaining layers in proportion to its count
  among them, spread evenly over its layers. Kept layers keep their ratio; source lists, the candidate source, engram layers,
  `num_hash_layers` follow the kept layers (a reuse layer whose source was dropped reads the
  previous kept source of its ratio).
* `--num-experts E` shrinks the routed experts (top-k clamped to E).
* `--engram-rows R` caps each engram table at about R rows (default 1M; the released tables
  are 384M rows, 92 GiB each) by lowering `engram_vocab_size`, the prime search start. A
  lookup is a gather of 24 random rows per token, so its cost does not depend on the table
  size once the table is far larger than the L2 cache.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import statistics
import time
import traceback
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dsv4.bench.roofline import (
    BF16_FLOPS_PER_S,
    COMPONENTS,
    FP8_FLOPS_PER_S,
    HBM_BYTES_PER_S,
    Case,
    CaseError,
    RequestPlan,
    case_floor,
    parse_cases,
    plan_case,
)
from dsv4.cache.reference_configs import released_v4_config, released_v41_config
from dsv4.cache.storage import KVCacheStorage, QTensor
from dsv4.config import ConfigError, ModelConfig, parse_config
from dsv4.engine.cuda_graphs import DecodeGraphs, PiecewiseGraphs
from dsv4.engine.runner import PendingTokens
from dsv4.model.batch import ForwardBatch
from dsv4.model.layers.engram import engram_primes
from dsv4.model.make_tiny import tiny_config
from dsv4.model import sections
from dsv4.model.model import Model
from dsv4.model.random_weights import dense_weight_bytes, fp8_normal_, random_weights
from dsv4.ops import torch_only

BUILTIN_CONFIGS = {
    "v41": released_v41_config,
    "v4": released_v4_config,
    "tiny-v41": partial(tiny_config, "v41"),
    "tiny-v4": partial(tiny_config, "v4"),
}
DEFAULT_ENGRAM_ROWS = 1 << 20
# Free device memory the reference path may use: the rest is for the cache and activations.
REFERENCE_MEMORY_FRACTION = 0.8
# Codes of random cache entries: window FP8 codes ~N(0, 64^2) with exponent bytes 119..121
# (values of unit size, like the normalised latents); compressed-KV E4M3 scales 2^-4 .. 0.94
# (bit patterns 0x18..0x37); indexer ue8m0 exponent bytes 2^-8 .. 2^-1. Every FP4 byte is a
# valid pair of e2m1 codes.
WINDOW_CODE_STD = 64.0
WINDOW_EXP = (119, 122)
CKV_SCALE_BITS = (0x18, 0x38)
IDX_EXP = (119, 127)


class BenchError(ValueError):
    """A bad option or case; the message says which."""


# ------------------------------------------------------------------------------- configs


def _keep_layers(cfg: ModelConfig, n: int) -> list[int]:
    """Original indices of the layers `--num-layers n` keeps (rule in the module docstring)."""
    roles = cfg.roles
    if n >= len(roles):
        return list(range(len(roles)))

    def first(pred) -> int | None:
        return next((r.index for r in roles if pred(r)), None)

    want = [cfg.ced_split]
    want += [first(lambda r, q=q: r.owns_compressor and r.compress_ratio == q) for q in cfg.compress_ratio_set]
    kinds = (
        lambda r: r.kind == "reindex", lambda r: r.engram, lambda r: r.kind == "window",
        lambda r: r.hash_moe, lambda r: r.kind == "csa", lambda r: r.kind == "hca",
    )
    want += [first(pred) for pred in kinds]
    kept_sources = [i for i in want if i is not None and roles[i].owns_compressor]
    want += [first(lambda r, s=s: r.kind == "reuse" and r.kv_source == s) for s in kept_sources]
    keep: list[int] = []
    for i in want:
        if i is not None and i not in keep and len(keep) < n:
            keep.append(i)
    # The rest by kind, each kind's share of the remaining m in proportion to its layers there
    # (largest remainders; ties to the kind that comes first), spread evenly over its layers.
    # A plain even spread over the rest aliases with an alternating schedule: V4's CSA / HCA
    # pairs gave 1 CSA and 6 HCA layers at N = 8.
    m = n - len(keep)
    groups: dict[tuple[str, int], list[int]] = {}
    for i in range(len(roles)):
        if i not in keep:
            groups.setdefault((roles[i].kind, roles[i].compress_ratio), []).append(i)
    rest = sum(len(g) for g in groups.values())
    share = {k: m * len(g) / rest for k, g in groups.items()}
    count = {k: int(s) for k, s in share.items()}
    for k in sorted(groups, key=lambda k: (count[k] - share[k], groups[k][0]))[: m - sum(count.values())]:
        count[k] += 1
    for k, g in groups.items():
        keep += [g[int((j + 0.5) * len(g) / count[k])] for j in range(count[k])]
    return sorted(keep)


def _renumber(text: dict, cfg: ModelConfig, keep: list[int]) -> None:
    """Rewrite the schedule fields of `text` (the config dict holding the text fields) so the
    model has only the `keep` layers, renumbered in order."""
    new = {old: j for j, old in enumerate(keep)}
    tail = list(text["compress_ratios"][cfg.num_layers :])
    text["num_hidden_layers"] = len(keep)
    text["compress_ratios"] = [cfg.compress_ratios[i] for i in keep] + tail
    if cfg.arch == "v41":
        roles = cfg.roles
        text["kv_source_layer_ids"] = [new[i] for i in cfg.kv_source_layers if i in new]
        text["index_source_layer_ids"] = [new[r.index] for r in roles if r.runs_indexer and r.index in new]
        candidate = next((r.index for r in roles if r.is_candidate_source), None)
        text["candidate_source_layer_id"] = new.get(candidate, -1)
        text["engram_layer_ids"] = [new[i] for i in cfg.engram_layer_ids if i in new]
        text.pop("dspark_target_layer_ids", None)  # default: the last non-source layers
    else:
        text["num_hash_layers"] = sum(1 for i in keep if cfg.roles[i].hash_moe)
        for key in ("layer_types", "compress_rates"):  # HF-only fields, stale after the cut
            text.pop(key, None)


def bench_config(source: str, *, num_layers: int | None = None, num_experts: int | None = None, engram_rows: int | None = None) -> ModelConfig:
    """The config to benchmark: a built-in name or a path, shrunk as asked."""
    if source in BUILTIN_CONFIGS:
        raw = BUILTIN_CONFIGS[source]()
    else:
        path = Path(source)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise BenchError(f"--config: {source!r} is neither a built-in ({', '.join(BUILTIN_CONFIGS)}) nor a config.json path")
        raw = json.loads(path.read_text())
    raw = copy.deepcopy(raw)
    cfg = parse_config(raw)
    text = raw.get("text_config", raw)  # V4.1 composite: the text fields live there
    engram_changed = False
    if num_layers is not None:
        if num_layers < 1:
            raise BenchError(f"--num-layers must be >= 1, got {num_layers}")
        if num_layers < cfg.num_layers:
            _renumber(text, cfg, _keep_layers(cfg, num_layers))
            engram_changed = True
    if num_experts is not None:
        if num_experts < 1:
            raise BenchError(f"--num-experts must be >= 1, got {num_experts}")
        text["n_routed_experts"] = num_experts
        text["num_experts_per_tok"] = min(cfg.num_experts_per_tok, num_experts)
    if engram_rows is not None and cfg.engram_layer_ids and max(cfg.engram_num_embeddings) > engram_rows:
        columns = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        text["engram_vocab_size"] = max(engram_rows // columns, 2)
        engram_changed = True
    try:
        if engram_changed and cfg.arch == "v41":  # table sizes follow the prime layout
            text["engram_num_embeddings"] = [0] * len(text["engram_layer_ids"])
            primes = engram_primes(parse_config(raw))
            text["engram_num_embeddings"] = [sum(sum(p) for p in layer) for layer in primes]
        return parse_config(raw)
    except ConfigError as exc:
        raise BenchError(f"the shrunk config is inconsistent ({exc}); try another --num-layers") from None


# ------------------------------------------------------------------------------- one step


def _fill_random(q: QTensor, gen: torch.Generator, kind: str) -> None:
    """Random valid contents for one cache tensor (see the constants above)."""
    if not q.quantized:
        q.values.normal_(generator=gen)
        return
    if q.codes.dtype == torch.float8_e4m3fn:  # window ring
        fp8_normal_(q.codes, WINDOW_CODE_STD, gen)
        q.scales.random_(*WINDOW_EXP, generator=gen)
        return
    q.codes.random_(0, 256, generator=gen)
    if kind == "ckv":
        q.scales.view(torch.uint8).random_(*CKV_SCALE_BITS, generator=gen)
    else:
        q.scales.random_(*IDX_EXP, generator=gen)


def build_case(cfg: ModelConfig, plans: list[RequestPlan], *, block_size: int, dtype: torch.dtype, device: torch.device, seed: int, batch_device: torch.device | None = None) -> tuple[KVCacheStorage, ForwardBatch]:
    """A cache with every entry filled at random (contiguous blocks per request, one state
    slot each) and the batch of one step of `plans`, on `batch_device` (default: the cache's;
    the fast path takes host tensors, which it uploads itself)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks = [-(-p.kv_len // block_size) for p in plans]
    cache = KVCacheStorage(cfg, num_slots=len(plans), num_blocks=sum(blocks), block_size=block_size, dtype=dtype, device=device)
    for kind, tensors in (("window", cache.ring), ("ckv", cache.ckv), ("idx", cache.idx)):
        for q in tensors.values():
            _fill_random(q, gen, kind)
    for states in (cache.tail_kv, cache.tail_gate, cache.prev_kv, cache.prev_gate):
        for t in states.values():
            t.normal_(generator=gen)

    table = torch.full((len(plans), max(blocks)), -1, dtype=torch.long)
    first = 0
    for b, n in enumerate(blocks):
        table[b, :n] = torch.arange(first, first + n)
        first += n
    look_back = max(cfg.engram_max_ngram_size - 1, 1)
    prev = torch.randint(0, cfg.vocab_size, (len(plans), look_back), generator=torch.Generator().manual_seed(seed))
    for b, p in enumerate(plans):
        prev[b, p.start :] = -1  # only positions start-1, start-2, ... >= 0 exist
    total = sum(p.rows for p in plans)
    ids = torch.randint(0, cfg.vocab_size, (total,), generator=gen, device=device)
    where = device if batch_device is None else batch_device
    positions = torch.cat([torch.arange(p.start, p.kv_len) for p in plans])
    offsets = [0]
    for p in plans:
        offsets.append(offsets[-1] + p.rows)
    logits_rows = torch.cat([torch.arange(o - p.logits_rows, o) for p, o in zip(plans, offsets[1:])])
    batch = ForwardBatch(
        input_ids=ids.to(where),
        positions=positions.to(where),
        start_pos=[p.start for p in plans],
        num_tokens=[p.rows for p in plans],
        slots=list(range(len(plans))),
        block_tables=table.to(where),
        prev_tokens=prev.to(where),
        window_floor=[p.window_floor for p in plans],
        decoder_window_floor=[p.decoder_window_floor for p in plans],
        emit_from=[p.emit_from for p in plans],
        decoder_tokens=[p.decoder_rows for p in plans] if cfg.ced_split is not None else None,
        logits_rows=logits_rows.to(where),
    )
    return cache, batch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(step, device: torch.device, warmup: int, iters: int, burst: int = 1) -> list[float]:
    """Milliseconds per call of `step`, for each of `iters` bursts of `burst` calls issued
    without waiting for each other, after `warmup` calls: CUDA events around each burst on
    the GPU, the wall clock (after a synchronise) elsewhere. burst 1: each call alone; more:
    the steady state of calls whose host work overlaps the previous call's GPU work."""
    for _ in range(warmup):
        step()
    _sync(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(burst):
                step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / burst)
        else:
            t0 = time.perf_counter()
            for _ in range(burst):
                step()
            times.append((time.perf_counter() - t0) * 1e3 / burst)
    return times


BACK_TO_BACK_BURSTS = 3  # bursts of --iters back-to-back graph steps


def breakdown(step, device: torch.device, total_ms: float, graph_step=None) -> dict[str, float]:
    """ms per component (dsv4.model.sections) and "other" (the step minus the sections). On
    CUDA the sections are timed by events on the GPU: inside a captured graph when
    `graph_step` is given (a callable that captures with the section events in the graph and
    replays once), else in one eager step (so a section's time includes the GPU's idle gaps
    while its kernels are launched). On CPU, by the wall clock of one step."""
    if graph_step is not None:
        with sections.timing(device, captured_only=True) as marks:
            graph_step()
    else:
        with sections.timing(device) as marks:
            step()
    _sync(device)
    parts = sections.exclusive_ms(marks)
    out = {c: parts.get(c, 0.0) for c in COMPONENTS}
    out["other"] = max(total_ms - sum(out.values()), 0.0)
    return out


# ------------------------------------------------------------------------------- the bench


@dataclass
class BenchOptions:
    config: str
    num_layers: int | None = None
    num_experts: int | None = None
    engram_rows: int | None = DEFAULT_ENGRAM_ROWS
    dtype: str = "bfloat16"
    device: str | None = None
    block_size: int = 256
    bounded_replay: bool = True
    warmup: int = 2
    iters: int = 5
    baseline: bool | None = None  # None: on for CUDA, off for CPU (both paths are dequantised there)
    breakdown: bool = True  # one step per case timed section by section (dsv4.model.sections)
    cuda_graphs: bool = True  # decode-shaped cases on the fast path: time CUDA-graph replays too
    fast_path: bool | None = None  # None: where it can run (CUDA, bf16, V4.1); True on CPU runs its torch references
    fp8_activations: bool = False  # both paths quantise their FP8/FP4 GEMM inputs (ModelConfig.fp8_activations)
    fp4_experts: bool = False  # the fast path keeps the experts FP4 (ModelConfig.fp4_experts)
    seed: int = 0


def _run_case(model: Model, cfg: ModelConfig, case: Case, plans: list[RequestPlan], opts: BenchOptions, device: torch.device, dtype: torch.dtype) -> dict:
    """Time one case (and its sections); its cache and batch are freed when this returns. A
    case on the fast path with CUDA graphs is timed as the engine runs it (padded to its
    bucket, metadata copied in, placeholders resolved, graph replayed): back to back (async
    scheduling, the step time) and one step at a time; and eagerly."""
    try:
        cache, batch = build_case(cfg, plans, block_size=opts.block_size, dtype=dtype, device=device, seed=opts.seed,
                                  batch_device=torch.device("cpu") if model.fast else device)

        def eager():
            with torch.inference_mode():
                return model.logits(model.forward(batch, cache))

        def graphs():
            """Decode-shaped: one graph of the batch's size; else the two pieces in their
            default buckets (the padding is in the time)."""
            blocks = batch.block_tables.shape[1]
            decode = DecodeGraphs(model, cache, max_blocks=blocks, sizes=(batch.num_requests,), rows=max(batch.num_tokens))
            return decode if decode.fits(batch) else PiecewiseGraphs(model, cache, max_blocks=blocks)

        def captured():
            runner = graphs()
            runner.capture() if isinstance(runner, DecodeGraphs) else runner.capture(batch)
            return runner

        def timed_graph():  # a second capture, with the section events in the graphs
            captured().run(batch)

        times = time_step(eager, device, opts.warmup, opts.iters)
        graph_times = sync_times = host_ms = graph_kind = None
        if opts.cuda_graphs and model.fast and device.type == "cuda" and graphs().fits(batch):
            runner = captured()
            pending = PendingTokens(cache.num_slots, device)  # the batch holds no placeholders: its work, not its effect
            replay = lambda: runner.run(batch, pending.resolve)
            sync_times = time_step(replay, device, opts.warmup, opts.iters)
            host_ms = runner.host_ms
            graph_times = time_step(replay, device, opts.warmup, BACK_TO_BACK_BURSTS, burst=opts.iters)
            graph_kind = "decode" if isinstance(runner, DecodeGraphs) else "piecewise"
            del runner
            _free(device)
        median = statistics.median(graph_times or times)
        parts = breakdown(eager, device, median, timed_graph if graph_times else None) if opts.breakdown else None
    except torch.OutOfMemoryError as exc:
        return {"error": f"out of memory: {str(exc).splitlines()[0]}"}
    except Exception as exc:  # noqa: BLE001 - one failing case is reported, the others still run
        traceback.print_exc()
        return {"error": f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    total = sum(parts.values()) if parts else 0.0
    return {
        "median_ms": median,
        "min_ms": min(graph_times or times),
        "times_ms": graph_times or times,
        "cuda_graph": graph_times is not None,
        "graph_kind": graph_kind,  # "decode" (one graph) or "piecewise" (encoder + decoder graphs)
        "graph_host_ms": host_ms,  # building and copying the step's metadata (inside the synchronous step)
        "sync_median_ms": statistics.median(sync_times) if sync_times else None,  # one graph step at a time, host included
        "sync_times_ms": sync_times,
        "eager_median_ms": statistics.median(times),
        "eager_times_ms": times,
        "tokens_per_s": case.new_tokens / (median / 1e3),
        "breakdown_ms": parts,
        "breakdown_pct": {k: 100 * v / total if total else 0.0 for k, v in parts.items()} if parts else None,
    }


def _path_results(label: str, cfg, cases, plans, token_map, opts, device, dtype, compact: bool, fast_path: bool | None, console) -> dict[str, dict]:
    """Build one path's weights and model and run every case; the model is freed on return."""
    weights = random_weights(cfg, dtype=dtype, device=device, compact=compact, seed=opts.seed)
    model = Model(cfg, weights, dtype=dtype, device=device, token_map=token_map, fast_path=fast_path)
    results: dict[str, dict] = {}
    for case in cases:
        if console is not None:
            console.print(f"  {label}: {case.text}", highlight=False)
        results[case.name] = _run_case(model, cfg, case, plans[case.name], opts, device, dtype)
        _free(device)
    return results, model.fast


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _reference_fits(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> str | None:
    """None if the dequantised weights fit, else why not."""
    if device.type != "cuda":
        return None
    need = dense_weight_bytes(cfg, dtype)
    free, _ = torch.cuda.mem_get_info(device)
    if need > REFERENCE_MEMORY_FRACTION * free:
        return f"dequantised weights need {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
    return None


def run_bench(opts: BenchOptions, case_texts: list[str], console: Console | None = None) -> dict:
    """Run every case on the fast path (and the reference path) -> the JSON document."""
    dtype = getattr(torch, opts.dtype, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise BenchError(f"--dtype must be a floating torch dtype, got {opts.dtype!r}")
    device = torch.device(opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda: no CUDA device is available")
    if opts.warmup < 0 or opts.iters < 1:
        raise BenchError("--warmup must be >= 0 and --iters >= 1")
    cfg = bench_config(opts.config, num_layers=opts.num_layers, num_experts=opts.num_experts, engram_rows=opts.engram_rows)
    if opts.fp8_activations:
        if cfg.arch != "v41":
            raise BenchError("--fp8-activations: V4.1 configs only")
        cfg = dataclasses.replace(cfg, fp8_activations=True)
    if opts.fp4_experts:
        if opts.fp8_activations:
            raise BenchError("--fp4-experts: not with --fp8-activations (its expert kernels multiply FP8 weight codes)")
        cfg = dataclasses.replace(cfg, fp4_experts=True)
    if opts.block_size < 1 or any(opts.block_size % r for r in cfg.compress_ratio_set):
        raise BenchError(f"--block-size must be a positive multiple of every compress ratio {list(cfg.compress_ratio_set)}, got {opts.block_size}")
    cases = parse_cases(case_texts)
    plans = {c.name: plan_case(cfg, c, bounded_replay=opts.bounded_replay) for c in cases}
    floors = {c.name: case_floor(cfg, c, dtype, bounded_replay=opts.bounded_replay) for c in cases}
    token_map = torch.randint(0, cfg.engram_compressed_vocab_size, (cfg.vocab_size,), generator=torch.Generator().manual_seed(opts.seed))
    baseline = device.type == "cuda" if opts.baseline is None else opts.baseline
    compact = device.type == "cuda"

    if console is not None:
        console.print(
            f"[bold]dsv4 bench forward[/] {opts.config}: {cfg.arch}, {cfg.num_layers} layers, "
            f"{cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok}, {opts.dtype} on {device}"
        )
    try:
        fast, fast_on = _path_results("fast", cfg, cases, plans, token_map, opts, device, dtype, compact, opts.fast_path, console)
    except torch.OutOfMemoryError:
        raise BenchError("the weights do not fit on the device; shrink them with --num-layers / --num-experts") from None
    _free(device)
    reference: dict[str, dict] = {}
    skipped = None
    if baseline:
        skipped = _reference_fits(cfg, dtype, device)
        if skipped is None:
            try:
                with torch_only():  # the HF-style baseline: torch ops throughout, cuBLAS GEMMs
                    reference, _ = _path_results("reference", cfg, cases, plans, token_map, opts, device, dtype, False, False, console)
            except torch.OutOfMemoryError:
                skipped = "out of memory while building the dequantised weights"
            _free(device)
    else:
        skipped = "not requested (--no-baseline; off by default on CPU, where the fast path is already dequantised)"

    out_cases = []
    for case in cases:
        f, r = fast[case.name], reference.get(case.name)
        entry = {
            "name": case.name,
            "case": case.text,
            "requests": case.num_requests,
            "new_tokens": case.new_tokens,
            "rows": sum(p.rows for p in plans[case.name]),
            "fast": f,
            "floor": floors[case.name],
            "floor_ratio": f["median_ms"] / floors[case.name]["floor_ms"] if "median_ms" in f else None,
            "reference": r if r is not None else {"skipped": skipped},
            "reference_ratio": r["median_ms"] / f["median_ms"] if r and "median_ms" in r and "median_ms" in f else None,
        }
        out_cases.append(entry)
    return {
        "config": {
            "source": opts.config,
            "arch": cfg.arch,
            "num_layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size,
            "n_routed_experts": cfg.n_routed_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok,
            "engram_rows": list(cfg.engram_num_embeddings),
            "layer_kinds": [r.kind for r in cfg.roles],
        },
        "dtype": opts.dtype,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "fast_path": ("compact FP8 weights" if compact else "dequantised weights") + (", fast path" if fast_on else ", reference ops")
        + (", CUDA graphs (decode buckets, piecewise prefill)" if fast_on and compact and opts.cuda_graphs else "")
        + (", FP8 activations" if opts.fp8_activations else "") + (", FP4 experts" if opts.fp4_experts else ""),
        "fp8_activations": opts.fp8_activations,
        "fp4_experts": opts.fp4_experts,
        "block_size": opts.block_size,
        "bounded_replay": opts.bounded_replay,
        "warmup": opts.warmup,
        "iters": opts.iters,
        "seed": opts.seed,
        "cases": out_cases,
    }


# ------------------------------------------------------------------------------- output


def _ms(value: float) -> str:
    if value < 0.01:
        return f"{value:.1e}"
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"


def tables(doc: dict) -> list[Table]:
    """The console report: steps vs floor and baseline; time by component; floor by component."""
    main = Table(title=f"forward steps ({doc['fast_path']}, {doc['dtype']} on {doc['device_name']})",
                 caption=f"floor: the H200's, whatever GPU ran the steps ({HBM_BYTES_PER_S / 1e12:.1f} TB/s HBM, {FP8_FLOPS_PER_S / 1e12:.0f}"
                         f" TFLOP/s FP8, {BF16_FLOPS_PER_S / 1e12:.0f} TFLOP/s BF16; dsv4/bench/roofline.py); x floor = step ms / floor ms")
    for col in ("case", "reqs", "new tok", "rows", "step ms", "sync ms", "eager ms", "tok/s", "floor ms", "mem | compute ms", "bound", "x floor", "ref ms", "ref/fast"):
        main.add_column(col, justify="left" if col == "case" else "right")
    parts = Table(title="step time by component, % (attention excludes the indexer)")
    floor = Table(title="floor by component, ms (m = memory bound, c = compute bound)")
    parts.add_column("case")
    floor.add_column("case")
    for c in (*COMPONENTS, "other"):
        parts.add_column(c, justify="right")
    for c in COMPONENTS:
        floor.add_column(c, justify="right")
    for e in doc["cases"]:
        f, fl, r = e["fast"], e["floor"], e["reference"]
        sizes = (e["case"], str(e["requests"]), str(e["new_tokens"]), str(e["rows"]))
        floors = (_ms(fl["floor_ms"]), f"{_ms(fl['memory_ms'])} | {_ms(fl['compute_ms'])}", fl["bound"])
        if "error" in f:
            main.add_row(*sizes, f["error"], "-", "-", "-", *floors, "-", "-", "-")
        else:
            rate = f["tokens_per_s"]
            ref = _ms(r["median_ms"]) if "median_ms" in r else r.get("error", "skipped")
            ratio = f"{e['reference_ratio']:.2f}" if e["reference_ratio"] else "-"
            step = _ms(f["median_ms"]) + ({"decode": " (graph)", "piecewise": " (2 graphs)"}.get(f.get("graph_kind"), ""))
            sync = _ms(f["sync_median_ms"]) if f.get("sync_median_ms") is not None else "-"
            main.add_row(*sizes, step, sync, _ms(f["eager_median_ms"]), f"{rate:,.0f}" if rate >= 100 else f"{rate:.1f}", *floors, f"{e['floor_ratio']:,.2f}", ref, ratio)
            if f["breakdown_pct"] is not None:
                parts.add_row(e["name"], *[f"{f['breakdown_pct'][c]:.1f}" for c in (*COMPONENTS, "other")])
        comps = fl["components"]
        floor.add_row(e["name"], *[f"{_ms(comps[c]['floor_ms'])} {'m' if comps[c]['memory_ms'] >= comps[c]['compute_ms'] else 'c'}" for c in COMPONENTS])
    return [main, *([parts] if parts.row_count else []), floor]


def _console() -> Console:
    console = Console()
    if not console.is_terminal:
        console.width = 320  # logs and CI: keep every column
    return console


def register_forward(subparsers) -> None:
    """Add `forward` to the subparsers of the `bench` command."""
    p = subparsers.add_parser(
        "forward",
        help="time exact batches (vLLM bench forward cases) against the roofline floor",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("cases", nargs="+", metavar="CASE", help="NAME=[N*]Q[@K][c][:D][,...], e.g. decode=64*1@32768 prefill=8192 hit=1024@100k verify=16*6@32768:5")
    p.add_argument("--config", required=True, help=f"config.json path or folder, or one of {', '.join(BUILTIN_CONFIGS)}")
    p.add_argument("--num-layers", type=int, help="keep this many layers (every layer kind kept when possible)")
    p.add_argument("--num-experts", type=int, help="routed experts per layer (top-k clamped)")
    p.add_argument("--engram-rows", type=int, default=DEFAULT_ENGRAM_ROWS, help="cap on each engram table's rows")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--swa-bounded-replay", action=argparse.BooleanOptionalAction, default=True, help="bounded (default) or exact window replay")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=None, help="also time the dequantised reference path (default: on for CUDA)")
    p.add_argument("--breakdown", action=argparse.BooleanOptionalAction, default=True, help="time one step per case section by section (the time by component)")
    p.add_argument("--fast-path", action=argparse.BooleanOptionalAction, default=None, help="the fast path (default: where it can run: CUDA, bfloat16, V4.1; on CPU it runs its torch references)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True, help="cases on the fast path: also time them as CUDA-graph replays (the step time): decode-shaped ones in one graph, others in the two pieces of dsv4.engine.cuda_graphs.PiecewiseGraphs")
    p.add_argument("--fp8-activations", action=argparse.BooleanOptionalAction, default=False,
                   help="quantise the inputs of FP8/FP4 GEMMs to FP8 (DeepSeek's reference numerics; FP8 x FP8 expert GEMMs)")
    p.add_argument("--fp4-experts", action=argparse.BooleanOptionalAction, default=False,
                   help="the fast path keeps the routed experts FP4 (half their bytes; the MoE kernels' FP4 variant)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the results here")
    p.set_defaults(func=forward_main)


def forward_main(args) -> int:
    console = _console()
    opts = BenchOptions(
        config=args.config, num_layers=args.num_layers, num_experts=args.num_experts, engram_rows=args.engram_rows,
        dtype=args.dtype, device=args.device, block_size=args.block_size, bounded_replay=args.swa_bounded_replay,
        warmup=args.warmup, iters=args.iters, baseline=args.baseline, breakdown=args.breakdown, cuda_graphs=args.cuda_graphs, fast_path=args.fast_path,
        fp8_activations=args.fp8_activations, fp4_experts=args.fp4_experts, seed=args.seed,
    )
    try:
        doc = run_bench(opts, args.cases, console)
    except (BenchError, CaseError, ConfigError) as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}", highlight=False)  # (the grammar's [@K] is not markup)
        return 2
    for table in tables(doc):
        console.print(table)
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        console.print(f"wrote {args.json}")
    return 0
