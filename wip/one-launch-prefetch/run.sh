#!/usr/bin/env bash
# wip/one-launch-prefetch on 2 GPUs (nvidia-h100-x2), one device call (~6 min):
#   source .dk/bin/env.sh && bash wip/one-launch-prefetch/run.sh
# With the patch (the one-launch reduction loads its next tile's term tables while this tile's
# reads are in flight): gpu_native_check.py with the known arm on, then bench_comm --sizes 16,64
# with the known arm on, patched / main / patched / main (reduce-sym host ahead is the row:
# issue 19's 80% at 64 MiB; 79.5-79.6% before, docs/perf.md "group_reduce: the arm known").
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MAGI_COMM_NATIVE_KNOWN_ARMS=1
out=${OUT:-gpu_logs}
mkdir -p "$out"
patch=(wip/one-launch-prefetch/*.patch)
rc=0
git apply "${patch[@]}" || exit 2
timeout 300 torchrun --standalone --nproc-per-node 2 packages/magi-comm/tests/gpu_native_check.py >"$out/native_check.log" 2>&1 || rc=1
grep RESULT "$out/native_check.log" || { tail -20 "$out/native_check.log"; rc=1; }
bench() {
  echo "== $1" | tee -a "$out/prefetch.log"
  timeout 120 torchrun --standalone --nproc-per-node 2 tools/bench_comm.py --sizes 16,64 2>&1 |
    tee -a "$out/prefetch.log" | grep "host ahead" | grep reduce || rc=1
}
for turn in 1 2; do
  bench "prefetch $turn"
  git apply --reverse "${patch[@]}" || exit 2
  bench "main $turn"
  git apply "${patch[@]}" || exit 2
done
git apply --reverse "${patch[@]}"
exit $rc
