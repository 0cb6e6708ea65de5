#!/usr/bin/env bash
# Check and measure one kernel step from wip/ (patches not on main yet) on the device, in one call:
#   source .dk/bin/env.sh && bash tools/try_wip.sh mask-bits|fwd-p-convert|fwd-doc-tiles
# Applies wip/NAME/*.patch to a scratch copy (tools/wip_lib.sh), runs the step's GPU tests, then
# its benchmark for main and for the patched tree back to back. Logs go to $OUT (or ./gpu_logs).
# The stacked backward steps (wip/bwd-stack) go through tools/try_wip_chain.sh instead.
set -uo pipefail
name=${1:?usage: try_wip.sh NAME (a folder of wip/)}
source "$(dirname "$0")/wip_lib.sh"
case $name in
  fwd-p-convert)
    tests=(packages/ffa-kernels/tests/test_cute_gpu.py)
    bench=(bench_ffa.py --cases full8k_d256,causal8k_d256,full8k,causal8k,causal8k_d64 --no-flex --iters 10 --rounds 3)
    bench_wip_extra=()
    ;;
  mask-bits)  # masked blocks in both kernels: short documents have few unmasked blocks
    tests=(packages/ffa-kernels/tests/test_cute_gpu.py packages/ffa-kernels/tests/test_cute_bwd_gpu.py)
    bench=(bench_ffa.py --bwd --cases causal8k,swa8k --lengths many-short,uniform --totals 32768 --no-flex
      --iters 10 --rounds 3)
    bench_wip_extra=()
    ;;
  fwd-doc-tiles)  # the chosen tiling beside forced per-document tiles (calibrates TILE_COST_BLOCKS)
    tests=(packages/ffa-kernels/tests/test_cute_gpu.py)
    bench=(bench_ffa.py --cases "" --lengths many-short,long-tailed,uniform --totals 32768,131072 --no-flex --no-peers
      --iters 10 --rounds 3)
    bench_wip_extra=(-c "import runpy, sys; import ffa_kernels.cute.tile_plan as t; t.SEGMENT_ROWS = True;
sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')" "${bench[@]}")
    ;;
  *) echo "try_wip.sh: no checks written for wip/$name" >&2; exit 2 ;;
esac
scratch=$(patched_tree "$name") || exit 2
main_path=$(src_path "$root")
wip_path=$(src_path "$scratch")
rc=0
echo "== GPU tests of wip/$name"
(cd "$scratch" && PYTHONPATH=$wip_path timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 "${tests[@]}") \
  2>&1 | filter | tail -8 | tee "$out/wip_${name}_tests.log" || rc=1
for side in main wip; do
  path=$main_path dir=$root/tools
  [[ $side == wip ]] && path=$wip_path dir=$scratch/tools
  echo "== $side: ${bench[*]}"
  (cd "$dir" && PYTHONPATH=$path FFA_CACHE_DIR=$(mktemp -d) timeout 240 python3 "${bench[@]}") 2>&1 | filter \
    | tail -12 | tee "$out/wip_${name}_bench_$side.log"
done
if ((${#bench_wip_extra[@]})); then
  echo "== wip: ${bench_wip_extra[*]}"
  (cd "$scratch/tools" && PYTHONPATH=$wip_path timeout 200 python3 "${bench_wip_extra[@]}") 2>&1 | filter | tail -8
fi
rm -rf "$scratch"
exit $rc
