#!/usr/bin/env bash
# Check and measure a stack of backward-kernel steps in one wip/ folder (one step per patch):
#   source .dk/bin/env.sh && bash tools/try_wip_chain.sh FOLDER [N ...]
# Step N is the folder's first N patches (default: every N); each step is a scratch tree
# (tools/wip_lib.sh). Parts:
#   1. the GPU tests of the last step (the whole stack); on a failure, those of the earlier
#      steps from the last down until one passes, to find the step that broke;
#   2. the kernel-alone benchmark for main and every step, back to back in one run each, so
#      that each step's gain is its row minus the previous one (same machine, same minutes);
#   3. the end-to-end backward (bench_ffa.py --bwd) for main and the last step, and the
#      64-row q blocks (softcap's configuration) beside the default on the last step.
# PART=tests, PART=kernels or PART=step runs only part 1, 2 or 3, each within one 10-minute
# device call (five or six steps do not fit one call: pick some N). PART=ncu: Nsight
# Compute on main's and the last step's backward kernel beside FA4's (full and causal 8k): time,
# instructions executed and tensor-pipe activity, which says whether the stack's fewer
# instructions per row (tools/sass_mix.py) became time. Logs go to $OUT (or ./gpu_logs).
set -uo pipefail
folder=${1:?usage: try_wip_chain.sh FOLDER [N ...]}
shift
source "$(dirname "$0")/wip_lib.sh"
mapfile -t patches < <(wip_patches "$folder")
((${#patches[@]})) || exit 2
steps=("$@")
((${#steps[@]})) || mapfile -t steps < <(seq 1 "${#patches[@]}")
declare -A tree
for n in "${steps[@]}"; do
  echo "step $n: ${patches[n - 1]##*/}"
  tree[$n]=$(patched_tree "$folder" "$n") || exit 2
done
last=${steps[-1]}
part=${PART:-all}
rc=0
finish() {
  for n in "${steps[@]}"; do rm -rf "${tree[$n]}"; done
  exit $rc
}
# tree_of SIDE: main's tree or step SIDE's scratch tree
tree_of() { if [[ $1 == main ]]; then echo "$root"; else echo "${tree[$1]}"; fi; }
run_tests() {
  echo "== GPU tests of $folder step $1"
  (cd "${tree[$1]}" && PYTHONPATH=$(src_path "${tree[$1]}") timeout 240 python3 -m pytest -q \
    -p no:cacheprovider -m gpu -n 4 packages/ffa-kernels/tests/test_cute_bwd_gpu.py) 2>&1 | filter \
    | tee "$out/chain_${folder}_$1_tests.log" | tail -8
  return "${PIPESTATUS[0]}"
}
# bench SIDE SECONDS LINES ARGS...: a tools/ script run on main's tree or a step's tree
bench() {
  local side=$1 secs=$2 lines=$3
  shift 3
  echo "== $side: $*"
  run_tool "$(tree_of "$side")" "chain_${folder}_$side.log" "$secs" "$lines" python3 "$@"
}
if [[ $part == all || $part == tests ]] && ! run_tests "$last"; then
  rc=1
  for ((i = ${#steps[@]} - 2; i >= 0; i--)); do
    ((SECONDS > 330)) && { echo "== out of time: steps before ${steps[i + 1]} not tested"; break; }
    run_tests "${steps[i]}" && { echo "== step ${steps[i]} passes: step ${steps[i + 1]} broke"; break; }
  done
fi
[[ $part == tests ]] && finish
if [[ $part == ncu ]]; then
  metrics=gpu__time_duration.sum,smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
  for side in main "$last"; do
    for mask in full causal; do
      echo "== ncu $side $mask"
      run_tool "$(tree_of "$side")" "chain_${folder}_ncu_$side.log" 200 0 ncu --clock-control none \
        -k regex:"FFABackwardSm90|FlashAttentionBackwardSm90" --launch-skip 2 --launch-count 2 --metrics "$metrics" \
        python3 ncu_bwd.py "$mask"
      grep -E "BackwardSm90|gpu__time|inst_executed|hmma" "$out/chain_${folder}_ncu_$side.log" | tail -6
    done
  done
  finish
fi
if [[ $part == all || $part == kernels ]]; then
  for side in main "${steps[@]}"; do
    bench "$side" 90 8 bench_bwd_kernel.py --cases full8k,causal8k,causal8k_d64,varlen_causal32k --variants base
  done
fi
[[ $part == kernels ]] && finish
for side in main "$last"; do
  bench "$side" 200 14 bench_ffa.py --bwd --no-flex --iters 10 --rounds 3 \
    --cases full8k,causal8k,causal8k_d64,varlen_causal32k,gqa_varlen_causal32k,swa8k
done
# 64-row q blocks (the softcap configuration) beside the defaults (80 rows at D 128, 128 at D 64)
bench "$last" 200 16 bench_bwd_kernel.py --cases full8k,causal8k,varlen_causal32k,causal8k_d64,full8k_d64 \
  --variants base,tile_m64
finish
