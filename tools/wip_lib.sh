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

# patched_tree FOLDER [N]: a scratch copy of packages/, tools/ and the pytest configuration with
# the first N patches of wip/FOLDER applied (all when N is left out), by git apply: the device's
# copy of the tree has no usable git history. Prints the copy's path; fails if they do not apply.
patched_tree() {
  local folder=$1 scratch patches
  [[ -d $root/wip/$folder ]] || { echo "no wip/$folder" >&2; return 2; }
  mapfile -t patches < <(ls "$root"/wip/"$folder"/*.patch)
  (($# > 1)) && patches=("${patches[@]:0:$2}")
  scratch=$(mktemp -d)
  cp -r "$root/packages" "$root/tools" "$root/pyproject.toml" "$root/conftest.py" "$scratch/"
  (cd "$scratch" && git apply "${patches[@]}") || { echo "wip/$folder (${#patches[@]} patches) does not apply" >&2; return 2; }
  echo "$scratch"
}
