"""Metric arithmetic of `dsv4 bench serve`, exactly as BENCH.md 1.5 / 5.4 define it.

Kept free of I/O so the definitions can be checked against hand-computed numbers:
throughput over max(end) - min(start) of profiled requests, per-request ITL
(E2EL - TTFT) / (OSL - 1) (TPOT is the same numbers), slow-tail interactivity
`p_q = 1 / percentile_q(ITL)` and E2E-normalised interactivity `1 / percentile_q(E2EL / OSL)`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

PERCENTILES = (50, 75, 90, 95, 99)


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are seconds since the point's clock start.

    `isl`, `osl_expected` and `theoretical_cached` come from the workload spec; the
    `*_tokens` fields from the server's usage chunk. `error` is a category such as
    `http_503`, `timeout`, `connection`, `bad_stream`, `drain_timeout`, or None.
    """

    session: str
    turn: int
    lane: int
    phase: str  # "warmup" or "profile"
    start: float
    end: float
    isl: int
    osl_expected: int
    theoretical_cached: int
    ttft: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None

    @property
    def e2el(self) -> float:
        return self.end - self.start

    @property
    def itl(self) -> float | None:
        """AIPerf per-request inter-token latency (E2EL - TTFT) / (OSL - 1), seconds."""
        if self.error is not None or self.ttft is None or (self.completion_tokens or 0) < 2:
            return None
        return (self.e2el - self.ttft) / (self.completion_tokens - 1)


def _stats(name: str, values_ms: np.ndarray) -> dict:
    """vLLM-style mean_/median_/std_/pNN_ keys (std is the population std, as vLLM's)."""
    if values_ms.size == 0:
        keys = [f"mean_{name}", f"median_{name}", f"std_{name}"] + [f"p{q}_{name}" for q in PERCENTILES]
        return dict.fromkeys(keys)
    out = {
        f"mean_{name}": float(values_ms.mean()),
        f"median_{name}": float(np.median(values_ms)),
        f"std_{name}": float(values_ms.std()),
    }
    out.update({f"p{q}_{name}": float(np.percentile(values_ms, q)) for q in PERCENTILES})
    return out


def _reciprocal_stats(seconds_per_token: np.ndarray) -> dict:
    """Tokens/s per user as 1 / statistic(seconds per token): slow-tail percentiles.

    `p90` is 1 / p90(seconds per token), i.e. the user at the slow 90th percentile;
    `mean` likewise is 1 / mean, so every readout is a reciprocal of a latency statistic.
    """
    keys = ("mean", "p50", "p75", "p90", "p95")
    if seconds_per_token.size == 0:
        return dict.fromkeys(keys)
    values = [seconds_per_token.mean()] + [np.percentile(seconds_per_token, q) for q in (50, 75, 90, 95)]
    return {k: (float(1.0 / v) if v > 0 else None) for k, v in zip(keys, values)}


def summarize(records: list[RequestRecord], num_gpus: int) -> dict:
    """All per-point metrics of BENCH.md 5.4 that derive from the request log.

    Warmup records and errored records are dropped from every metric and only counted in
    `request_accounting`. The cached/uncached split uses the server's usage when every
    profiled request reported `cached_tokens`, otherwise the generator's theoretical hit
    (`cached_tokens_source` says which).
    """
    profiled = [r for r in records if r.phase == "profile"]
    ok = [r for r in profiled if r.error is None]
    errors = Counter(r.error for r in profiled if r.error is not None)
    accounting = {
        "total": len(records),
        "warmup_dropped": len(records) - len(profiled),
        "warmup_errors": sum(r.error is not None for r in records if r.phase != "profile"),
        "error_dropped": len(profiled) - len(ok),
        "error_categories": dict(sorted(errors.items())),
    }
    duration = (max(r.end for r in ok) - min(r.start for r in ok)) if ok else 0.0
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.completion_tokens for r in ok)
    theoretical = sum(r.theoretical_cached for r in ok)
    expected_isl = sum(r.isl for r in ok)
    server_reports_cache = bool(ok) and all(r.cached_tokens is not None for r in ok)
    server_cached = sum(r.cached_tokens for r in ok) if server_reports_cache else None
    cached = server_cached if server_reports_cache else theoretical

    def rate(tokens: float) -> float:
        return tokens / duration if duration > 0 else 0.0

    ttft = np.array([r.ttft for r in ok], dtype=float)
    e2el = np.array([r.e2el for r in ok], dtype=float)
    osl = np.array([r.completion_tokens for r in ok], dtype=float)
    multi = osl >= 2
    itl = (e2el[multi] - ttft[multi]) / (osl[multi] - 1)
    e2e_per_token = e2el[osl >= 1] / osl[osl >= 1]

    starts = np.array([r.start for r in ok], dtype=float)
    if ok:
        per_second = np.bincount(np.floor(starts - starts.min()).astype(int))
        qps = {"mean": float(per_second.mean()), "max": int(per_second.max())}
    else:
        qps = {"mean": 0.0, "max": 0}

    result = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(profiled) - len(ok),
        "num_prompts": len(profiled),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "total_cached_input_tokens": cached,
        "total_uncached_input_tokens": input_tokens - cached,
        "cached_tokens_source": "server" if server_reports_cache else "theoretical",
        "theoretical_cached_input_tokens": theoretical,
        "expected_input_tokens": expected_isl,
        "expected_output_tokens": sum(r.osl_expected for r in ok),
        "isl_mismatch_requests": sum(r.prompt_tokens != r.isl for r in ok),
        "theoretical_cache_hit_rate": theoretical / expected_isl if expected_isl else None,
        "server_cache_hit_rate": server_cached / input_tokens if server_reports_cache and input_tokens else None,
        "request_throughput": rate(len(ok)),
        "input_throughput": rate(input_tokens),
        "output_throughput": rate(output_tokens),
        "total_token_throughput": rate(input_tokens + output_tokens),
        "per_gpu": {
            "total_tput_tps": rate(input_tokens + output_tokens) / num_gpus,
            "input_tput_tps": rate(input_tokens) / num_gpus,
            "cached_input_tput_tps": rate(cached) / num_gpus,
            "uncached_input_tput_tps": rate(input_tokens - cached) / num_gpus,
            "output_tput_tps": rate(output_tokens) / num_gpus,
        },
        "mean_input_tokens": input_tokens / len(ok) if ok else None,
        "mean_cached_input_tokens": cached / len(ok) if ok else None,
        "mean_uncached_input_tokens": (input_tokens - cached) / len(ok) if ok else None,
        "mean_output_tokens": output_tokens / len(ok) if ok else None,
        "inflight_mean": float(e2el.sum()) / duration if duration > 0 else 0.0,
        "qps_1s": qps,
        "intvty": _reciprocal_stats(itl),
        "e2e_norm_intvty": _reciprocal_stats(e2e_per_token),
        "request_accounting": accounting,
    }
    result.update(_stats("ttft_ms", ttft * 1e3))
    result.update(_stats("tpot_ms", itl * 1e3))
    result.update(_stats("itl_ms", itl * 1e3))
    result.update(_stats("e2el_ms", e2el * 1e3))
    return result
