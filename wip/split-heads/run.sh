#!/usr/bin/env bash
# wip/split-heads on 4 GPUs (nvidia-h100-x4 / -h200-x4), in one device call (~4 min):
#   source .dk/bin/env.sh && bash wip/split-heads/run.sh
# Applies the patch to the device's copy of the tree (nothing there is committed back), runs the
# split backward's GPU test under each MAGI_DIST_BWD_SPLIT_HEADS, then times the cp 4 step with
# the split's calls at their own heads per CTA (auto, today's), the whole stage's, and 2, against
# no split, in turns in one process (tools/step_ab.py), with each rank's kernel times.
set -uo pipefail
cd "$(dirname "$0")/../.."
git apply wip/split-heads/*.patch || exit 2
export MAGI_COMM_BACKEND=native PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
rc=0
CUDA_VISIBLE_DEVICES=0,1 timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider \
  packages/magi-dist/tests/test_calc_attn_nccl.py -k split_backward 2>&1 | tail -3 || rc=1
timeout 240 torchrun --standalone --nproc-per-node 4 tools/step_ab.py --setting auto \
  --setting stage:MAGI_DIST_BWD_SPLIT_HEADS=stage --setting two:MAGI_DIST_BWD_SPLIT_HEADS=2 \
  --setting nosplit:MAGI_DIST_BWD_SPLIT=0 --masks varlen_causal,varlen_full --totals 65536 131072 \
  --rounds 6 --iters 6 --profile 2>&1 | grep -v "aux_data\|exe_args" | grep "^|\|^cp \|: the\|GPU time\|Error" || rc=1
exit $rc
