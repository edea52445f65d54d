#!/usr/bin/env bash
# One device call: kernel checks and sweeps at real shapes, every kernel call of a real forward
# against its reference, the golden sets on CUDA (greedy with vs without CUDA graphs), the
# forward benchmark. Prepare here first (bash scripts/prepare_device.sh), then
#   run(command="bash scripts/device_run.sh", carry=["devdata", ".device_wheels"])
# Knobs (environment): STEPS (default kernels,insitu,golden,bench,exact,baseline; also insitu8 and bench8: the
# same with FP8 activations, insitu4: with FP4 experts, insitu_v4, golden_v4 and bench_v4: V4-Flash, ab, ncu,
# ncu_source, profile, kernels_ab), KERNEL_SECTIONS,
# KERNEL_BUDGET (s), BENCH_CASES, BENCH_FLAGS, BENCH_TIMEOUT (s), EXACT_CASES, EXACT_TIMEOUT,
# BASELINE_CASES, BASELINE_TIMEOUT, BASELINE_CONFIG (v41 or v4), NCU_CASES, NCU_TIMEOUT (steps ncu and ncu_source;
# ncu_source also NCU_KERNELS (a regex), NCU_SKIP, NCU_COUNT: launches skipped / profiled), AB_CASES + AB_ENV (the bench's cases again under other kernel
# knobs, one run per ';'-separated variant: AB_ENV="KNOBS=...;KNOBS='... ...'" (a variant is eval'd: quote a value with spaces), or bench flags: AB_ENV="AB_FLAGS=--fp4-experts"), KNOBS (module globals or dict entries the bench, profile, insitu* and golden* steps run under, Python literals:
# KNOBS="dsv4.ops.triton.fp8_gemm:W8A16.DEQUANT='bytes' dsv4.ops.triton.moe:MOE.PAIR_TILES_MAX_PAIRS=0"; a dotted path
# walks nested tables, digits indexing tuples: KNOBS=dsv4.ops.triton.moe:MOE.rows.4.1.gate_up.maxnreg=128),
# PROFILE_CASES, PROFILE_ARGS (per-kernel table of graph replays, step `profile`, under the KNOBS as well; PROFILE_ARGS=--torch-ops adds
# the eager step's aten ops by source line, --timeline one replay's kernels in order in profile.json),
# TRITON_CACHE_OUT=1 (the compiled kernels back under $OUT, to carry as tcache/ into the next call: below).
# Results under $OUT.
set -uo pipefail
pip install -q --no-deps .device_wheels/*.whl 2>&1 | tail -1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
STEPS=${STEPS:-kernels,insitu,golden,bench,exact,baseline}
LOG=$OUT/log.txt
# (scripts/prepare_device.sh; a call that only benchmarks may leave devdata behind)
[ -f devdata/golden.tgz ] && mkdir -p devdata/golden && tar xzf devdata/golden.tgz -C devdata/golden
# Every call starts a fresh machine, whose first process compiles every kernel it launches
# (~150 s of device time, S27-1). TRITON_CACHE_OUT=1 sends Triton's cache back as
# $OUT/tcache.tar.xz.NN (`send_triton_cache`, at the end); copied into tcache/ here and carried,
# it is restored at the same path (`restore_triton_cache`), so kernels whose source is
# unchanged load instead of compiling. A cache hit needs a kernel's metadata .json and .cubin
# only (Triton skips the missing IR files of a group); .ptx is kept for check_kernels' compile
# section, the launchers' .so for the launch.
TRITON_CACHE=${TRITON_CACHE_DIR:-${HOME:-}/.triton/cache}  # (Triton's default place)
restore_triton_cache() {
  ls tcache/tcache.tar.xz.* >/dev/null 2>&1 || return 0
  mkdir -p "$TRITON_CACHE" && cat tcache/tcache.tar.xz.* | tar xJf - -C "$TRITON_CACHE"
  echo "triton cache: $(find "$TRITON_CACHE" -name '*.cubin' | wc -l) compiled kernels restored" | tee -a "$LOG"
}
send_triton_cache() {
  [ -n "${TRITON_CACHE_OUT:-}" ] && [ -d "$TRITON_CACHE" ] || return 0
  (cd "$TRITON_CACHE" && find . \( -name '*.json' -o -name '*.cubin' -o -name '*.ptx' -o -name '*.so' \) -print0 | tar cJf - --null -T -) \
    | split -b 15m -d - "$OUT/tcache.tar.xz."
  echo "triton cache sent back: $(find "$TRITON_CACHE" -name '*.cubin' | wc -l) kernels, $(du -ch "$OUT"/tcache.tar.xz.* | tail -1 | cut -f1)" | tee -a "$LOG"
}
restore_triton_cache
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv; git log -1 --format=%H 2>/dev/null; git status --short 2>/dev/null | head -30; } | tee "$OUT/gpu.txt"

want() { [[ ",$STEPS," == *",$1,"* ]]; }

# Why a timed run printed no table: its exit status (124: its timeout; a call's first process
# compiles every kernel, >100 s on a fresh machine, S27-1)
exit_said() {  # exit_said RC WHAT LIMIT
  [ "$1" = 0 ] && return
  echo "$2: exit $1$([ "$1" = 124 ] && echo " (timed out after $3 s; the first process compiles every kernel: give it ~200 s)")" | tee -a "$LOG"
}

# `knobbed LIMIT SCRIPT ARGS...`: python SCRIPT ARGS (SCRIPT "dsv4": the dsv4 CLI) under
# `timeout LIMIT` and the KNOBS (below, the kernels step adds MoE byte reads when the
# real-shape MoE check fails on this GPU); `bench LIMIT ARGS...`: `dsv4 bench forward` so.
knobbed() {
  local limit=$1
  shift
  timeout "$limit" python -P - "$@" <<PY  # -P: no cwd on sys.path, so PYTHONPATH picks the tree (AB_ENV's ab_old)
import ast
import importlib
import runpy
import sys
for knob in "${KNOBS:-}".split():  # module:NAME=value or module:DICT.key=value (a Python literal)
    target, value = knob.split("=", 1)
    module, name = target.split(":")
    mod, value = importlib.import_module(module), ast.literal_eval(value)
    if "." in name:  # DICT.key, or a path into nested tables: MOE.rows.4.1.gate_up.maxnreg (digits index tuples)
        head, *path, last = name.split(".")
        table = getattr(mod, head)
        for key in path:
            table = table[int(key) if key.isdigit() else key]
        table[last] = value
    else:
        setattr(mod, name, value)
    print(f"knob {knob}")
script, *args = sys.argv[1:]
if script == "dsv4":
    from dsv4.cli import main
    sys.exit(main(args))
sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
PY
}
bench() {
  local limit=$1
  shift
  knobbed "$limit" dsv4 bench forward "$@"
}

if want kernels; then
  echo "=== kernels" | tee -a "$LOG"
  timeout $(( ${KERNEL_BUDGET:-200} + 40 )) python scripts/check_kernels.py --budget "${KERNEL_BUDGET:-200}" \
    ${KERNEL_SECTIONS:+--sections $KERNEL_SECTIONS} >>"$LOG" 2>&1
  echo "rc=$?" | tee -a "$LOG"
  grep -E "FAIL|ERROR|best|sweep" "$LOG" | tail -40
  if grep -qE "^moe_experts .*(FAIL|illegal)" "$LOG"; then
    export KNOBS="${KNOBS:-} dsv4.ops.triton.moe:MOE.DEQUANT='bytes'"
    echo "moe_experts failed at real shapes: the benchmarks run MOE['DEQUANT'] = bytes" | tee -a "$LOG"
  fi
fi
if want insitu; then
  echo "=== insitu" | tee -a "$LOG"
  knobbed 150 scripts/check_fast_path.py devdata/golden/v41-tiny-a --prompts 1,3,4 --steps 4 2>&1 | tee -a "$LOG" | tail -20
fi
if want insitu8; then  # the same with FP8 activations (--fp8-activations)
  echo "=== insitu8" | tee -a "$LOG"
  knobbed 150 scripts/check_fast_path.py devdata/golden/v41-tiny-a --prompts 1,3,4 --steps 4 --fp8-activations 2>&1 | tee -a "$LOG" | tail -20
fi
if want insitu4; then  # the same with the experts kept FP4 (--fp4-experts)
  echo "=== insitu4" | tee -a "$LOG"
  knobbed 150 scripts/check_fast_path.py devdata/golden/v41-tiny-a --prompts 1,3,4 --steps 4 --fp4-experts 2>&1 | tee -a "$LOG" | tail -20
fi
if want insitu_v4; then  # V4-Flash's fast path (bf16 caches, HCA, overlapping compressors)
  echo "=== insitu_v4" | tee -a "$LOG"
  knobbed 150 scripts/check_fast_path.py devdata/golden/v4-tiny-a --prompts 1,3,4 --steps 4 2>&1 | tee -a "$LOG" | tail -20
fi
if want golden; then
  echo "=== golden" | tee -a "$LOG"
  knobbed 240 scripts/gpu_golden.py devdata/golden/v41-tiny-a 2>&1 | grep -v Warning | tee -a "$LOG" | tail -8
fi
if want golden_v4; then
  echo "=== golden_v4" | tee -a "$LOG"
  knobbed 240 scripts/gpu_golden.py devdata/golden/v4-tiny-a 2>&1 | grep -v Warning | tee -a "$LOG" | tail -8
fi
if want bench; then
  echo "=== bench" | tee -a "$LOG"
  CASES=${BENCH_CASES:-"d1_8k=1*1@8192 d8_32k=8*1@32768 d64_32k=64*1@32768 d256_8k=256*1@8192 d64_128k=64*1@131072 p8k=8192 hit=1024@100000"}
  bench "${BENCH_TIMEOUT:-300}" --config v41 --num-layers 8 --num-experts 64 --device cuda \
    --dtype bfloat16 --warmup 2 --iters 5 --json "$OUT/forward.json" ${BENCH_FLAGS:---no-baseline} $CASES 2>&1 \
    | grep -v -E "Warning|profiler_st|warn_once" | tee -a "$LOG" | tail -45
  exit_said "${PIPESTATUS[0]}" bench "${BENCH_TIMEOUT:-300}"
fi
if want bench_v4; then  # V4-Flash's real layer dimensions (8 of 43 layers: the 2 window layers, CSA/HCA pairs)
  echo "=== bench_v4" | tee -a "$LOG"
  CASES=${BENCH_V4_CASES:-"d1_8k=1*1@8192 d8_32k=8*1@32768 d64_32k=64*1@32768 d256_8k=256*1@8192 p8k=8192 hit=1024@100000"}
  bench "${BENCH_TIMEOUT:-300}" --config v4 --num-layers 8 --num-experts 64 --device cuda \
    --dtype bfloat16 --warmup 2 --iters 5 --json "$OUT/forward_v4.json" ${BENCH_V4_FLAGS:---no-baseline} $CASES 2>&1 \
    | grep -v -E "Warning|profiler_st|warn_once" | tee -a "$LOG" | tail -45
fi
if want bench8; then  # the bench cases with FP8 activations
  echo "=== bench8" | tee -a "$LOG"
  CASES=${BENCH_CASES:-"d1_8k=1*1@8192 d8_32k=8*1@32768 d64_32k=64*1@32768 d256_8k=256*1@8192 d64_128k=64*1@131072 p8k=8192 hit=1024@100000"}
  bench "${BENCH_TIMEOUT:-300}" --config v41 --num-layers 8 --num-experts 64 --device cuda \
    --dtype bfloat16 --warmup 2 --iters 5 --json "$OUT/forward_fp8.json" --no-baseline --fp8-activations $CASES 2>&1 \
    | grep -v -E "Warning|profiler_st|warn_once" | tee -a "$LOG" | tail -45
fi
if want ab; then  # A/B: the same cases under other kernel knobs, one run per variant of AB_ENV (VAR=value ..., variants split by ';')
  IFS=';' read -ra variants <<< "$AB_ENV"
  for i in "${!variants[@]}"; do
    echo "=== ab $i (${variants[$i]})" | tee -a "$LOG"
    (eval "export ${variants[$i]}"; bench "${BENCH_TIMEOUT:-300}" --config v41 --num-layers 8 --num-experts 64 --device cuda \
      --dtype bfloat16 --warmup 2 --iters 5 --json "$OUT/forward_ab$i.json" --no-baseline ${AB_FLAGS:-} ${AB_CASES:-d1_8k=1*1@8192 d64_32k=64*1@32768} 2>&1 \
      | grep -v -E "Warning|profiler_st|warn_once" | tee -a "$LOG" | tail -30
     exit_said "${PIPESTATUS[0]}" "ab $i" "${BENCH_TIMEOUT:-300}")
  done
fi
if want kernels_ab; then  # kernel A/B: check_kernels' `defaults` section once per AB_ENV variant; AB_TREE: the tree whose
  # scripts/check_kernels.py runs (and so whose dsv4/ it imports), e.g. AB_ENV="AB_TREE=ab_old;AB_TREE=." (trees that have the section)
  IFS=';' read -ra variants <<< "$AB_ENV"
  for i in "${!variants[@]}"; do
    echo "=== kernels_ab $i (${variants[$i]})" | tee -a "$LOG"
    (eval "export ${variants[$i]}"; mkdir -p "$OUT/kernels_ab$i"
     OUT="$OUT/kernels_ab$i" timeout $(( ${KERNEL_BUDGET:-150} + 40 )) python "${AB_TREE:-.}/scripts/check_kernels.py" --sections defaults \
       --budget "${KERNEL_BUDGET:-150}" 2>&1 | tee -a "$LOG" | grep -E "^(attention_sweep|gemm_sweep|moe_prefill)|ERROR" | tail -40)
  done
fi
if want profile; then  # which kernels a step's time goes to (scripts/profile_step.py)
  echo "=== profile" | tee -a "$LOG"
  knobbed "${PROFILE_TIMEOUT:-200}" scripts/profile_step.py ${PROFILE_CASES:-d1_8k=1*1@8192 d64_32k=64*1@32768 d256_8k=256*1@8192 p8k=8192} \
    ${PROFILE_ARGS:-} --json "$OUT/profile.json" 2>&1 | grep -v -E "Warning|warn_once" | tee "$OUT/profile.txt" | tee -a "$LOG" | grep -E "^==" 
fi
# Nsight Compute, where the image has it: sets NCU, or says there is none (steps ncu, ncu_source)
have_ncu() {
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  [ -n "$NCU" ] || { echo "no ncu on this machine" | tee -a "$LOG"; return 1; }
}
NCU_KERNEL_RE='_gate_up_kernel|_down_kernel|_w8a16_kernel|_logits_kernel|_pv_kernel'  # the kernels that bound the step
if want ncu && have_ncu; then  # Nsight Compute on the bounding kernels (scripts/ncu_kernels.py)
  echo "=== ncu" | tee -a "$LOG"
  timeout "${NCU_TIMEOUT:-240}" "$NCU" --kernel-name regex:"$NCU_KERNEL_RE" \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section InstructionStats --section SourceCounters python scripts/ncu_kernels.py ${NCU_CASES:+--cases $NCU_CASES} >"$OUT/ncu.txt" 2>&1
  echo "rc=$?" | tee -a "$LOG"
  grep -E "^  _|Duration|DRAM Throughput|Achieved Occupancy|Issued Warp Per Scheduler|No Eligible|Registers Per|ERR" "$OUT/ncu.txt" | head -80
fi
if want ncu_source && have_ncu; then  # where inside the kernels the stalls and shared-memory bank conflicts are (ncu's source page)
  echo "=== ncu_source" | tee -a "$LOG"
  # each case runs its kernels twice: skip the compiling launches (NCU_SKIP), profile the next NCU_COUNT
  timeout "${NCU_TIMEOUT:-240}" "$NCU" --kernel-name regex:"${NCU_KERNELS:-$NCU_KERNEL_RE}" \
    --launch-skip "${NCU_SKIP:-0}" --launch-count "${NCU_COUNT:-4}" --section SourceCounters --import-source yes --export "$OUT/source" \
    python scripts/ncu_kernels.py ${NCU_CASES:+--cases $NCU_CASES} >"$OUT/ncu_source_run.txt" 2>&1
  echo "rc=$?" | tee -a "$LOG"
  "$NCU" --import "$OUT/source.ncu-rep" --page source --csv --print-source sass >"$OUT/ncu_source.csv" 2>>"$OUT/ncu_source_run.txt"
  rm -f "$OUT/source.ncu-rep"
  python scripts/ncu_kernels.py --summarize-source "$OUT/ncu_source.csv" 2>&1 | tee -a "$LOG" | head -80
fi
if want exact; then  # the same prefill in exact replay mode (every decoder layer on every token)
  echo "=== exact" | tee -a "$LOG"
  bench "${EXACT_TIMEOUT:-150}" --config v41 --num-layers 8 --num-experts 64 --device cuda \
    --dtype bfloat16 --warmup 1 --iters 3 --no-swa-bounded-replay --json "$OUT/forward_exact.json" ${BENCH_FLAGS:---no-baseline} \
    ${EXACT_CASES:-p32k=32768} 2>&1 | grep -v -E "Warning|profiler_st|warn_once" | tee -a "$LOG" | tail -20
fi
if want baseline; then  # the HF-style reference path (dequantised bf16 weights, torch ops) on a few cases
  echo "=== baseline" | tee -a "$LOG"
  bench "${BASELINE_TIMEOUT:-150}" --config "${BASELINE_CONFIG:-v41}" --num-layers 8 --num-experts 64 --device cuda \
    --dtype bfloat16 --warmup 1 --iters 3 --baseline --no-breakdown --json "$OUT/forward_baseline.json" \
    ${BASELINE_CASES:-d1_8k=1*1@8192 d64_32k=64*1@32768 p8k=8192} 2>&1 | grep -v -E "Warning|profiler_st|warn_once" | tee -a "$LOG" | tail -12
fi
send_triton_cache
