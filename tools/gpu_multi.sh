#!/usr/bin/env bash
# Multi-GPU checks and benchmarks of the distributed training step, run on a machine with 2, 4 or
# 8 GPUs after the kit is booted (one part per call keeps each under 10 minutes):
#   source .dk/bin/env.sh && bash tools/gpu_multi.sh tests|train|fail|bench-fwd|bench-step|comm|cp-rows|all|switches|reduce-sweep|trace-step|cp-step|split-ab|copy-engine|one-launch|pulled-step|known-arms
# Logs go to $OUT (or ./gpu_logs), one file per step; every step runs under `timeout`; a failing
# or timed-out step makes the script exit 1 (the others still run). NVLink multicast stays off
# (env.sh sets NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1).
#
#   tests       pytest -m gpu packages/magi-dist packages/magi-comm (a2av), the magi-dist GPU tests
#               again with MAGI_COMM_BACKEND=native (and with MAGI_DIST_SYMMETRIC_PARTIALS_MB=256:
#               the backward's partials pulled from symmetric outputs), and the 2-GPU native checks
#               (packages/magi-comm/tests/gpu_native_check.py, gpu_backends_differ.py)
#   train       integration_tests/test_cp_training.py on 2 GPUs: examples/cp_train.py, NCCL, bf16,
#               checked against one GPU (loss curve, final weights; deterministic: bitwise repeat)
#   fail        integration_tests/test_reliability.py -m gpu: a peer that raises or exits
#               mid-collective on 2 GPUs (a2av and native) ends every rank, never a hang
#   bench-fwd   tools/bench_dist.py forward at 64k and 128k, a2av and native, degree 0 and 2
#   bench-step  tools/bench_dist.py --step at 64k and 128k (varlen causal / full, causal, block-causal),
#               the magi and whole-mask columns medians of 1 + ALTERNATE (default 2) timings in turn
#   comm        tools/bench_comm.py (its reduce rows against the raw peer copy are the issue's)
#   cp-rows     on 4 or 8 GPUs: bench_dist forward and --step at cp 4 / cp 8, 16k tokens per GPU
#               (CPS, default "4 8": the cp sizes; three steps of up to 420 + 560 + 420 s per cp
#               size, so on 8 GPUs one cp size per call, CPS=8; a slow run is then cut by the
#               device's 10 minutes, not by its step's timeout)
#   cp-step     (not in all) issue 19's cp 4 / cp 8 rows: bench_dist --step with the one-GPU
#               whole-mask column on every GPU of the machine (NPROC, 4 or more), varlen causal and
#               varlen full (MASKS), TOKENS_PER_GPU tokens per GPU (default 16384: 128k at cp 8;
#               32768 for 256k, in its own call), the magi and whole-mask columns medians of
#               1 + ALTERNATE (default 2) timings in turn
#   switches    (not in all) bench_dist --step at degree 0, native, for the four settings of
#               MAGI_DIST_KEEP_KV x MAGI_DIST_BWD_SPLIT on NPROC GPUs (default 2): one log each
#               (the baselines and the whole mask in the first only);
#               FWD_SPLIT=1 runs them all with MAGI_DIST_FWD_SPLIT=1 (logs named ..._fwdsplit)
#   reduce-sweep (not in all) bench_comm --sweep-reduce: group_reduce GB/s per fused-reduction tile
#               shape (rows x warps; NativeConfig.reduce_tile_rows / reduce_warps) at 16 and 64 MiB
#   trace-step  (not in all) bench_dist --step --trace at degree 0, native, on NPROC GPUs (default
#               2; MASKS, default varlen_causal; TOTALS_TRACE, default 65536), then
#               tools/trace_summary.py over every rank's timeline: busy and idle time per stream,
#               the largest gaps (the timelines stay in $out, ~0.25 MB per rank)
#   split-ab    (not in all) the backward split against no split in turns (tools/step_ab.py) on
#               NPROC GPUs (default 4; BWD_SPLIT_MIN_CP in magi_dist.attn sets the default), varlen
#               causal, varlen full and causal at TOTALS
#   copy-engine (not in all) the native reduce's send by the copy engines against the copy
#               kernel: MAGI_COMM_NATIVE_COPY_ENGINE=1, then 0 (a process each: the backend reads
#               it once), the step in turns with the split backward off and on (tools/step_ab.py,
#               --profile; varlen causal and varlen full, TOTALS) on NPROC GPUs (default 2), and
#               bench_comm's rows at 16 and 64 MiB on 2 GPUs
#   one-launch  (not in all) the 2-rank pulled reduce in one launch (magi-comm native.md, "One
#               launch on 2 ranks"): gpu_native_check.py, then bench_comm at 16 and 64 MiB per
#               grid of the one-launch reduction (MAGI_COMM_NATIVE_REDUCE_PROGRAMS: 0 = its
#               default, 1000000 = a program per tile, 8192, 1024) and with one launch off
#   known-arms  (not in all) the one-launch reduce publishing without the arm it knows (magi-comm
#               native.md, "The arm known"; on by default): gpu_native_check.py, the backends
#               that differ on the two ranks (gpu_backends_differ.py: errors, no stale rows),
#               then bench_comm at 16 and 64 MiB with MAGI_COMM_NATIVE_KNOWN_ARMS=1 and 0 in
#               turn, twice
#   pulled-step (not in all) the cp 2 step with pulled partials (their reduce in one launch)
#               against plain ones in turns (tools/step_ab.py, MAGI_DIST_SYMMETRIC_PARTIALS_MB=4096;
#               varlen causal and varlen full, TOTALS)
# The benchmark parts loop over COMMS (default "a2av native"), DEGREES ("0 2", forward) and TOTALS
# ("65536 131072"); narrow them to keep one call under the device's 10 minutes, e.g.
#   COMMS=native TOTALS=131072 bash tools/gpu_multi.sh bench-step
set -uo pipefail
out=${OUT:-gpu_logs}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore CUTE_DSL_ARCH=${CUTE_DSL_ARCH:-sm_90a}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
what=${1:-all}
rc=0
run2="torchrun --standalone --nproc-per-node 2"
COMMS=${COMMS:-a2av native}
DEGREES=${DEGREES:-0 2}
TOTALS=${TOTALS:-65536 131072}

# fits PART MIN N: whether N GPUs, at least MIN, are here; if not, says so (the part is skipped)
fits() {
  local part=$1 min=$2 n=$3
  if (( n < min || n > ngpu )); then
    echo "$part: needs NPROC between $min and the $ngpu GPUs found, got $n (skipped)"
    return 1
  fi
}

# step LOG N SECONDS CMD...: run CMD under `timeout SECONDS` with its output in $out/LOG, show its
# last N lines (without the CuTe DSL's argument dumps); a failure or a timeout sets rc=1.
step() {
  local log=$1 n=$2 secs=$3
  shift 3
  echo "== $* (timeout ${secs}s, log $log)"
  local start=$SECONDS
  timeout -k 20 "$secs" "$@" >"$out/$log" 2>&1
  local st=$?
  (( st == 124 || st == 137 )) && echo "TIMEOUT after ${secs}s" | tee -a "$out/$log"
  (( st != 0 )) && rc=1
  grep -v "aux_data\|exe_args" "$out/$log" | tail -n "$n"
  echo "-- exit $st after $((SECONDS - start))s"
}
part() { [[ $what == "$1" || $what == all ]]; }
# on_gpus N LOG SECONDS ARGS...: tools/bench_dist.py ARGS on N GPUs, native comm, its --trace
# timelines into $out (cp-rows, cp-step, trace-step)
on_gpus() {
  local n=$1 log=$2 secs=$3
  shift 3
  step "$log" 16 "$secs" env MAGI_COMM_BACKEND=native OUT="$out" torchrun --standalone --nproc-per-node "$n" \
    tools/bench_dist.py "$@"
}

if (( ngpu < 2 )); then
  echo "gpu_multi.sh: needs at least 2 GPUs, found $ngpu" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
nvidia-smi topo -m >>"$out/gpu.txt" 2>&1

if part tests; then
  step gpu_tests.log 15 480 python3 -m pytest -q -p no:cacheprovider -m gpu packages/magi-dist packages/magi-comm
  step gpu_tests_native.log 8 300 env MAGI_COMM_BACKEND=native python3 -m pytest -q -p no:cacheprovider -m gpu packages/magi-dist
  # the backward's partials in symmetric outputs, pulled by their owners (off by default until this passes)
  step gpu_tests_native_pull.log 8 300 env MAGI_COMM_BACKEND=native MAGI_DIST_SYMMETRIC_PARTIALS_MB=256 \
    python3 -m pytest -q -p no:cacheprovider -m gpu packages/magi-dist
  step native_check.log 25 300 $run2 packages/magi-comm/tests/gpu_native_check.py
  step backends_differ.log 12 200 $run2 packages/magi-comm/tests/gpu_backends_differ.py
fi
if part train; then
  step cp_training.log 30 560 python3 -m pytest -q -p no:cacheprovider -m gpu -rA integration_tests/test_cp_training.py
fi
if part fail; then
  # each test under its own limit (a hang fails that test, the summary still prints)
  step peer_failure.log 25 560 python3 -m pytest -v -p no:cacheprovider -m gpu -rA --timeout 130 \
    integration_tests/test_reliability.py
fi
if part bench-fwd; then
  for comm in $COMMS; do
    for deg in $DEGREES; do
      step "bench_fwd_${comm}_deg${deg}.log" 14 420 env MAGI_COMM_BACKEND=$comm $run2 tools/bench_dist.py \
        --degree $deg --totals $TOTALS
    done
  done
fi
if part bench-step; then
  for comm in $COMMS; do
    step "bench_step_${comm}.log" 14 560 env MAGI_COMM_BACKEND=$comm $run2 tools/bench_dist.py --step \
      --degree 0 --totals $TOTALS --alternate ${ALTERNATE:-2}
  done
fi
if part comm; then
  step bench_comm.log 40 420 $run2 tools/bench_comm.py --sizes 1,16,64
  # the table's header and its reduce rows (native/raw copy: the issue's >= 80%)
  grep -E "^\| (op|reduce|reduce-sym) \|" "$out/bench_comm.log" | tee "$out/bench_comm_reduce_rows.txt"
fi
if part cp-rows; then
  if (( ngpu >= 4 )); then
    for n in ${CPS:-4 8}; do
      (( ngpu >= n )) || continue
      masks=full,causal,varlen_full,varlen_causal,varlen_block_causal
      on_gpus "$n" "bench_fwd_cp${n}.log" 420 --tokens-per-gpu 16384 --degree 0 --masks $masks
      on_gpus "$n" "bench_step_cp${n}.log" 560 --step --tokens-per-gpu 16384 --degree 0 --masks $masks --no-whole
      step "gpu_tests_cp${n}.log" 8 420 python3 -m pytest -q -p no:cacheprovider -m gpu packages/magi-dist
    done
  else
    echo "cp-rows: needs 4 or 8 GPUs, found $ngpu (skipped)"
  fi
fi
if [[ $what == switches ]]; then
  nproc=${NPROC:-2}
  fwd_tag=""
  [[ ${FWD_SPLIT:-0} == 1 ]] && fwd_tag=_fwdsplit
  # the single-GPU whole mask and the baselines (same stages, one FFA, all-gather, ring), which
  # the switches do not touch: the first run only
  whole=()
  for keep in 0 1; do
    for split in 0 1; do
      step "bench_step_keep${keep}_split${split}${fwd_tag}.log" 14 300 env MAGI_COMM_BACKEND=native \
        MAGI_DIST_KEEP_KV=$keep MAGI_DIST_BWD_SPLIT=$split MAGI_DIST_FWD_SPLIT=${FWD_SPLIT:-0} \
        torchrun --standalone --nproc-per-node "$nproc" \
        tools/bench_dist.py --step --degree 0 --totals $TOTALS "${whole[@]}"
      whole=(--no-whole --no-baselines)
    done
  done
fi
if [[ $what == trace-step ]]; then
  rm -f "$out"/dist_trace_step_*.json  # the summary reads every one left there
  on_gpus "${NPROC:-2}" trace_step.log 300 --step --degree 0 --masks "${MASKS:-varlen_causal}" \
    --totals ${TOTALS_TRACE:-65536} --trace --no-baselines --no-whole
  step trace_summary.log 400 60 python3 tools/trace_summary.py "$out"/dist_trace_step_*_rank*.json
fi
if [[ $what == cp-step ]]; then
  nproc=${NPROC:-$ngpu}
  if fits cp-step 4 "$nproc"; then
    for tpg in ${TOKENS_PER_GPU:-16384}; do
      on_gpus "$nproc" "bench_step_cp${nproc}_${tpg}.log" 560 --step --degree 0 --tokens-per-gpu "$tpg" \
        --masks "${MASKS:-varlen_causal,varlen_full}" --alternate "${ALTERNATE:-2}"
    done
  fi
fi
if [[ $what == copy-engine ]]; then
  nproc=${NPROC:-2}
  for ce in 1 0; do
    step "step_ab_ce${ce}_cp${nproc}.log" 40 280 env MAGI_COMM_BACKEND=native MAGI_COMM_NATIVE_COPY_ENGINE=$ce \
      torchrun --standalone --nproc-per-node "$nproc" tools/step_ab.py --setting nosplit:MAGI_DIST_BWD_SPLIT=0 \
      --setting split:MAGI_DIST_BWD_SPLIT=1 --masks varlen_causal,varlen_full --totals $TOTALS --rounds 6 --profile
    step "bench_comm_ce${ce}.log" 16 200 env MAGI_COMM_NATIVE_COPY_ENGINE=$ce $run2 tools/bench_comm.py --sizes 16,64
  done
fi
if [[ $what == split-ab ]]; then
  nproc=${NPROC:-4}
  if fits split-ab 1 "$nproc"; then
    step "step_ab_split_cp${nproc}.log" 40 560 env MAGI_COMM_BACKEND=native torchrun --standalone \
      --nproc-per-node "$nproc" tools/step_ab.py --setting split:MAGI_DIST_BWD_SPLIT=1 \
      --setting nosplit:MAGI_DIST_BWD_SPLIT=0 --masks varlen_causal,varlen_full,causal --totals $TOTALS \
      --rounds 6 --iters 6
  fi
fi
if [[ $what == one-launch ]]; then
  step native_check.log 25 300 $run2 packages/magi-comm/tests/gpu_native_check.py
  for setting in REDUCE_PROGRAMS=0 REDUCE_PROGRAMS=1000000 REDUCE_PROGRAMS=8192 REDUCE_PROGRAMS=1024 \
    ONE_LAUNCH_PULL=0; do
    name=${setting,,}  # no '=' in the log's name: the device tool does not return such files
    step "bench_comm_${name//=/_}.log" 10 200 env "MAGI_COMM_NATIVE_$setting" $run2 tools/bench_comm.py --sizes 16,64
  done
fi
if [[ $what == known-arms ]]; then
  step native_check.log 25 300 $run2 packages/magi-comm/tests/gpu_native_check.py
  step backends_differ.log 12 200 $run2 packages/magi-comm/tests/gpu_backends_differ.py
  for turn in 1 2; do
    for known in 1 0; do
      step "bench_comm_known${known}_${turn}.log" 10 200 env MAGI_COMM_NATIVE_KNOWN_ARMS=$known $run2 \
        tools/bench_comm.py --sizes 16,64
    done
  done
fi
if [[ $what == pulled-step ]]; then
  step step_ab_pulled_cp2.log 40 420 env MAGI_COMM_BACKEND=native NVSHMEM_SYMMETRIC_SIZE=8G $run2 tools/step_ab.py \
    --setting plain --setting pulled:MAGI_DIST_SYMMETRIC_PARTIALS_MB=4096 --masks varlen_causal,varlen_full \
    --totals $TOTALS --rounds 6 --iters 6
fi
if [[ $what == reduce-sweep ]]; then
  step bench_reduce_sweep.log 16 420 $run2 tools/bench_comm.py --sizes 16,64 \
    --sweep-reduce 0x0,1x4,1x8,2x4,2x8,4x8,8x8,16x16
fi
exit $rc
