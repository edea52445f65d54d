#!/usr/bin/env bash
# Prepares the git-ignored folders a device call carries (the device has no network):
#   .device_wheels/  rich and its pure-Python dependencies (not on the device image)
#   devdata/golden/  one golden set for scripts/gpu_golden.py (the device gets no ../shared)
# Then: run(command="bash scripts/device_bench.sh", carry=[".device_wheels"]) or
#       run(command="bash scripts/device_run.sh", carry=["devdata", ".device_wheels"]).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .device_wheels devdata/golden
.venv/bin/pip download -q --no-deps -d .device_wheels rich markdown-it-py mdurl pygments
cp -r "${DSV4_SHARED:-../shared}/golden/v41-tiny-a" devdata/golden/
