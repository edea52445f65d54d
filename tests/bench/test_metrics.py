"""Metric arithmetic on a hand-made request log, against values computed by hand."""

import pytest

from dsv4.bench.metrics import RequestRecord, summarize


def _rec(start, end, ttft=None, prompt=None, cached=None, osl=None, theo=0, isl=None, phase="profile", error=None):
    return RequestRecord(
        session="s",
        turn=0,
        lane=0,
        phase=phase,
        start=start,
        end=end,
        isl=isl if isl is not None else prompt or 0,
        osl_expected=osl or 1,
        theoretical_cached=theo,
        ttft=ttft,
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=osl,
        error=error,
    )


LOG = [
    _rec(0.0, 2.0, ttft=0.5, prompt=1000, cached=800, osl=11, theo=768),  # ITL 0.15 s, E2EL/OSL 2/11
    _rec(1.0, 4.0, ttft=1.0, prompt=2000, cached=1500, osl=21, theo=1536),  # ITL 0.10 s, 3/21
    _rec(2.0, 3.0, ttft=0.2, prompt=500, cached=0, osl=5, theo=0),  # ITL 0.20 s, 1/5
    _rec(3.0, 3.5, error="http_500"),
    _rec(3.1, 9.0, error="timeout"),
    _rec(-1.0, -0.5, ttft=0.1, prompt=1000, cached=0, osl=1, phase="warmup"),
]


def test_throughput_and_cache_split():
    m = summarize(LOG, num_gpus=2)
    assert m["duration"] == 4.0  # max(end) - min(start) over the 3 good profiled requests
    assert (m["completed"], m["failed"], m["num_prompts"]) == (3, 2, 5)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (3500, 37)
    assert (m["total_cached_input_tokens"], m["total_uncached_input_tokens"]) == (2300, 1200)
    assert m["cached_tokens_source"] == "server"
    assert m["request_throughput"] == pytest.approx(0.75)
    assert m["input_throughput"] == pytest.approx(875.0)
    assert m["output_throughput"] == pytest.approx(9.25)
    assert m["total_token_throughput"] == pytest.approx(884.25)
    assert m["per_gpu"] == pytest.approx(
        {
            "total_tput_tps": 442.125,
            "input_tput_tps": 437.5,
            "cached_input_tput_tps": 287.5,
            "uncached_input_tput_tps": 150.0,
            "output_tput_tps": 4.625,
        }
    )
    assert m["theoretical_cache_hit_rate"] == pytest.approx(2304 / 3500)
    assert m["server_cache_hit_rate"] == pytest.approx(2300 / 3500)
    assert m["inflight_mean"] == pytest.approx(1.5)  # (2 + 3 + 1) s of requests over 4 s
    assert m["qps_1s"] == {"mean": 1.0, "max": 1}
    assert m["request_accounting"] == {
        "total": 6,
        "warmup_dropped": 1,
        "warmup_errors": 0,
        "error_dropped": 2,
        "error_categories": {"http_500": 1, "timeout": 1},
    }


def test_latency_and_interactivity():
    m = summarize(LOG, num_gpus=1)
    # TTFT 200, 500, 1000 ms: p90 = 500 + 0.8 * 500 (linear interpolation).
    assert m["mean_ttft_ms"] == pytest.approx(1700 / 3)
    assert m["median_ttft_ms"] == pytest.approx(500)
    assert m["p90_ttft_ms"] == pytest.approx(900)
    assert m["p99_ttft_ms"] == pytest.approx(990)
    # ITL per request (E2EL - TTFT) / (OSL - 1): 0.15, 0.10, 0.20 s; TPOT is the same numbers.
    assert m["mean_itl_ms"] == pytest.approx(150)
    assert m["p90_itl_ms"] == pytest.approx(190)
    assert m["p90_tpot_ms"] == m["p90_itl_ms"]
    assert m["intvty"]["p50"] == pytest.approx(1 / 0.15)
    assert m["intvty"]["p90"] == pytest.approx(1 / 0.19)  # slow tail: 1 / p90(ITL)
    assert m["intvty"]["mean"] == pytest.approx(1 / 0.15)
    # E2EL / OSL: 2/11, 3/21, 1/5 s per token.
    r = sorted([2 / 11, 3 / 21, 1 / 5])
    assert m["e2e_norm_intvty"]["p90"] == pytest.approx(1 / (r[1] + 0.8 * (r[2] - r[1])))
    assert m["e2e_norm_intvty"]["p75"] == pytest.approx(1 / (r[1] + 0.5 * (r[2] - r[1])))
    assert m["e2e_norm_intvty"]["p50"] == pytest.approx(1 / r[1])
    assert m["mean_e2el_ms"] == pytest.approx(2000)
    assert m["std_e2el_ms"] == pytest.approx((2e6 / 3) ** 0.5)


def test_theoretical_split_when_server_does_not_report_cache():
    log = [*LOG[:2], _rec(2.0, 3.0, ttft=0.2, prompt=500, cached=None, osl=5, theo=0)]
    m = summarize(log, num_gpus=1)
    assert m["cached_tokens_source"] == "theoretical"
    assert m["total_cached_input_tokens"] == 2304
    assert m["server_cache_hit_rate"] is None


def test_empty_log_is_well_defined():
    m = summarize([_rec(0, 1, error="connection")], num_gpus=8)
    assert m["completed"] == 0 and m["duration"] == 0.0 and m["p90_ttft_ms"] is None
    assert m["intvty"]["p90"] is None and m["per_gpu"]["total_tput_tps"] == 0.0
