#!/usr/bin/env bash
# GPU checks and benchmarks, run on the device machine after the kit is booted:
#   source .dk/bin/env.sh && bash tools/gpu_check.sh tests|bench-ffa|bench-dist|all
# Logs go to $OUT (or ./gpu_logs). Needs 2 GPUs for the distributed parts. The training step
# (cp training against one GPU, peer failures, bench_dist --step, cp 4/8 rows): tools/gpu_multi.sh.
set -uo pipefail
out=${OUT:-gpu_logs}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore CUTE_DSL_ARCH=${CUTE_DSL_ARCH:-sm_90a}
ngpu=$(nvidia-smi -L | wc -l)
what=${1:-all}
rc=0
# step LOG N CMD...: run CMD with its output in $out/LOG, show the last N lines (without the CuTe
# DSL's argument dumps); a failing CMD makes the script exit 1.
step() {
  local log=$1 n=$2
  shift 2
  echo "== $*"
  "$@" >"$out/$log" 2>&1 || rc=1
  grep -v "aux_data\|exe_args" "$out/$log" | tail -n "$n"
}
if [[ $what == tests || $what == all ]]; then
  nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
  step gpu_tests.log 15 timeout 420 python3 -m pytest -q -p no:cacheprovider --continue-on-collection-errors -m gpu packages/ffa-kernels packages/magi-comm packages/magi-dist
  if (( ngpu >= 2 )); then
    step cp_train.log 8 timeout 180 torchrun --standalone --nproc-per-node 2 examples/cp_train.py --steps 5
  fi
fi
if [[ $what == bench-ffa || $what == all ]]; then
  step bench_ffa.log 12 timeout 480 python3 tools/bench_ffa.py --iters 20 --check --max-logits
fi
if [[ $what == bench-dist || $what == all ]] && (( ngpu >= 2 )); then
  step bench_dist.log 10 timeout 420 torchrun --standalone --nproc-per-node 2 tools/bench_dist.py
fi
exit $rc
