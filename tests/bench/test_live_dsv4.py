"""`dsv4 bench serve` against a live `dsv4 serve` (tiny random V4.1 model on 127.0.0.1): the
AgentX-synth smoke profile and the random workload produce the table, a schema-checked JSONL
and the Pareto PNG, and the server ends holding no KV. (Real Weka traces carry ~100K-token
prompts, too long for a CPU smoke run; their replay structure is tested in test_traces.py.)"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
import uvicorn

from dsv4.cli import main as dsv4_main
from dsv4.engine.async_engine import AsyncEngine
from dsv4.engine.engine import LLMEngine
from dsv4.model.make_tiny import write_tiny_checkpoint
from dsv4.server.app import create_app

REQUIRED_KEYS = {
    "duration": float, "completed": int, "failed": int, "total_input_tokens": int, "total_output_tokens": int,
    "request_throughput": float, "output_throughput": float, "total_token_throughput": float,
    "max_concurrency": int, "concurrency": int, "num_gpus": int, "workload_sha256": str,
    "per_gpu": dict, "intvty": dict, "e2e_norm_intvty": dict, "request_accounting": dict,
}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "v41", "v41", seed=0)
    engine = AsyncEngine(LLMEngine(folder, progress=False, max_model_len=8192, block_size=64, kv_cache_memory=64 << 20, max_num_seqs=8))
    config = uvicorn.Config(create_app(engine, served_model_name="dsv4-tiny"), host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", engine
    server.should_exit = True
    thread.join(timeout=30)
    engine.shutdown()
    torch.set_num_threads(threads)


def _check_run(out_dir, points):
    lines = [json.loads(x) for x in (out_dir / "results.jsonl").read_text().splitlines() if x.strip()]
    assert len(lines) == points
    for rec in lines:
        for key, kind in REQUIRED_KEYS.items():
            assert isinstance(rec[key], kind), f"{key}: {type(rec[key]).__name__}"
        assert rec["completed"] > 0
        assert rec["total_input_tokens"] > 0 and rec["total_output_tokens"] > 0
    png = (out_dir / "pareto.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    return lines


def test_agentx_smoke_against_live_dsv4_serve(live, tmp_path):
    url, engine = live
    out = tmp_path / "synth"
    rc = dsv4_main([
        "bench", "serve", "--base-url", url, "--model", "dsv4-tiny", "--workload", "agentx-synth", "--profile", "smoke",
        "--concurrency", "1,2", "--duration", "6", "--num-gpus", "1", "--output-dir", str(out), "--max-requests", "16",
        "--token-range", "1000,120000", "--no-early-stop",
    ])
    assert rc == 0
    lines = _check_run(out, 2)
    assert all(rec["request_accounting"]["error_dropped"] == 0 for rec in lines)
    stats = engine.stats()
    assert stats["blocks_used"] == 0 and stats["running"] == 0


def test_bench_plot_overlays_runs(live, tmp_path):
    url, _ = live
    out = tmp_path / "rand"
    rc = dsv4_main([
        "bench", "serve", "--base-url", url, "--model", "dsv4-tiny", "--workload", "random", "--input-len", "64",
        "--output-len", "4", "--concurrency", "2", "--duration", "3", "--num-gpus", "1", "--output-dir", str(out),
        "--max-requests", "6",
    ])
    assert rc == 0
    _check_run(out, 1)
    fig = tmp_path / "both.png"
    assert dsv4_main(["bench", "plot", str(out / "results.jsonl"), str(out / "results.jsonl"), "--out", str(fig)]) == 0
    assert fig.read_bytes()[:4] == b"\x89PNG"
