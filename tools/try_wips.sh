#!/usr/bin/env bash
# Check several one-step wip/ folders in one device call:
#   source .dk/bin/env.sh && bash tools/try_wips.sh NAME [NAME ...]
# 1. the GPU tests of both kernels once, on a scratch tree with every folder's patches applied
#    (they must apply together);
# 2. per folder, its benchmark (wip_lib.sh's wip_bench) on main and on a
#    tree with that folder alone, alternating main / folder twice (the device's run-to-run
#    noise is 3-6%: one pair can mislead). PART=tests or PART=bench runs only part 1 or 2.
# Logs go to $OUT (or ./gpu_logs).
set -uo pipefail
(($#)) || { echo "usage: try_wips.sh NAME [NAME ...] (folders of wip/)" >&2; exit 2; }
source "$(dirname "$0")/wip_lib.sh"
part=${PART:-all}
rc=0
if [[ $part == all || $part == tests ]]; then
  all=()
  for name in "$@"; do
    mapfile -t p < <(wip_patches "$name") || exit 2
    all+=("${p[@]}")
  done
  scratch=$(mktemp -d)
  cp -r "$root/packages" "$root/tools" "$root/pyproject.toml" "$root/conftest.py" "$scratch/"
  (cd "$scratch" && git apply "${all[@]}") || { echo "the folders' patches do not apply together" >&2; exit 2; }
  echo "== GPU tests with every patch of: $*"
  (cd "$scratch" && PYTHONPATH=$(src_path "$scratch") timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu \
    -n 4 "${wip_tests[@]}") 2>&1 \
    | filter | tee "$out/wips_tests.log" | tail -8
  ((PIPESTATUS[0])) && rc=1
  rm -rf "$scratch"
fi
if [[ $part == all || $part == bench ]]; then
  for name in "$@"; do
    wip_bench "$name"
    tree=$(patched_tree "$name") || exit 2
    for round in 1 2; do
      for side in main "$name"; do
        t=$root
        [[ $side != main ]] && t=$tree
        echo "== $name round $round, $side: ${bench[*]}"
        run_tool "$t" "wips_${name}_bench.log" 200 24 python3 "${bench[@]}"
      done
    done
    rm -rf "$tree"
  done
fi
exit $rc
