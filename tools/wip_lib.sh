# Shared by tools/try_wip.sh and tools/try_wip_chain.sh (sourced): the repository root, the log
# folder, the environment of the device runs, and scratch trees with wip/ patches applied.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${OUT:-$root/gpu_logs}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore CUTE_DSL_ARCH=${CUTE_DSL_ARCH:-sm_90a}

# src_path TREE: every package's src of TREE, ahead of the caller's PYTHONPATH (the kit's CuTe DSL
# and FA4 come from there; main's packages there come after TREE's, so TREE's are imported)
src_path() {
  local base=$1 p=""
  for d in "$base"/packages/*/src; do p="$p:$d"; done
  echo "${p#:}${PYTHONPATH:+:$PYTHONPATH}"
}

# filter: drop CuTe DSL's warnings about arguments it cannot convert (one per compile)
filter() { grep -v "aux_data\|exe_args"; }

# wip_patches FOLDER: the patch files of wip/FOLDER in order, one per line; fails without any
wip_patches() {
  compgen -G "$root/wip/$1/*.patch" >/dev/null || { echo "no patches in wip/$1" >&2; return 2; }
  ls "$root"/wip/"$1"/*.patch
}

# run_tool TREE LOG SECONDS LINES CMD...: CMD (e.g. python3 bench_ffa.py ...) in TREE's tools/
# with TREE's packages and a fresh kernel cache, under `timeout SECONDS`; the whole output is
# appended to $out/LOG and its last LINES lines shown. Returns CMD's status.
run_tool() {
  local tree=$1 log=$2 secs=$3 lines=$4
  shift 4
  (cd "$tree/tools" && PYTHONPATH=$(src_path "$tree") FFA_CACHE_DIR=$(mktemp -d) timeout "$secs" "$@") 2>&1 \
    | filter | tee -a "$out/$log" | tail -"$lines"
  return "${PIPESTATUS[0]}"
}

# patched_tree FOLDER [N]: a scratch copy of packages/, tools/ and the pytest configuration with
# the first N patches of wip/FOLDER applied (all when N is left out), by git apply: the device's
# copy of the tree has no usable git history. Prints the copy's path; fails if they do not apply.
patched_tree() {
  local folder=$1 scratch patches
  mapfile -t patches < <(wip_patches "$folder") || return 2
  (($# > 1)) && patches=("${patches[@]:0:$2}")
  scratch=$(mktemp -d)
  cp -r "$root/packages" "$root/tools" "$root/pyproject.toml" "$root/conftest.py" "$scratch/"
  (cd "$scratch" && git apply "${patches[@]}") || { echo "wip/$folder (${#patches[@]} patches) does not apply" >&2; return 2; }
  echo "$scratch"
}

# both kernels' GPU tests, and the training-step benchmark of the backward table: what a wip
# folder is checked with unless wip/NAME/bench_args names its own benchmark (a tools/ script and
# its arguments, one per line)
wip_tests=(packages/ffa-kernels/tests/test_cute_gpu.py packages/ffa-kernels/tests/test_cute_bwd_gpu.py)
wip_default_bench=(bench_ffa.py --bwd --no-flex --iters 10 --rounds 3
  --cases full8k,causal8k,causal8k_d64,varlen_causal32k,gqa_varlen_causal32k,swa8k)

# wip_bench NAME: the benchmark of wip/NAME into the array ``bench``
wip_bench() {
  bench=("${wip_default_bench[@]}")
  [[ -f $root/wip/$1/bench_args ]] && mapfile -t bench <"$root/wip/$1/bench_args"
  return 0
}
