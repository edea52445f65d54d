#!/usr/bin/env bash
# Device call: forward benchmark with the Triton kernels (fast path) and the dequantised
# reference path on a subset. Results under $OUT.
set -uo pipefail
pip install -q --no-deps .device_wheels/*.whl 2>&1 | tail -1
export PYTHONPATH=$PWD
COMMON="--config v41 --num-layers 8 --num-experts 64 --device cuda --dtype bfloat16 --warmup 1 --iters 3"
timeout 330 python -m dsv4.cli bench forward $COMMON --no-baseline --json "$OUT/forward_fast.json" \
  d1_8k=1*1@8192 d8_32k=8*1@32768 d64_32k=64*1@32768 d256_8k=256*1@8192 d1_128k=1*1@131072 d64_128k=64*1@131072 \
  p8k=8192 hit=1024@100000 2>&1 | grep -v Warning | tail -45
timeout 150 python -m dsv4.cli bench forward $COMMON --no-breakdown --json "$OUT/forward_ref.json" \
  d1_8k=1*1@8192 d64_32k=64*1@32768 p8k=8192 2>&1 | grep -v Warning | tail -20
