#!/usr/bin/env bash
# wip/one-launch-backoff on 2 GPUs (nvidia-h100-x2), one device call (~4 min):
#   source .dk/bin/env.sh && bash wip/one-launch-backoff/run.sh
# bench_comm at 16 and 64 MiB on main, then with the patch applied to the device's copy of the
# tree (the one-launch reduction's programs poll the peer's READY with a backoff), then main
# again (the GPUs' drift between runs), and the native check with the patch.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
rc=0
bench() {
  echo "== $1"
  timeout 200 torchrun --standalone --nproc-per-node 2 tools/bench_comm.py --sizes 16,64 2>&1 | grep "^| reduce" || rc=1
}
bench main
git apply wip/one-launch-backoff/*.patch || exit 2
bench backoff
timeout 200 torchrun --standalone --nproc-per-node 2 packages/magi-comm/tests/gpu_native_check.py 2>&1 | grep "RESULT" || rc=1
git apply --reverse wip/one-launch-backoff/*.patch || exit 2
bench main
exit $rc
