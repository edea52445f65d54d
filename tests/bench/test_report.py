"""Pareto frontier, iso-interactivity, SLO tier and /metrics parsing."""

import pytest

from dsv4.bench.replay import metric, parse_prometheus, server_readings
from dsv4.bench.report import iso_throughput, pareto_frontier, sweep_summary


def test_pareto_frontier():
    points = [(10, 100), (20, 90), (15, 80), (30, 50), (5, 60)]
    assert pareto_frontier(points) == [0, 1, 3]


def test_iso_throughput_interpolates_on_the_frontier():
    frontier = [(10, 100), (20, 90), (30, 50)]
    assert iso_throughput(frontier, 5) == 100  # every frontier point qualifies: take the best
    assert iso_throughput(frontier, 15) == pytest.approx(95)
    assert iso_throughput(frontier, 25) == pytest.approx(70)
    assert iso_throughput(frontier, 30) == pytest.approx(50)
    assert iso_throughput(frontier, 31) is None  # unreachable


def _point(c, tput, e2e_p90, intvty_p90, ttft_p90):
    return {
        "concurrency": c,
        "per_gpu": {"total_tput_tps": tput},
        "e2e_norm_intvty": {"p90": e2e_p90},
        "intvty": {"p90": intvty_p90},
        "p90_ttft_ms": ttft_p90,
    }


def test_sweep_summary():
    results = [
        _point(1, 100.0, 160.0, 200.0, 50.0),
        _point(2, 180.0, 120.0, 190.0, 80.0),
        _point(4, 170.0, 100.0, 120.0, 200.0),  # dominated by c=2
        _point(8, 300.0, 40.0, 60.0, 12_000.0),
    ]
    s = sweep_summary(results)
    assert s["frontier_concurrency"] == [8, 2, 1]
    assert [p["frontier"] for p in s["points"]] == [True, True, False, True]
    iso = s["iso_e2e_norm_intvty"]
    assert iso["20"] == 300.0 and iso["30"] == 300.0
    assert iso["50"] == pytest.approx(300 - 120 * 10 / 80)
    assert iso["150"] == pytest.approx(180 - 80 * 30 / 40)
    assert s["iso_intvty"]["100"] == pytest.approx(300 - 120 * (100 - 60) / 130)
    # c=8 misses the 10 s TTFT SLO; c=4 (dominated, but an SLO tier needs no frontier) reaches 120 tok/s.
    assert s["slo_tier_max_concurrency"] == {"20": 4, "30": 4, "50": 4, "100": 4, "150": 2}


METRICS = """# HELP vllm:prefix_cache_hits_total hits
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{model_name="m",engine="0"} 300
vllm:prefix_cache_hits_total{model_name="m",engine="1"} 100
vllm:external_prefix_cache_hits_total{model_name="m"} 999
vllm:prefix_cache_queries_total{model_name="m"} 1000
vllm:kv_cache_usage_perc{model_name="m"} 0.5
vllm:num_preemptions_total{model_name="m"} 2
vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1.0
"""


def test_prometheus_readings():
    before = parse_prometheus(METRICS)
    assert metric(before, "prefix_cache_hits") == 400  # summed over label sets, not "external_"
    later = METRICS.replace("} 300", "} 700").replace("} 1000", "} 2000").replace("} 2\n", "} 5\n")
    after = parse_prometheus(later)
    r = server_readings(before, after, [0.2, 0.6])
    assert r["prometheus_cache_hit_rate"] == pytest.approx(0.4)
    assert r["kv_cache"] == {
        "usage_mean": pytest.approx(0.4),
        "usage_max": 0.6,
        "capacity_tokens": 1600.0,
        "preemptions": 3,
    }
    assert server_readings([], [], []) == {}
