#!/usr/bin/env bash
# wip/early-keys on 4 GPUs (nvidia-h100-x4), one device call (~4 min):
#   source .dk/bin/env.sh && bash wip/early-keys/run.sh
# Applies the patch to the device's copy of the tree, runs its GPU tests, then times the step in
# turns: cp 2 (GPUs 0, 1) no split / early (EARLY_TAIL 0.15, 1), cp 4 split / early; then what a
# transfer beside the one-call backward costs it (beside_one_gpu.py: SM copy, D2D memcpy, copy
# engine P2P; beside_reduce.py: magi-comm's group_reduce of 256 MB, native with a buffer that
# fits it, at high and normal priority).
set -uo pipefail
cd "$(dirname "$0")/../.."
git apply --reverse --check wip/early-keys/*.patch 2>/dev/null || git apply wip/early-keys/*.patch || exit 2
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
rc=0
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider packages/ffa-kernels/tests/test_cute_bwd_gpu.py -k early_keys 2>&1 | tail -2 || rc=1
CUDA_VISIBLE_DEVICES=0,1 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider \
  packages/magi-dist/tests/test_calc_attn_nccl.py -k "early_backward or split_backward" 2>&1 | tail -2 || rc=1
sed -i 's/^    ENV_SYMMETRIC_MB: symmetric_budget,$/    ENV_SYMMETRIC_MB: symmetric_budget,\n    "FFA_BWD_EARLY_TAIL": lambda: None,/' tools/step_ab.py
F='^|\|^cp \|: the\|Error'
export MAGI_COMM_BACKEND=native
CUDA_VISIBLE_DEVICES=0,1 timeout 200 torchrun --standalone --nproc-per-node 2 tools/step_ab.py --setting nosplit \
  --setting t15:MAGI_DIST_BWD_EARLY=1,FFA_BWD_EARLY_TAIL=0.15 --setting all:MAGI_DIST_BWD_EARLY=1,FFA_BWD_EARLY_TAIL=1 \
  --masks varlen_causal,varlen_full --totals 65536 131072 --rounds 6 --iters 6 2>&1 | grep "$F" || rc=1
timeout 200 torchrun --standalone --nproc-per-node 4 tools/step_ab.py --setting split \
  --setting t15:MAGI_DIST_BWD_EARLY=1,FFA_BWD_EARLY_TAIL=0.15 --setting all:MAGI_DIST_BWD_EARLY=1,FFA_BWD_EARLY_TAIL=1 \
  --masks varlen_causal,varlen_full --totals 65536 131072 --rounds 6 --iters 6 2>&1 | grep "$F" || rc=1
timeout 100 python3 wip/early-keys/beside_one_gpu.py 2>&1 | grep "^|" || rc=1
for p in -1 0; do
  CUDA_VISIBLE_DEVICES=0,1 MAGI_COMM_NATIVE_BUFFER_MB=1024 MAGI_COMM_NATIVE_STREAM_PRIORITY=$p timeout 120 \
    torchrun --standalone --nproc-per-node 2 wip/early-keys/beside_reduce.py 2>&1 | grep "^rank" || rc=1
done
exit $rc
