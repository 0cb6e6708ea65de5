"""GPU acceptance check of the native backend (a torchrun script, not collected by pytest).

    source .dk/bin/env.sh && torchrun --standalone --nproc-per-node 2 packages/magi-comm/tests/gpu_native_check.py

Phases (every rank runs the same deterministic cases; a failing comparison is recorded, not
raised, so that all ranks keep calling the collectives together):

A. default buffer:
   1. the shared randomized cases of ``magi_comm.testing`` (cast of every dtype, sum / avg /
      lse with and without acc_reduce, async, debug mode) through the native backend against
      the brute-force oracles;
   2. larger layouts with 16-byte aligned rows (vectorized kernel path), every case through
      native AND a2av: cast native == a2av == oracle bitwise, and native into a symmetric
      output (direct mode; on some ranks, at a row offset, mixed with plain outputs) == oracle; reduce sum/avg native == a2av ==
      oracle bitwise; lse native == a2av bitwise and close to the float64 oracle; reduce
      determinism: 3 native runs bitwise equal;
   3. several async casts in flight, then waited in reverse order.
B. a 1 MiB buffer (``MAGI_COMM_NATIVE_BUFFER_MB=1``): pairs larger than a region move in
   rounds; a row larger than the buffer makes it grow (log line); same comparisons.

Prints a PASS/FAIL table on rank 0 and exits non-zero on any failure. A watchdog
(``MAGI_COMM_CHECK_TIMEOUT`` seconds, default 300) dumps all stacks and exits on a hang.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import random
import sys
import time
import traceback
from collections import defaultdict

import torch
import torch.distributed as dist

SEED = 20240611


class Tally:
    def __init__(self) -> None:
        self.rows: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        self.fails: list[str] = []

    def record(self, check: str, ok: bool, detail: str = "") -> None:
        self.rows[check][0 if ok else 1] += 1
        if not ok and len(self.fails) < 30:
            self.fails.append(f"{check}: {detail}")


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        # NaN-aware bitwise comparison through an integer view
        wide = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(wide), b.contiguous().view(wide))
    return torch.equal(a, b)


def run_testlib_cases(lib, tally: Tally, rank: int, world: int, device: str) -> None:
    os.environ["MAGI_COMM_BACKEND"] = "native"
    for case in lib.make_cases(world, SEED, 60):
        name = f"testlib {case['kind']}" + (f" {case['op']}" if case["kind"] == "reduce" else "")
        try:
            lib.run_case(case, rank, world, device=device)
            tally.record(name, True)
        except AssertionError as e:
            tally.record(name, False, f"{case['dtype']} {str(e)[:200]}")
    os.environ.pop("MAGI_COMM_BACKEND", None)


def big_cases(lib, world: int, seed: int, n: int, max_size: int) -> list[dict]:
    rng = random.Random(seed)
    cases = []
    for k in range(n):
        lay = lib.random_layout(rng, world, max_splits=6, max_size=max_size)
        row = rng.choice([(4, 64), (2, 128), (8,), (3, 40)])
        cases.append({"layout": lay, "seed": seed * 1000 + k, "row_shape": row})
    return cases


def compare_cast(lib, nat, a2a, case, dtype, tally: Tally, rank: int, world: int, device: str, tag: str):
    lay = case["layout"]
    inputs = [lib.rank_data(case, r, sum(lay.in_sizes[r]), dtype) for r in range(world)]
    ins, outs, dst, src = lay.cast_args(rank)
    x = inputs[rank].to(device)
    rows = sum(outs)
    res = {}
    for name, gc in (("native", nat), ("a2av", a2a)):
        out = torch.full((rows, *case["row_shape"]), 7, dtype=dtype, device=device)
        gc.group_cast(x, out, ins, outs, dst, src).wait()
        res[name] = out.cpu()
    # direct mode: an output in the symmetric heap (collective allocation); per case and rank
    # some ranks cast into it (at row 0 or 1 of it) and others into a plain tensor: mixed modes
    sym = nat.empty_output((rows + 1, *case["row_shape"]), dtype)
    use = (case["seed"] + rank) % 3
    out = torch.full((rows, *case["row_shape"]), 7, dtype=dtype, device=device)
    if use:
        out = sym[use - 1 : use - 1 + rows]
        out.fill_(7)
    nat.group_cast(x, out, ins, outs, dst, src).wait()
    res["native-sym"] = out.cpu()
    nat.free_output(sym)
    exp = lib.cast_oracle(lay, inputs, rank, res["native"])
    tally.record(f"{tag} cast native==oracle", _bitwise(res["native"], exp), f"{dtype} {case['row_shape']}")
    tally.record(f"{tag} cast native==a2av", _bitwise(res["native"], res["a2av"]), f"{dtype}")
    tally.record(
        f"{tag} cast native symmetric out==oracle", _bitwise(res["native-sym"], exp), f"{dtype} use={use}"
    )


def compare_reduce(lib, nat, a2a, case, dtype, op, acc, tally, rank, world, device, tag):
    lay = case["layout"]
    ins, outs, dst, src_idx = lay.reduce_args(rank)
    inputs = [lib.rank_data(case, r, sum(lay.out_sizes[r]), dtype) for r in range(world)]
    rows = sum(lay.in_sizes[rank])
    old = lib.rank_data(case, rank, rows, dtype, salt=1)
    kw = {"reduce_op": op, "acc_reduce": acc}
    in_lses = old_lse = None
    if op == "lse":
        in_lses = [lib.rank_lse(case, r, sum(lay.out_sizes[r])) for r in range(world)]
        old_lse = lib.rank_lse(case, rank, rows, salt=1)
    results = []
    for name, gc, reps in (("a2av", a2a, 1), ("native", nat, 3)):
        for _ in range(reps):
            out = old.to(device, copy=True)
            if op == "lse":
                out_lse = old_lse.to(device, copy=True)
                kw.update(input_lse=in_lses[rank].to(device), output_lse=out_lse)
            gc.group_reduce(inputs[rank].to(device), out, ins, outs, dst, src_idx, **kw).wait()
            results.append((name, out.cpu(), out_lse.cpu() if op == "lse" else None))
    (_, ref, ref_lse), nat_runs = results[0], results[1:]
    what = f"{dtype} {op} acc={acc} {case['row_shape']}"
    det = all(_bitwise(o, nat_runs[0][1]) for _, o, _ in nat_runs[1:])
    tally.record(f"{tag} reduce deterministic x3", det, what)
    same = _bitwise(nat_runs[0][1], ref) and (op != "lse" or _bitwise(nat_runs[0][2], ref_lse))
    tally.record(f"{tag} reduce native==a2av ({op})", same, what)
    if op == "lse":
        exp, exp_lse = lib.reduce_oracle_lse(lay, inputs, in_lses, rank, old, old_lse, acc)
        tol = {torch.float32: 1e-5, torch.float64: 1e-10}.get(dtype, 1e-2)
        o, ol = nat_runs[0][1], nat_runs[0][2]
        ok = not torch.isnan(o).any() and torch.equal(torch.isneginf(ol), torch.isneginf(exp_lse))
        ok = ok and torch.allclose(ol.double(), exp_lse, rtol=1e-5, atol=1e-5)
        ok = ok and torch.allclose(o.double(), exp, rtol=tol, atol=tol)
        tally.record(f"{tag} reduce native~oracle (lse)", bool(ok), what)
    else:
        exp = lib.reduce_oracle_sum_avg(lay, inputs, rank, old, op, acc)
        tally.record(f"{tag} reduce native==oracle ({op})", _bitwise(nat_runs[0][1], exp), what)
        # pull: an input in the symmetric heap (collective allocation); per case and rank some
        # ranks reduce from it (at row 0 or 1: the second is not 16-byte aligned for small
        # rows, then its rows are sent) and others from a plain tensor: mixed modes, 3 runs
        n_in = inputs[rank].shape[0]
        sym = nat.empty_output((n_in + 1, *case["row_shape"]), dtype)
        use = (case["seed"] + rank) % 3
        src = inputs[rank].to(device)
        if use:
            src = sym[use - 1 : use - 1 + n_in]
            src.copy_(inputs[rank].to(device))
        runs = []
        for _ in range(3):
            out = old.to(device, copy=True)
            nat.group_reduce(src, out, ins, outs, dst, src_idx, **kw).wait()
            runs.append(out.cpu())
        ok = all(_bitwise(o, exp) for o in runs) and _bitwise(src.cpu(), inputs[rank])
        tally.record(f"{tag} reduce native symmetric in==oracle x3 ({op})", ok, f"{what} use={use}")
        nat.free_output(sym)


def run_big(lib, nat, a2a, tally, rank, world, device, tag, seed, n, max_size):
    rng = random.Random(seed + 1)
    for case in big_cases(lib, world, seed, n, max_size):
        cdt = rng.choice([torch.bfloat16, torch.float32, torch.float16, torch.int64, torch.uint8])
        compare_cast(lib, nat, a2a, case, cdt, tally, rank, world, device, tag)
        rdt = rng.choice([torch.bfloat16, torch.float32, torch.float16, torch.float64])
        op = rng.choice(["sum", "sum", "avg", "lse"])
        if op == "lse" and len(case["row_shape"]) < 2:
            case = dict(case, row_shape=(2, 64))
        compare_reduce(lib, nat, a2a, case, rdt, op, rng.random() < 0.5, tally, rank, world, device, tag)


def run_async(lib, nat, tally, rank, world, device):
    cases = big_cases(lib, world, SEED + 5, 4, 50)
    pending = []
    for case in cases:
        lay = case["layout"]
        inputs = [lib.rank_data(case, r, sum(lay.in_sizes[r]), torch.bfloat16) for r in range(world)]
        ins, outs, dst, src = lay.cast_args(rank)
        out = torch.zeros((sum(outs), *case["row_shape"]), dtype=torch.bfloat16, device=device)
        work = nat.group_cast(inputs[rank].to(device), out, ins, outs, dst, src, async_op=True)
        pending.append((work, out, lay, inputs))
    for work, out, lay, inputs in reversed(pending):
        work.wait()
        exp = lib.cast_oracle(lay, inputs, rank, out.cpu())
        tally.record("A async casts in flight", _bitwise(out.cpu(), exp))


def run_growth(nat, tally, rank, world, device):
    """A row of 2 MiB with a 1 MiB buffer: the buffer must grow on every rank at once."""
    from magi_comm.backends.native import NativeBackend

    backend = nat._backend
    assert isinstance(backend, NativeBackend)
    before = backend.capacity
    row = (1, 1 << 20)  # bf16: 2 MiB per row
    ins, outs = [1] * world, [1] * world
    dst = [[(rank + i) % world] for i in range(world)]
    src = [(rank - i) % world for i in range(world)]
    x = torch.stack([torch.full(row, float(rank * 10 + i), dtype=torch.bfloat16) for i in range(world)]).to(
        device
    )
    out = torch.empty((world, *row), dtype=torch.bfloat16, device=device)
    nat.group_cast(x, out, ins, outs, dst, src).wait()
    ok = all(torch.all(out[i].cpu() == float(((rank - i) % world) * 10 + i)).item() for i in range(world))
    tally.record("B growth: cast of 2 MiB rows", ok, f"rank {rank}")
    tally.record(
        "B growth: buffer grew", world == 1 or backend.capacity > before, f"{before} -> {backend.capacity}"
    )


def main() -> int:
    timeout = int(os.environ.get("MAGI_COMM_CHECK_TIMEOUT", "300"))
    faulthandler.dump_traceback_later(timeout, exit=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    logging.getLogger("magi_comm").setLevel(logging.INFO)
    import magi_comm.testing as lib

    rank, world, local_rank = lib.init_torchrun_gpus(120)
    device = f"cuda:{local_rank}"
    from magi_comm import GroupCollective
    from magi_comm.backends import native as native_mod

    tally = Tally()
    t0 = time.time()
    try:
        # ---- phase A: default buffer
        run_testlib_cases(lib, tally, rank, world, device)
        magi_comm_close_defaults()
        with GroupCollective(None, "native") as nat, GroupCollective(None, "a2av") as a2a:
            run_big(lib, nat, a2a, tally, rank, world, device, "A", SEED + 1, 40, 300)
            run_async(lib, nat, tally, rank, world, device)
        # ---- phase B: 1 MiB buffer -> rounds, then growth
        os.environ[native_mod.ENV_BUFFER_MB] = "1"
        with GroupCollective(None, "native") as nat, GroupCollective(None, "a2av") as a2a:
            assert nat._backend.capacity == 1 << 20, nat._backend.capacity
            run_big(lib, nat, a2a, tally, rank, world, device, "B", SEED + 2, 12, 600)
            run_growth(nat, tally, rank, world, device)
            run_big(lib, nat, a2a, tally, rank, world, device, "B after growth", SEED + 3, 6, 300)
        os.environ.pop(native_mod.ENV_BUFFER_MB, None)
    except Exception:
        tally.record("no exception", False, traceback.format_exc()[-1500:])
        traceback.print_exc()
    else:
        tally.record("no exception", True)
    # every rank's verdict
    mine = torch.tensor([sum(v[1] for v in tally.rows.values())], dtype=torch.int64)
    allf = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(allf, mine)
    failed = sum(int(t) for t in allf)
    if rank == 0 or tally.fails:
        print(f"\n## native backend GPU check, rank {rank}/{world}, {time.time() - t0:.1f} s\n")
        print("| check | pass | fail |\n|---|---:|---:|")
        for k, (p, f) in sorted(tally.rows.items()):
            print(f"| {k} | {p} | {f} |")
        for line in tally.fails:
            print(f"FAIL rank {rank}: {line}")
    if rank == 0:
        print(f"\nRESULT: {'PASS' if failed == 0 else f'FAIL ({failed} failed checks over all ranks)'}")
    try:
        native_mod.shutdown()
    except Exception as e:  # pragma: no cover - diagnostics only
        print(f"rank {rank}: NVSHMEM shutdown failed: {e}")
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    return 0 if failed == 0 else 1


def magi_comm_close_defaults() -> None:
    import magi_comm

    magi_comm.close_default_collectives()


if __name__ == "__main__":
    sys.exit(main())
