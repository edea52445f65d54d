#!/usr/bin/env bash
# One device call: kernel checks and timings, GPU golden check, forward benchmark.
# Usage (device tool): bash scripts/device_run.sh   (results under $OUT)
set -uo pipefail
pip install -q --no-deps .device_wheels/*.whl 2>&1 | tail -1
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
git log -1 --format=%H > "$OUT/commit.txt" 2>/dev/null || true
timeout 150 python scripts/check_kernels.py 2>&1 | tail -60
timeout 120 python scripts/gpu_golden.py devdata/golden/* 2>&1 | tail -20
timeout 280 python -m dsv4.cli bench forward --config v41 --num-layers 8 --num-experts 64 --device cuda --dtype bfloat16 \
  --warmup 1 --iters 3 --json "$OUT/forward.json" \
  d1=1*1@8192 d8=8*1@32768 d64=64*1@32768 d256=256*1@8192 p8k=8192 hit=1024@100000 2>&1 | tail -80
