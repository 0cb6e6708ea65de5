#!/usr/bin/env bash
# Check and measure a kernel step from wip/ (patches not on main yet) on the device, in one call:
#   source .dk/bin/env.sh && bash tools/try_wip.sh bwd-stats-smem|bwd-scale-fold|bwd-early-dv|fwd-p-convert|mask-bits|fwd-doc-tiles
# Copies packages/ and tools/ to a scratch folder, applies wip/NAME/*.patch there (git apply:
# the device's copy of the tree has no usable git history), runs the step's GPU tests, then its
# benchmark for main and for the patched tree back to back. Logs go to $OUT (or ./gpu_logs).
set -uo pipefail
name=${1:?usage: try_wip.sh NAME (a folder of wip/)}
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$root/gpu_logs}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore CUTE_DSL_ARCH=${CUTE_DSL_ARCH:-sm_90a}
[[ -d $root/wip/$name ]] || { echo "no wip/$name" >&2; exit 2; }
scratch=$(mktemp -d)
cp -r "$root/packages" "$root/tools" "$scratch/"
cp "$root/pyproject.toml" "$root/conftest.py" "$scratch/"
(cd "$scratch" && git apply "$root"/wip/"$name"/*.patch) || { echo "wip/$name does not apply" >&2; exit 2; }
src_path() { local base=$1 p=""; for d in "$base"/packages/*/src; do p="$p:$d"; done; echo "${p#:}"; }
main_path=$(src_path "$root")
wip_path=$(src_path "$scratch")
filter() { grep -v "aux_data\|exe_args"; }
case $name in
  bwd-stats-smem)
    tests=(packages/ffa-kernels/tests/test_cute_bwd_gpu.py)
    bench=(bench_bwd_kernel.py --cases full8k,causal8k,causal8k_d64,varlen_causal32k --variants base)
    bench_wip_extra=(bench_bwd_kernel.py --cases causal8k_d64,full8k_d64 --variants base,tile_m128)
    ;;
  bwd-scale-fold)  # bwd-stats-smem's patch, then the scale fold: compare with bwd-stats-smem's numbers
    tests=(packages/ffa-kernels/tests/test_cute_bwd_gpu.py)
    bench=(bench_bwd_kernel.py --cases full8k,causal8k,causal8k_d64,varlen_causal32k --variants base)
    bench_wip_extra=(bench_ffa.py --bwd --cases full8k,causal8k,varlen_causal32k --no-flex --iters 10 --rounds 3)
    ;;
  bwd-early-dv)  # bwd-scale-fold's patches, then dV's GEMM before the dP^T wait
    tests=(packages/ffa-kernels/tests/test_cute_bwd_gpu.py)
    bench=(bench_bwd_kernel.py --cases full8k,causal8k,causal8k_d64,varlen_causal32k --variants base)
    bench_wip_extra=(bench_ffa.py --bwd --cases full8k,causal8k,causal8k_d64,varlen_causal32k,gqa_varlen_causal32k,swa8k
      --no-flex --iters 10 --rounds 3)
    ;;
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
