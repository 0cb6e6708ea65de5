#!/usr/bin/env bash
# wip/kv-ready-local-first on 1 GPU (nvidia-h100-x1), one device call (~6 min):
#   source .dk/bin/env.sh && bash wip/kv-ready-local-first/run.sh
# tools/bench_kv_ready.py (--remote half and all, 32k) on main, then with the patch (the forward
# with kv_ready runs local work tiles first, over every head) at FFA_KV_LOCAL_PREFIX 1 (every
# local tile first), 0.5 and 0.25 (the short local tiles after the late ones), twice in turn;
# then the kv_ready GPU tests with the patch.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
rc=0
bench() {
  for m in half all; do
    echo "== $1, --remote $m"
    timeout 100 env FFA_KV_LOCAL_PREFIX="${2:-1}" python3 tools/bench_kv_ready.py --tokens 32768 --rounds 8 \
      --remote $m 2>&1 | tail -4 || rc=1
  done
}
for turn in 1 2; do
  bench main
  git apply wip/kv-ready-local-first/*.patch || exit 2
  for p in 1 0.5 0.25; do bench "local-first, prefix $p" $p; done
  if (( turn == 2 )); then
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu packages/ffa-kernels/tests/test_kv_ready_gpu.py 2>&1 | tail -2 || rc=1
  fi
  git apply --reverse wip/kv-ready-local-first/*.patch || exit 2
done
exit $rc
