"""`dsv4 bench serve` and `dsv4 bench plot` (wired under the `bench` command by dsv4/cli.py).

`serve` sweeps concurrency points against a running OpenAI-compatible server and writes,
under --output-dir: `results.jsonl` (one object per point, appended), `summary.json`
(Pareto frontier and iso-interactivity of this sweep), `pareto.png`, and with
--save-detailed one `detailed_<run>_c<N>.jsonl` of per-request records per point.
`plot` overlays the runs found in result JSONL files.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import httpx
from rich.console import Console
from rich.markup import escape

from .metrics import summarize
from .replay import PointRun, ReplayConfig, Replayer
from .report import (
    append_jsonl,
    plot_runs,
    point_table,
    read_runs,
    summary_lines,
    sweep_summary,
)
from .workloads import PROFILES, Workload, agentx_synth, random_workload, weka_traces

DEFAULT_CONCURRENCY = "1,2,4,8,16,32,64,128"


def register(subparsers) -> None:
    """Add `serve` and `plot` to the subparsers of the `bench` command."""
    serve = subparsers.add_parser(
        "serve",
        help="closed-loop AgentX-style replay against an OpenAI-compatible server",
        description="Sweep concurrency points of a closed-loop replay (BENCH.md 5) against a running "
        "OpenAI-compatible server; write results.jsonl, summary.json and pareto.png to --output-dir.",
    )
    serve.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000 (a /v1 suffix is ok)")
    serve.add_argument("--model", required=True, help="model name sent in every request")
    serve.add_argument(
        "--workload",
        choices=["agentx-synth", "weka-trace", "random"],
        default="agentx-synth",
        help="default: agentx-synth",
    )
    serve.add_argument(
        "--profile", choices=sorted(PROFILES), default="full", help="agentx-synth profile (default: full)"
    )
    serve.add_argument(
        "--shared-sys-prefix", action="store_true", help="agentx-synth: one system prefix for all sessions"
    )
    serve.add_argument("--trace-dir", type=Path, help="weka-trace: directory of trace_*.json")
    serve.add_argument(
        "--concurrency", default=DEFAULT_CONCURRENCY, help="comma-separated lane counts (default: %(default)s)"
    )
    serve.add_argument("--duration", type=float, help="measurement window per point, s (default: the workload's)")
    serve.add_argument(
        "--num-gpus", type=int, default=1, help="GPUs behind the server, for per-GPU throughput (default: 1)"
    )
    serve.add_argument("--output-dir", type=Path, default=Path("bench-results"), help="default: bench-results")
    serve.add_argument(
        "--seed", type=int, default=42, help="workload seed, fixed across points and engines (default: 42)"
    )
    serve.add_argument("--chat", action="store_true", help="send /v1/chat/completions text instead of token ids")
    serve.add_argument(
        "--max-requests", type=int, default=10_000, help="cap on profiled requests per point (default: %(default)s)"
    )
    serve.add_argument("--input-len", type=int, default=8192, help="random: prompt tokens (default: %(default)s)")
    serve.add_argument("--output-len", type=int, default=1024, help="random: output tokens (default: %(default)s)")
    serve.add_argument(
        "--request-rate", type=float, help="random: Poisson arrivals/s within the lanes (default: closed loop)"
    )
    serve.add_argument(
        "--warmup-steps", type=int, default=0, help="extra one-token warm-up calls per lane (default: 0)"
    )
    serve.add_argument(
        "--drain-timeout",
        type=float,
        default=300.0,
        help="s after the window before in-flight calls are cancelled (default: %(default)s)",
    )
    serve.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="s of silence before a call times out (default: %(default)s)",
    )
    serve.add_argument(
        "--token-range",
        default="1000,128000",
        help="LO,HI: prompt token ids are drawn from [LO, HI) (default: %(default)s)",
    )
    serve.add_argument("--save-detailed", action="store_true", help="also write per-request records")
    serve.add_argument("--no-early-stop", action="store_true", help="run every point even past saturation")
    serve.add_argument("--label", help="run name in plots (default: engine + workload)")
    serve.add_argument("--engine", help="engine name to record (default: the server's /v1/models owned_by)")
    serve.add_argument("--engine-version", help="engine version to record (default: the server's /version)")
    serve.add_argument("--parallelism", default="", help="parallelism to record, e.g. TP8")
    serve.set_defaults(func=serve_main)

    plot = subparsers.add_parser("plot", help="overlay the Pareto curves of result JSONL files")
    plot.add_argument("runs", nargs="+", type=Path, help="results.jsonl files")
    plot.add_argument("--out", type=Path, default=Path("pareto.png"))
    plot.set_defaults(func=plot_main)


def _console() -> Console:
    console = Console()
    if not console.is_terminal:
        console.width = 320  # logs and CI: keep every table column
    return console


def build_workload(args) -> Workload:
    if args.workload == "agentx-synth":
        return agentx_synth(args.profile, args.seed, args.shared_sys_prefix)
    if args.workload == "weka-trace":
        if args.trace_dir is None:
            raise ValueError("--workload weka-trace needs --trace-dir")
        return weka_traces(args.trace_dir, args.seed)
    return random_workload(args.input_len, args.output_len, args.max_requests, args.seed)


def stop_reason(results: list[dict]) -> str | None:
    """BENCH.md 5.3 sweep stop: error rate > 10 %, or two consecutive points that each
    lose >= 5 % total throughput while P90 TTFT rises."""
    last = results[-1]
    if last["num_prompts"] and last["failed"] / last["num_prompts"] > 0.10:
        return "error rate above 10 %"

    def worse(prev: dict, cur: dict) -> bool:
        return (
            cur["total_token_throughput"] <= 0.95 * prev["total_token_throughput"]
            and cur["p90_ttft_ms"] is not None
            and prev["p90_ttft_ms"] is not None
            and cur["p90_ttft_ms"] > prev["p90_ttft_ms"]
        )

    if len(results) >= 3 and worse(results[-3], results[-2]) and worse(results[-2], results[-1]):
        return "throughput fell twice in a row while P90 TTFT rose"
    return None


def point_result(run: PointRun, meta: dict, num_gpus: int) -> dict:
    """The JSONL object of one point: run metadata, request-log metrics, server readings."""
    result = {**meta, "concurrency": run.concurrency, "max_concurrency": run.concurrency}
    result["sessions_completed"] = run.sessions_completed
    result.update(summarize(run.records, num_gpus))
    prometheus_hit = run.server.get("prometheus_cache_hit_rate")
    result["prometheus_cache_hit_rate"] = prometheus_hit
    if result["server_cache_hit_rate"] is not None:
        result["server_cache_hit_source"] = "usage"
    elif prometheus_hit is not None:
        result["server_cache_hit_rate"], result["server_cache_hit_source"] = prometheus_hit, "prometheus"
    else:
        result["server_cache_hit_source"] = None
    empty_kv = {"usage_mean": None, "usage_max": None, "capacity_tokens": None, "preemptions": None}
    result["kv_cache"] = run.server.get("kv_cache", empty_kv)
    result["spec_decode"] = run.server.get("spec_decode", {})
    return result


async def _sweep(rp: Replayer, args, console: Console) -> tuple[list[dict], dict]:
    workload, cfg = rp.workload, rp.cfg
    run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.urandom(3).hex()}"
    results: list[dict] = []
    async with rp:
        info = await rp.server_info()
        engine = args.engine or info["engine"]
        meta = {
            "run_id": run_id,
            "label": args.label or f"{engine or 'server'} {workload.name}:{workload.profile}",
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "base_url": cfg.base_url,
            "model": cfg.model,
            "engine": engine,
            "engine_version": args.engine_version or info["engine_version"],
            "parallelism": args.parallelism,
            "num_gpus": args.num_gpus,
            "seed": workload.seed,
            "workload": workload.name,
            "workload_profile": workload.profile,
            "workload_sha256": workload.sha256(),
            "workload_sessions": len(workload.sessions),
            "duration_target": cfg.duration_s,
            "api": "chat" if cfg.chat else "completions",
            "sampling": {"temperature": "engine default", "ignore_eos": True, "stream": True},
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "func"},
        }
        console.print(
            f"[bold]{meta['label']}[/] against {rp.root}: {len(workload.sessions)} sessions, "
            f"sha256 {meta['workload_sha256'][:16]}…, window {cfg.duration_s:g} s"
        )
        args.output_dir.mkdir(parents=True, exist_ok=True)
        for concurrency in _concurrencies(args.concurrency):
            run = await rp.run_point(concurrency)
            result = point_result(run, meta, args.num_gpus)
            append_jsonl(args.output_dir / "results.jsonl", [result])
            if args.save_detailed:
                detail = args.output_dir / f"detailed_{run_id}_c{concurrency}.jsonl"
                append_jsonl(detail, ({**asdict(r), "e2el": r.e2el, "itl": r.itl} for r in run.records))
            console.print(point_table([result], title=f"concurrency {concurrency}"))
            results.append(result)
            reason = None if args.no_early_stop else stop_reason(results)
            if reason:
                console.print(f"stopping the sweep: {reason}")
                break
    return results, meta


def _concurrencies(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise ValueError(f"--concurrency needs positive integers, got {text!r}")
    return values


def serve_main(args) -> int:
    console = _console()
    try:
        lo, hi = (int(v) for v in args.token_range.split(","))
        if not 0 <= lo < hi:
            raise ValueError(f"--token-range needs 0 <= LO < HI, got {args.token_range!r}")
        _concurrencies(args.concurrency)
        workload = build_workload(args)
        cfg = ReplayConfig(
            base_url=args.base_url,
            model=args.model,
            chat=args.chat,
            duration_s=args.duration if args.duration is not None else workload.duration_s,
            max_requests=args.max_requests,
            warmup_steps=args.warmup_steps,
            drain_timeout_s=args.drain_timeout,
            request_timeout_s=args.request_timeout,
            request_rate=args.request_rate,
            token_range=(lo, hi),
        )
        replayer = Replayer(workload, cfg)
    except ValueError as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}")
        return 2
    try:
        results, meta = asyncio.run(_sweep(replayer, args, console))
    except httpx.HTTPError as exc:
        console.print(f"[red]error:[/] cannot use {escape(f'{args.base_url}: {exc!r}')}")
        return 1
    summary = sweep_summary(results)
    console.print(point_table(results, title=f"{meta['label']} (run {meta['run_id']})"))
    for line in summary_lines(summary):
        console.print(line, highlight=False)
    doc = {"run_id": meta["run_id"], "label": meta["label"], "workload_sha256": meta["workload_sha256"], **summary}
    (args.output_dir / "summary.json").write_text(json.dumps(doc, indent=2) + "\n")
    plot_runs({meta["label"]: results}, args.output_dir / "pareto.png")
    console.print(f"wrote {args.output_dir}/results.jsonl, summary.json, pareto.png")
    return 0


def plot_main(args) -> int:
    runs = read_runs(args.runs)
    plot_runs(runs, args.out)
    console = _console()
    for label, results in runs.items():
        console.print(point_table(results, title=label))
        for line in summary_lines(sweep_summary(results)):
            console.print(line, highlight=False)
    console.print(f"wrote {args.out}")
    return 0
