#!/usr/bin/env bash
# Check and measure one kernel step from wip/ (patches not on main yet) on the device, in one call:
#   source .dk/bin/env.sh && bash tools/try_wip.sh NAME
# Applies wip/NAME/*.patch to a scratch copy (tools/wip_lib.sh), runs the step's GPU tests, then
# its benchmark for main and for the patched tree back to back. Logs go to $OUT (or ./gpu_logs).
# A stack of steps (one per patch) goes through tools/try_wip_chain.sh instead.
set -uo pipefail
name=${1:?usage: try_wip.sh NAME (a folder of wip/)}
source "$(dirname "$0")/wip_lib.sh"
# both kernels' GPU tests, and the training-step benchmark of the backward table; a folder may
# name its own benchmark in wip/NAME/bench_args (a tools/ script and its arguments, one per line)
tests=(packages/ffa-kernels/tests/test_cute_gpu.py packages/ffa-kernels/tests/test_cute_bwd_gpu.py)
bench=(bench_ffa.py --bwd --no-flex --iters 10 --rounds 3
  --cases full8k,causal8k,causal8k_d64,varlen_causal32k,gqa_varlen_causal32k,swa8k)
[[ -f $root/wip/$name/bench_args ]] && mapfile -t bench <"$root/wip/$name/bench_args"
scratch=$(patched_tree "$name") || exit 2
rc=0
echo "== GPU tests of wip/$name"
(cd "$scratch" && PYTHONPATH=$(src_path "$scratch") timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu \
  -n 4 "${tests[@]}") 2>&1 | filter | tee "$out/wip_${name}_tests.log" | tail -8
((PIPESTATUS[0])) && rc=1
for side in main wip; do
  tree=$root
  [[ $side == wip ]] && tree=$scratch
  echo "== $side: ${bench[*]}"
  run_tool "$tree" "wip_${name}_bench_$side.log" 240 24 python3 "${bench[@]}"
done
rm -rf "$scratch"
exit $rc
