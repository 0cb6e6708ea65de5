#!/usr/bin/env bash
# GPU checks and benchmarks, run on the device machine after the kit is booted:
#   source .dk/bin/env.sh && bash tools/gpu_check.sh tests|bench-ffa|bench-dist|all
# Logs go to $OUT (or ./gpu_logs). Needs 2 GPUs for the distributed parts.
set -uo pipefail
out=${OUT:-gpu_logs}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore CUTE_DSL_ARCH=${CUTE_DSL_ARCH:-sm_90a}
ngpu=$(nvidia-smi -L | wc -l)
what=${1:-all}
rc=0
step() { echo "== $*"; "$@" || rc=1; }
if [[ $what == tests || $what == all ]]; then
  nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
  step timeout 420 python3 -m pytest -q -p no:cacheprovider --continue-on-collection-errors -m gpu packages/ffa-kernels packages/magi-comm packages/magi-dist 2>&1 | tee "$out/gpu_tests.log" | tail -15
  if (( ngpu >= 2 )); then
    step timeout 180 torchrun --standalone --nproc-per-node 2 examples/cp_train.py --steps 5 2>&1 | tee "$out/cp_train.log" | tail -8
  fi
fi
if [[ $what == bench-ffa || $what == all ]]; then
  step timeout 480 python3 tools/bench_ffa.py --iters 20 --check --max-logits 2>&1 | grep -v "aux_data\|exe_args" | tee "$out/bench_ffa.log" | tail -12
fi
if [[ $what == bench-dist || $what == all ]] && (( ngpu >= 2 )); then
  step timeout 420 torchrun --standalone --nproc-per-node 2 tools/bench_dist.py 2>&1 | tee "$out/bench_dist.log" | tail -10
fi
exit $rc
