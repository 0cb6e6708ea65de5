#!/usr/bin/env bash
# Check and measure a chain of stacked kernel steps from wip/ in one device call, e.g.
#   source .dk/bin/env.sh && bash tools/try_wip_chain.sh bwd-stats-smem bwd-scale-fold bwd-early-dv bwd-80-rows bwd-stats-tma
# Each NAME is a wip/ folder whose patch series contains the previous one's (each folder holds
# the whole stack up to its step). Steps:
#   1. the GPU tests of the last step (the whole stack); on a failure, those of the earlier
#      steps too, to find the step that broke;
#   2. the kernel-alone benchmark for main and every step, back to back in one run each, so
#      that each step's gain is its row minus the previous one (same machine, same minutes);
#   3. the end-to-end backward (bench_ffa.py --bwd) for main and the last step.
# Logs go to $OUT (or ./gpu_logs). PART=tests, PART=kernels or PART=step runs only step 1, 2
# or 3 (+ the extra timings of the last step), each within one 10-minute device call.
# PART=ncu: Nsight Compute on main's and the last step's backward kernel beside FA4's (full and
# causal 8k): time, instructions executed and tensor-pipe activity, which says whether the
# stack's fewer instructions per row (tools/sass_mix.py) became time.
set -uo pipefail
(($#)) || { echo "usage: try_wip_chain.sh NAME..." >&2; exit 2; }
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$root/gpu_logs}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore CUTE_DSL_ARCH=${CUTE_DSL_ARCH:-sm_90a}
src_path() { local base=$1 p=""; for d in "$base"/packages/*/src; do p="$p:$d"; done; echo "${p#:}"; }
filter() { grep -v "aux_data\|exe_args"; }
declare -A tree
for name in "$@"; do
  [[ -d $root/wip/$name ]] || { echo "no wip/$name" >&2; exit 2; }
  tree[$name]=$(mktemp -d)
  cp -r "$root/packages" "$root/tools" "$root/pyproject.toml" "$root/conftest.py" "${tree[$name]}/"
  (cd "${tree[$name]}" && git apply "$root"/wip/"$name"/*.patch) || { echo "wip/$name does not apply" >&2; exit 2; }
done
tests=(packages/ffa-kernels/tests/test_cute_bwd_gpu.py)
run_tests() {
  local name=$1
  echo "== GPU tests of wip/$name"
  (cd "${tree[$name]}" && PYTHONPATH=$(src_path "${tree[$name]}") timeout 240 python3 -m pytest -q \
    -p no:cacheprovider -m gpu -n 4 "${tests[@]}") 2>&1 | filter | tail -8 | tee "$out/chain_${name}_tests.log"
  return "${PIPESTATUS[0]}"
}
rc=0
last=${!#}
part=${PART:-all}
if [[ $part == all || $part == tests ]] && ! run_tests "$last"; then
  rc=1
  # find the step that broke: the earlier steps from the last one down, until one passes (or
  # the call's 10 minutes run short)
  steps=("$@")
  for ((i = ${#steps[@]} - 2; i >= 0; i--)); do
    ((SECONDS > 330)) && { echo "== out of time: steps before ${steps[i + 1]} not tested"; break; }
    run_tests "${steps[i]}" && { echo "== ${steps[i]} passes: ${steps[i + 1]} broke"; break; }
  done
fi
finish() {
  for name in "$@"; do rm -rf "${tree[$name]}"; done
  exit $rc
}
[[ $part == tests ]] && finish "$@"
# bench SIDE SECONDS LINES LOG ARGS...: a tools/ script run on main's tree or a step's tree
bench() {
  local side=$1 secs=$2 lines=$3 log=$4 path dir
  shift 4
  if [[ $side == main ]]; then path=$(src_path "$root") dir=$root/tools; else path=$(src_path "${tree[$side]}") dir=${tree[$side]}/tools; fi
  echo "== $side: $*"
  (cd "$dir" && PYTHONPATH=$path FFA_CACHE_DIR=$(mktemp -d) timeout "$secs" python3 "$@") 2>&1 | filter \
    | tail -"$lines" | tee "$out/$log"
}
if [[ $part == ncu ]]; then
  metrics=gpu__time_duration.sum,smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
  for side in main "$last"; do
    if [[ $side == main ]]; then path=$(src_path "$root") dir=$root/tools; else path=$(src_path "${tree[$last]}") dir=${tree[$last]}/tools; fi
    for mask in full causal; do
      echo "== ncu $side $mask"
      (cd "$dir" && PYTHONPATH=$path FFA_CACHE_DIR=$(mktemp -d) timeout 200 ncu --clock-control none \
        -k regex:"FFABackwardSm90|FlashAttentionBackwardSm90" --launch-skip 2 --launch-count 2 --metrics "$metrics" \
        python3 ncu_bwd.py "$mask") 2>&1 | grep -E "BackwardSm90|gpu__time|inst_executed|hmma" \
        | tee -a "$out/chain_ncu_$side.log"
    done
  done
  finish "$@"
fi
kernel_bench=(bench_bwd_kernel.py --cases full8k,causal8k,causal8k_d64,varlen_causal32k --variants base)
if [[ $part == all || $part == kernels ]]; then
  for side in main "$@"; do bench "$side" 90 8 "chain_bench_$side.log" "${kernel_bench[@]}"; done
fi
[[ $part == kernels ]] && finish "$@"
step=(bench_ffa.py --bwd --cases full8k,causal8k,causal8k_d64,varlen_causal32k,gqa_varlen_causal32k,swa8k --no-flex
  --iters 10 --rounds 3)
for side in main "$last"; do bench "$side" 200 14 "chain_step_$side.log" "${step[@]}"; done
# steps whose new configuration is not a default yet: time it beside the default (same tree)
case $last in
  bwd-80-rows | bwd-stats-tma)
    bench "$last" 150 12 "chain_extra_$last.log" bench_bwd_kernel.py \
      --cases full8k,varlen_causal32k,gqa_varlen_causal32k,causal8k --variants base,tile_m80
    ;;
esac
# D 64 with 128-row blocks (spill-free since bwd-stats-smem; measured slower before it)
bench "$last" 120 8 "chain_extra_d64_$last.log" bench_bwd_kernel.py --cases causal8k_d64,full8k_d64 \
  --variants base,tile_m128
finish "$@"
