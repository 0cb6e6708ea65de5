#!/usr/bin/env bash
# Check and measure one kernel step from wip/ (patches not on main yet) on the device, in one call:
#   source .dk/bin/env.sh && bash tools/try_wip.sh NAME
# Applies wip/NAME/*.patch to a scratch copy (tools/wip_lib.sh), runs the step's GPU tests, then
# its benchmark for main and for the patched tree back to back. Logs go to $OUT (or ./gpu_logs).
# A stack of steps (one per patch) goes through tools/try_wip_chain.sh instead.
set -uo pipefail
name=${1:?usage: try_wip.sh NAME (a folder of wip/)}
source "$(dirname "$0")/wip_lib.sh"
wip_bench "$name"  # wip_lib.sh: the folder's bench_args, else the backward table's step
scratch=$(patched_tree "$name") || exit 2
rc=0
echo "== GPU tests of wip/$name"
(cd "$scratch" && PYTHONPATH=$(src_path "$scratch") timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu \
  -n 4 "${wip_tests[@]}") 2>&1 | filter | tee "$out/wip_${name}_tests.log" | tail -8
((PIPESTATUS[0])) && rc=1
for side in main wip; do
  tree=$root
  [[ $side == wip ]] && tree=$scratch
  echo "== $side: ${bench[*]}"
  run_tool "$tree" "wip_${name}_bench_$side.log" 240 24 python3 "${bench[@]}"
done
rm -rf "$scratch"
exit $rc
