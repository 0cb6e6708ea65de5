"""GPU check: two ranks whose backends differ end in an error, never in stale rows (a torchrun
script, not collected by pytest).

    source .dk/bin/env.sh && torchrun --standalone --nproc-per-node 2 packages/magi-comm/tests/gpu_backends_differ.py

Both ranks create a native backend with the defaults (one launch, the arm known); rank 1 also
creates one with ``fused_reduce=False``, which turns one launch off on rank 1 only (no
collective: the misuse docs/native.md "The arm known" guards against). Call 1: both reduce from
symmetric inputs with the first backend (rank 0 in one launch, rank 1 through the fused
reduction's send launch, its rows pulled by rank 0; checked against the oracle). Call 2: rank 0
again; rank 1 with the staged backend, enqueued only once rank 0's map for call 2 is in rank 1's
pull-map area (rank 1 clears that row's header after call 1, then polls it), so that rank 0, its
peer's arm known, has published its map against the accept word of call 1. Rank 1's receive copy
must stop with an error (a trap) well before the wait bound (``MAGI_COMM_NATIVE_WAIT_TIMEOUT_S``,
40 s here), not return the rows of call 1; rank 0 must end in an error too (its wait for rank
1's DONE). The verdicts travel over gloo (the
CUDA contexts are in error); prints RESULT on rank 0.
"""

from __future__ import annotations

import faulthandler
import os
import random
import sys
import time

import torch
import torch.distributed as dist

QUICK_S = 20.0  # rank 1's error must come sooner than this (the wait bound is 40 s)
MAP_WAIT_S = 10.0  # how long rank 1 waits for rank 0's second map before it gives up


def await_second_map(header: torch.Tensor, rank: int, host) -> bool:
    """Call 2's order: rank 1 enqueues its staged call only once rank 0 has published its map.
    ``header``: rank 0's row header in this rank's pull-map area, which still holds call 1's map;
    rank 1 clears it (nothing reads it between calls), then, after rank 0 has passed the barrier
    and enqueued its call, polls it. False: rank 0's map did not come within ``MAP_WAIT_S``."""
    if rank == 1:
        header.zero_()
        torch.cuda.synchronize()
    dist.barrier(group=host)
    if rank == 0:
        return True
    waited = time.perf_counter()
    while int(header.item()) == 0:
        if time.perf_counter() - waited > MAP_WAIT_S:
            return False
        time.sleep(0.001)
    return True


def both_good(good: bool, world: int, host) -> bool:
    """Whether call 1 was good on every rank (over gloo): call 2 runs only after a good call 1
    on both ranks, and a rank whose call 1 failed still answers, so its peer does not pair this
    exchange with the verdicts' at the end."""
    both = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(both, torch.tensor([int(good)]), group=host)
    return all(int(x) for x in both)


def main() -> int:
    faulthandler.dump_traceback_later(150, exit=True)
    os.environ["MAGI_COMM_NATIVE_WAIT_TIMEOUT_S"] = "40"  # read when the kernels are imported; > QUICK_S
    import magi_comm.testing as lib

    rank, world, local_rank = lib.init_torchrun_gpus(90)
    assert world == 2, "run on 2 GPUs"
    host = dist.new_group(backend="gloo")  # the call-2 barrier and the verdicts, made while CUDA works
    from magi_comm._plan import build_reduce_plan
    from magi_comm.backends.native import NativeBackend, NativeConfig

    rng = random.Random(5)  # every rank sends three splits to both ranks
    lay = lib._complete(rng, world, [[64, 96, 32]] * world, [[rng.sample(range(world), world)] * 3] * world)
    plan = build_reduce_plan(*lay.reduce_args(rank), rank, world)
    dev = torch.device("cuda", local_rank)
    case = {"seed": 51, "row_shape": (256,)}
    fused = NativeBackend(dist.group.WORLD, rank, world, NativeConfig())
    staged = (
        NativeBackend(dist.group.WORLD, rank, world, NativeConfig(fused_reduce=False)) if rank == 1 else None
    )
    sym = fused.empty_output((plan.num_input_rows, 256), torch.float32)
    verdict, detail = 1, ""
    for call in (1, 2):
        inputs = [
            lib.rank_data(case, r, sum(lay.out_sizes[r]), torch.float32, salt=call) for r in range(world)
        ]
        sym.copy_(inputs[rank].to(dev))
        old = lib.rank_data(case, rank, plan.num_output_rows, torch.float32, salt=100 + call)
        out = old.to(dev)
        want = lib.reduce_oracle_sum_avg(lay, inputs, rank, old, "sum", True)
        be = staged if call == 2 and staged is not None else fused
        # source 0's row of the flat (W x map_width) pull-map area: its first word, the header
        if call == 2 and not await_second_map(fused._require().pull_maps[:1], rank, host):
            detail = (
                f"call 2 not ordered: rank 0 published no map within {MAP_WAIT_S} s (the check did not run)"
            )
            break
        start = time.perf_counter()
        # the kernels' error may surface at any later CUDA call, the staged call's own enqueue
        # included (its torch reduction follows the receive copy that trapped): caught there too
        error = None
        try:
            be.group_reduce(sym, out, plan, False, "sum", None, None, True).wait()
        except RuntimeError as e:
            error = e
        if error is None:
            try:
                torch.cuda.synchronize()
                got = out.cpu()
            except RuntimeError as e:
                error = e
        if error is not None:  # only a CUDA error (the kernels' own) counts
            took, what = time.perf_counter() - start, str(error).splitlines()[0][:120]
            if call == 1 or "CUDA error" not in what:
                detail = f"call {call}: {what}"
            elif rank == 1:
                verdict = 0 if took < QUICK_S else 1
                detail = f"call 2: error after {took:.2f} s ({what})"
                if verdict:  # its wait's bound, not the check's trap
                    detail += f"; later than {QUICK_S} s: the staged receive copy did not trap"
            else:
                verdict, detail = 0, f"call 2: error after {took:.2f} s (its DONE wait)"
            if call == 1:  # the peer waits for this rank's call-1 verdict
                both_good(False, world, host)
            break
        if call == 1:
            if not both_good(torch.equal(got, want), world, host):
                detail = "call 1: a result differs from the oracle or failed (on some rank)"
                break
        else:
            same = torch.equal(got, want)
            detail = f"call 2 returned without an error (result {'equal to' if same else 'not'} the oracle)"
    print(f"rank {rank}: {'ok' if verdict == 0 else 'FAIL'}: {detail}", flush=True)
    verdicts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(verdicts, torch.tensor([verdict]), group=host)
    failed = sum(int(v) for v in verdicts)
    if rank == 0:
        print(f"RESULT: {'PASS' if failed == 0 else f'FAIL ({failed} ranks)'}", flush=True)
    sys.stdout.flush()
    os._exit(0 if failed == 0 else 1)  # no teardown: the CUDA contexts are in error


if __name__ == "__main__":
    main()
