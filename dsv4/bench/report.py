"""Presentation of benchmark results: console table, JSONL, Pareto frontier, iso-interactivity, PNG.

Everything here works on the per-point result dicts that are written to the JSONL, so
`dsv4 bench plot` can redo the frontier and the figure from saved files alone.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from rich import box
from rich.table import Table

ISO_TARGETS = (20, 30, 50, 100, 150)
"""tok/s/user levels of the iso-interactivity readouts (BENCH.md 5.4)."""

SLO_TTFT_MS = 10_000.0
"""P90 TTFT bound of the AgentPerf-style SLO tier."""


def _fmt(value, digits: int = 0, scale: float = 1.0) -> str:
    return "-" if value is None else f"{value * scale:,.{digits}f}"


# (header, function of a result dict -> cell text); grouped as in BENCH.md 5.4.
_COLUMNS = [
    ("conc", lambda r: str(r["concurrency"])),
    ("gpus", lambda r: str(r["num_gpus"])),
    ("sess\ndone", lambda r: str(r["sessions_completed"])),
    ("reqs", lambda r: str(r["completed"])),
    ("err%", lambda r: _fmt(r["failed"] / r["num_prompts"] if r["num_prompts"] else 0.0, 1, 100)),
    ("ISL\nmean", lambda r: _fmt(r["mean_input_tokens"])),
    ("cached\nmean", lambda r: _fmt(r["mean_cached_input_tokens"])),
    ("new\nmean", lambda r: _fmt(r["mean_uncached_input_tokens"])),
    ("OSL\nmean", lambda r: _fmt(r["mean_output_tokens"])),
    ("hit%\ntheory", lambda r: _fmt(r["theoretical_cache_hit_rate"], 1, 100)),
    ("hit%\nserver", lambda r: _fmt(r["server_cache_hit_rate"], 1, 100)),
    ("tok/s/GPU\ntotal", lambda r: _fmt(r["per_gpu"]["total_tput_tps"])),
    ("input\ncached", lambda r: _fmt(r["per_gpu"]["cached_input_tput_tps"])),
    ("input\nuncached", lambda r: _fmt(r["per_gpu"]["uncached_input_tput_tps"])),
    ("output", lambda r: _fmt(r["per_gpu"]["output_tput_tps"])),
    ("TTFT ms\np50", lambda r: _fmt(r["p50_ttft_ms"])),
    ("TTFT ms\np90", lambda r: _fmt(r["p90_ttft_ms"])),
    ("TTFT ms\np99", lambda r: _fmt(r["p99_ttft_ms"])),
    ("TPOT ms\np50", lambda r: _fmt(r["p50_tpot_ms"], 1)),
    ("TPOT ms\np90", lambda r: _fmt(r["p90_tpot_ms"], 1)),
    ("intvty\np50", lambda r: _fmt(r["intvty"]["p50"], 1)),
    ("intvty\np90", lambda r: _fmt(r["intvty"]["p90"], 1)),
    ("e2e-norm\np75", lambda r: _fmt(r["e2e_norm_intvty"]["p75"], 1)),
    ("e2e-norm\np90", lambda r: _fmt(r["e2e_norm_intvty"]["p90"], 1)),
    ("E2EL s\np50", lambda r: _fmt(r["p50_e2el_ms"], 2, 1e-3)),
    ("E2EL s\np90", lambda r: _fmt(r["p90_e2el_ms"], 2, 1e-3)),
    ("req/s", lambda r: _fmt(r["request_throughput"], 2)),
    ("in-\nflight", lambda r: _fmt(r["inflight_mean"], 1)),
    ("kv%", lambda r: _fmt(r["kv_cache"]["usage_mean"], 1, 100)),
    ("pre-\nempt", lambda r: _fmt(r["kv_cache"]["preemptions"])),
]


def point_table(results: list[dict], title: str | None = None) -> Table:
    """One row per concurrency point, columns as BENCH.md 5.4 lists them."""
    table = Table(title=title, header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False)
    for header, _ in _COLUMNS:
        table.add_column(header, justify="right", no_wrap=True)
    for r in results:
        table.add_row(*(cell(r) for _, cell in _COLUMNS))
    return table


# --------------------------------------------------------------------------- frontier


def pareto_frontier(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both x and y, sorted by x."""
    members = [
        i
        for i, (x, y) in enumerate(points)
        if not any((ox >= x and oy >= y) and (ox > x or oy > y) for j, (ox, oy) in enumerate(points) if j != i)
    ]
    return sorted(members, key=lambda i: points[i][0])


def iso_throughput(frontier: list[tuple[float, float]], target: float) -> float | None:
    """Best y with x >= target, by linear interpolation along a frontier sorted by x.

    None ("unreachable") when even the most interactive frontier point is below target.
    """
    if not frontier or target > frontier[-1][0]:
        return None
    if target <= frontier[0][0]:
        return frontier[0][1]
    for (x0, y0), (x1, y1) in zip(frontier, frontier[1:]):
        if x0 <= target <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (target - x0) / (x1 - x0)
    return None


def sweep_summary(results: list[dict]) -> dict:
    """Pareto points, iso-interactivity readouts and the SLO tier of one sweep.

    The North Star frontier is total tok/s/GPU vs P90 E2E-normalised interactivity; the
    decode-interactivity readout only uses North Star members (BENCH.md 1.6).
    """
    points = [
        {
            "concurrency": r["concurrency"],
            "total_tput_per_gpu": r["per_gpu"]["total_tput_tps"],
            "p90_e2e_norm_intvty": r["e2e_norm_intvty"]["p90"],
            "p90_intvty": r["intvty"]["p90"],
            "p90_ttft_ms": r["p90_ttft_ms"],
            "frontier": False,
        }
        for r in results
    ]
    usable = [p for p in points if p["p90_e2e_norm_intvty"] is not None]
    north = [usable[i] for i in pareto_frontier([(p["p90_e2e_norm_intvty"], p["total_tput_per_gpu"]) for p in usable])]
    for p in north:
        p["frontier"] = True
    decode_pool = [p for p in north if p["p90_intvty"] is not None]
    decode = [
        decode_pool[i] for i in pareto_frontier([(p["p90_intvty"], p["total_tput_per_gpu"]) for p in decode_pool])
    ]
    north_xy = [(p["p90_e2e_norm_intvty"], p["total_tput_per_gpu"]) for p in north]
    decode_xy = [(p["p90_intvty"], p["total_tput_per_gpu"]) for p in decode]
    slo = {}
    for x in ISO_TARGETS:
        ok = [
            p["concurrency"]
            for p in points
            if p["p90_intvty"] is not None and p["p90_intvty"] >= x and p["p90_ttft_ms"] <= SLO_TTFT_MS
        ]
        slo[str(x)] = max(ok) if ok else None
    return {
        "points": points,
        "frontier_concurrency": [p["concurrency"] for p in north],
        "iso_e2e_norm_intvty": {str(x): iso_throughput(north_xy, x) for x in ISO_TARGETS},
        "iso_intvty": {str(x): iso_throughput(decode_xy, x) for x in ISO_TARGETS},
        "slo_tier_max_concurrency": slo,
    }


def summary_lines(summary: dict) -> list[str]:
    """Human-readable frontier and iso-interactivity readouts for the console."""
    lines = ["Pareto points (total tok/s/GPU @ P90 e2e-norm interactivity (@ P90 TTFT)); * = frontier:"]
    for p in summary["points"]:
        mark = "*" if p["frontier"] else " "
        lines.append(
            f" {mark} c={p['concurrency']:<4} {_fmt(p['total_tput_per_gpu'])} tok/s/GPU @ "
            f"{_fmt(p['p90_e2e_norm_intvty'], 1)} tok/s/user (@ {_fmt(p['p90_ttft_ms'])} ms)"
        )
    for key, name in (("iso_e2e_norm_intvty", "P90 e2e_norm_intvty"), ("iso_intvty", "P90 decode intvty")):
        cells = [f"≥{x}: {_fmt(v) if v is not None else 'unreachable'}" for x, v in summary[key].items()]
        lines.append(f"tok/s/GPU @ {name} " + " | ".join(cells))
    cells = [
        f"≥{x}: {'c=' + str(c) if c is not None else 'none'}" for x, c in summary["slo_tier_max_concurrency"].items()
    ]
    lines.append("SLO tier (P90 decode intvty, P90 TTFT ≤ 10 s) max concurrency " + " | ".join(cells))
    return lines


# --------------------------------------------------------------------------- files


def append_jsonl(path: Path, records: Iterable[dict]) -> None:
    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def read_runs(paths: list[Path]) -> dict[str, list[dict]]:
    """Results of JSONL files grouped into runs (by `run_id`), keyed by a display label."""
    runs: dict[str, list[dict]] = {}
    for path in paths:
        by_id: dict[str, list[dict]] = {}
        for line in Path(path).read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                by_id.setdefault(record.get("run_id", str(path)), []).append(record)
        for records in by_id.values():
            label = records[0].get("label") or Path(path).stem
            while label in runs:
                label += "'"
            runs[label] = records
    return runs


def plot_runs(runs: dict[str, list[dict]], out: Path) -> None:
    """PNG of total tok/s/GPU vs P90 E2E-normalised interactivity, one curve (frontier) per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for label, results in runs.items():
        pts = [
            (r["e2e_norm_intvty"]["p90"], r["per_gpu"]["total_tput_tps"], r["concurrency"])
            for r in results
            if r["e2e_norm_intvty"]["p90"] is not None
        ]
        if not pts:
            continue
        frontier = [pts[i] for i in pareto_frontier([(x, y) for x, y, _ in pts])]
        (line,) = ax.plot([p[0] for p in frontier], [p[1] for p in frontier], marker="o", label=label)
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], color=line.get_color(), alpha=0.35)
        for x, y, c in pts:
            ax.annotate(f"c{c}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("P90 E2E-normalised interactivity (tok/s/user)")
    ax.set_ylabel("total tok/s/GPU (cached + uncached input + output)")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
