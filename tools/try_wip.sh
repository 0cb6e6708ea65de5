#!/usr/bin/env bash
# Check and measure one kernel step from wip/ (patches not on main yet) on the device, in one call:
#   source .dk/bin/env.sh && bash tools/try_wip.sh NAME
# Applies wip/NAME/*.patch to a scratch copy (tools/wip_lib.sh), runs the step's GPU tests, then
# its benchmark for main and for the patched tree back to back. Logs go to $OUT (or ./gpu_logs).
# The stacked backward steps (wip/bwd-stack) go through tools/try_wip_chain.sh instead.
set -uo pipefail
name=${1:?usage: try_wip.sh NAME (a folder of wip/)}
source "$(dirname "$0")/wip_lib.sh"
[[ -d $root/wip/$name ]] || { echo "try_wip.sh: no wip/$name" >&2; exit 2; }
# both kernels' GPU tests, and the training-step benchmark of the backward table; a folder may
# name its own benchmark in wip/NAME/bench_args (one line: bench_ffa.py and its arguments)
tests=(packages/ffa-kernels/tests/test_cute_gpu.py packages/ffa-kernels/tests/test_cute_bwd_gpu.py)
bench=(bench_ffa.py --bwd --no-flex --iters 10 --rounds 3
  --cases full8k,causal8k,causal8k_d64,varlen_causal32k,gqa_varlen_causal32k,swa8k)
[[ -f $root/wip/$name/bench_args ]] && read -ra bench <"$root/wip/$name/bench_args"
scratch=$(patched_tree "$name") || exit 2
main_path=$(src_path "$root")
wip_path=$(src_path "$scratch")
rc=0
echo "== GPU tests of wip/$name"
(cd "$scratch" && PYTHONPATH=$wip_path timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 "${tests[@]}") \
  2>&1 | filter | tee "$out/wip_${name}_tests.log" | tail -8
((PIPESTATUS[0])) && rc=1
for side in main wip; do
  path=$main_path dir=$root/tools
  [[ $side == wip ]] && path=$wip_path dir=$scratch/tools
  echo "== $side: ${bench[*]}"
  (cd "$dir" && PYTHONPATH=$path FFA_CACHE_DIR=$(mktemp -d) timeout 240 python3 "${bench[@]}") 2>&1 | filter \
    | tee "$out/wip_${name}_bench_$side.log" | tail -24  # the whole table stays in the log
done
rm -rf "$scratch"
exit $rc
