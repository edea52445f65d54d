#!/usr/bin/env bash
# Prepares the git-ignored folders a device call carries (the device has no network):
#   .device_wheels/       rich and its pure-Python dependencies (not on the device image)
#   devdata/golden.tgz    the V4.1 and V4 golden sets for scripts/gpu_golden.py and
#                         scripts/check_fast_path.py (the device gets no ../shared; packed,
#                         since a call carries at most 64 MiB), unpacked by device_run.sh
# Then: run(command="bash scripts/device_bench.sh", carry=[".device_wheels"]) or
#       run(command="bash scripts/device_run.sh", carry=["devdata", ".device_wheels"]).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .device_wheels devdata
.venv/bin/pip download -q --no-deps -d .device_wheels rich markdown-it-py mdurl pygments
tar czf devdata/golden.tgz -C "${DSV4_SHARED:-../shared}/golden" v41-tiny-a v4-tiny-a
