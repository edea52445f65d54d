"""`dsv4 bench serve` / `bench plot` end to end against the fake streaming server."""

import argparse
import json

from dsv4.bench import cli
from dsv4.bench.report import read_runs

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NUM = (int, float)
LATENCY_KEYS = [
    f"{stat}_{metric}"
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
    for stat in ("mean", "median", "std", "p50", "p90", "p99")
]
SCHEMA = {
    # vLLM-compatible keys
    "duration": NUM,
    "completed": int,
    "failed": int,
    "total_input_tokens": int,
    "total_output_tokens": int,
    "request_throughput": NUM,
    "output_throughput": NUM,
    "total_token_throughput": NUM,
    "max_concurrency": int,
    "num_prompts": int,
    **dict.fromkeys(LATENCY_KEYS, NUM),
    # agentic extensions
    "num_gpus": int,
    "seed": int,
    "workload_profile": str,
    "workload_sha256": str,
    "concurrency": int,
    "sessions_completed": int,
    "total_cached_input_tokens": int,
    "total_uncached_input_tokens": int,
    "theoretical_cache_hit_rate": NUM,
    "server_cache_hit_rate": NUM,
    "per_gpu": dict,
    "intvty": dict,
    "e2e_norm_intvty": dict,
    "kv_cache": dict,
    "request_accounting": dict,
    "spec_decode": dict,
    "engine": str,
    "engine_version": str,
    "parallelism": str,
}


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dsv4 bench")
    cli.register(parser.add_subparsers(dest="bench_command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def _serve(base: str, out, *extra: str) -> int:
    argv = [
        "serve",
        "--base-url",
        base,
        "--model",
        "fake-model",
        "--output-dir",
        str(out),
        "--token-range",
        "1000,32000",
    ]
    return _main(argv + list(extra))


def test_serve_smoke_then_plot(fake_server, tmp_path, capsys):
    base, state = fake_server
    out = tmp_path / "run"
    rc = _serve(
        base,
        out,
        "--workload",
        "agentx-synth",
        "--profile",
        "smoke",
        "--concurrency",
        "1,2",
        "--duration",
        "1.5",
        "--num-gpus",
        "2",
        "--parallelism",
        "TP2",
        "--save-detailed",
    )
    assert rc == 0
    console = capsys.readouterr().out
    for text in ("conc", "tok/s/GPU", "e2e-norm", "Pareto points", "tok/s/GPU @ P90 e2e_norm_intvty"):
        assert text in console

    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["concurrency"] for r in results] == [1, 2]
    for r in results:
        for key, kind in SCHEMA.items():
            assert isinstance(r[key], kind), (key, r[key])
        assert len(r["workload_sha256"]) == 64
        assert set(r["per_gpu"]) >= {"total_tput_tps", "input_tput_tps", "output_tput_tps"}
        assert set(r["intvty"]) == set(r["e2e_norm_intvty"]) == {"mean", "p50", "p75", "p90", "p95"}
        assert set(r["kv_cache"]) == {"usage_mean", "usage_max", "capacity_tokens", "preemptions"}
        assert set(r["request_accounting"]) == {
            "total",
            "warmup_dropped",
            "warmup_errors",
            "error_dropped",
            "error_categories",
        }
        assert r["completed"] > 0 and r["failed"] == 0 and r["num_gpus"] == 2
        assert r["request_accounting"]["warmup_dropped"] >= 1
        assert r["per_gpu"]["total_tput_tps"] * 2 == r["total_token_throughput"]
        assert r["engine"] == "fake" and r["server_cache_hit_source"] == "usage"
        assert 0 < r["server_cache_hit_rate"] < 1 and r["kv_cache"]["capacity_tokens"] == 16000
    assert results[0]["workload_sha256"] == results[1]["workload_sha256"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["frontier_concurrency"] and set(summary["iso_e2e_norm_intvty"]) == {"20", "30", "50", "100", "150"}
    assert (out / "pareto.png").read_bytes()[:8] == PNG_MAGIC
    assert len(list(out.glob("detailed_*_c*.jsonl"))) == 2

    # What the server saw: streamed token-id completions with the AgentX request options.
    assert state.requests and all(r["host"] == base.removeprefix("http://") for r in state.requests)
    for r in state.requests:
        assert r["stream"] is True and r["stream_options"] == {"include_usage": True} and r["ignore_eos"] is True
        assert all(isinstance(t, int) and 1000 <= t < 32000 for t in r["prompt"])
    assert any(r["max_tokens"] == 1 for r in state.requests)  # warm-up calls

    fig = tmp_path / "fig.png"
    assert _main(["plot", str(out / "results.jsonl"), str(out / "results.jsonl"), "--out", str(fig)]) == 0
    assert fig.read_bytes()[:8] == PNG_MAGIC
    assert len(read_runs([out / "results.jsonl", out / "results.jsonl"])) == 2


def test_chat_and_trace_workloads(fake_server, tmp_path, traces_dir):
    base, state = fake_server
    assert (
        _serve(base, tmp_path / "chat", "--profile", "smoke", "--chat", "--concurrency", "2", "--duration", "0.5") == 0
    )
    assert state.requests and all("messages" in r for r in state.requests)
    chat = json.loads((tmp_path / "chat" / "results.jsonl").read_text())
    assert chat["completed"] > 0 and chat["api"] == "chat"

    state.requests.clear()
    rc = _serve(
        base,
        tmp_path / "trace",
        "--workload",
        "weka-trace",
        "--trace-dir",
        str(traces_dir),
        "--concurrency",
        "2",
        "--duration",
        "0.5",
    )
    assert rc == 0
    trace = json.loads((tmp_path / "trace" / "results.jsonl").read_text())
    assert trace["completed"] >= 2 and trace["failed"] == 0 and trace["isl_mismatch_requests"] == 0
    # Warm start: each lane's first profiled call re-reads the warm-up prompt's prefix.
    assert trace["theoretical_cache_hit_rate"] > 0.5 and trace["server_cache_hit_rate"] > 0.5


def test_unreachable_server_fails_cleanly(tmp_path, capsys):
    assert _serve("http://127.0.0.1:9", tmp_path, "--profile", "smoke", "--concurrency", "1", "--duration", "0.1") == 1
    assert "cannot use http://127.0.0.1:9: ConnectError(" in capsys.readouterr().out  # which server, and why
