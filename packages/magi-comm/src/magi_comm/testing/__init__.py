"""Shared test helpers: random global layouts, brute-force oracles, the gloo worker.

Part of the installed package (``magi_comm.testing``), so that spawned worker processes can
import the worker function by name. The native backend's simulations live beside it:
:mod:`magi_comm.testing.native_sim` (every rank's transport in one process, the kernels under
the Triton interpreter), :mod:`magi_comm.testing.native_sim_reduce` (the fused reduction in that
simulation) and :mod:`magi_comm.testing.native_fake` (the backend end to end with ranks as
threads).

A *layout* is the GLOBAL description of one group_cast: every rank's input splits with their
destination sets, and every rank's output splits with their source, interleaved at random but
respecting the pairing rule of docs/api.md (per sender/receiver pair, sender input order = receiver
output order). The matching group_reduce is its transpose, so one generator serves both.
"""

from __future__ import annotations

import datetime
import os
import random
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist

import magi_comm
from magi_comm._plan import build_cast_plan, build_reduce_plan
from magi_comm._reduce import reduce_lse, reduce_sum_avg

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int16": torch.int16,
    "int64": torch.int64,
    "bool": torch.bool,
}
NINF = float("-inf")


@dataclass
class Layout:
    world: int
    in_sizes: list[list[int]]  # [rank][split]
    dst: list[list[list[int]]]  # [rank][split] -> destination ranks
    out_sizes: list[list[int]]  # [rank][split]
    src: list[list[int]]  # [rank][split] -> source rank
    origin: list[list[tuple[int, int]]]  # [rank][out split] -> (source rank, its input split)

    # --- per-rank arguments ---
    def cast_args(self, r: int) -> tuple[list[int], list[int], list[list[int]], list[int]]:
        return self.in_sizes[r], self.out_sizes[r], self.dst[r], self.src[r]

    def reduce_args(self, r: int) -> tuple[list[int], list[int], list[int], list[list[int]]]:
        # transpose: the cast's outputs are the reduce's inputs and vice versa
        return self.out_sizes[r], self.in_sizes[r], self.src[r], self.dst[r]


def random_layout(rng: random.Random, world: int, max_splits: int = 4, max_size: int = 5) -> Layout:
    in_sizes, dst = [], []
    for _ in range(world):
        n = rng.randint(0, max_splits)
        in_sizes.append(
            [rng.choice([0, rng.randint(1, max_size), rng.randint(1, max_size)]) for _ in range(n)]
        )
        # a random subset in random order: possibly empty, possibly containing the sender
        dst.append([rng.sample(range(world), rng.randint(0, world)) for _ in range(n)])
    return _complete(rng, world, in_sizes, dst)


def _complete(rng: random.Random, world: int, in_sizes, dst) -> Layout:
    out_sizes, src, origin = [], [], []
    for d in range(world):
        queues = [[(s, i) for i, ds in enumerate(dst[s]) if d in ds] for s in range(world)]
        seq = []
        while any(queues):
            q = rng.choice([q for q in queues if q])
            seq.append(q.pop(0))
        origin.append(seq)
        out_sizes.append([in_sizes[s][i] for s, i in seq])
        src.append([s for s, _ in seq])
    return Layout(world, in_sizes, dst, out_sizes, src, origin)


def special_layouts(world: int) -> list[Layout]:
    rng = random.Random(world)
    return [
        _complete(rng, world, [[] for _ in range(world)], [[] for _ in range(world)]),  # nothing at all
        _complete(
            rng, world, [[3]] + [[] for _ in range(world - 1)], [[list(range(world))]] + [[]] * (world - 1)
        ),
        # everything to self only, plus zero-size splits sent everywhere
        _complete(
            rng,
            world,
            [[2, 0, 1] for _ in range(world)],
            [[[r], list(range(world)), [r]] for r in range(world)],
        ),
    ]


def make_cases(world: int, seed: int, n: int) -> list[dict]:
    """Deterministic list of cases (plain data, picklable) shared by every worker."""
    rng = random.Random(seed * 1000 + world)
    layouts = special_layouts(world) + [random_layout(rng, world) for _ in range(n)]
    cases = []
    for k, lay in enumerate(layouts):
        kind = "cast" if k % 2 == 0 else "reduce"
        if k < 3:  # run the special layouts through both
            kind = "both"
        case = {
            "layout": lay,
            "seed": seed * 100_000 + world * 1000 + k,
            "async": rng.random() < 0.3,
            "debug": rng.random() < 0.3,
            "via_object": rng.random() < 0.3,
            "row_shape": rng.choice([(), (3,), (2, 3)]),
        }
        for sub in ("cast", "reduce") if kind == "both" else (kind,):
            c = dict(case, kind=sub)
            if sub == "cast":
                c["dtype"] = rng.choice(["float32", "bfloat16", "float16", "int16", "int64", "bool"])
            else:
                c["op"] = rng.choice(["sum", "avg", "lse"])
                c["acc"] = rng.random() < 0.5
                c["dtype"] = rng.choice(["float32", "float32", "bfloat16", "float16", "float64"])
                if c["op"] == "lse":
                    c["row_shape"] = (2, 3)
            cases.append(c)
    return cases


# --------------------------------------------------------------------------------------------
# data


def rank_data(case: dict, r: int, rows: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(case["seed"] * 131 + r * 7 + salt)
    shape = (rows, *case["row_shape"])
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if not dtype.is_floating_point:
        return torch.randint(-30000, 30000, shape, generator=g).to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


def rank_lse(case: dict, r: int, rows: int, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(case["seed"] * 977 + r * 13 + salt)
    lse = torch.randn((rows, case["row_shape"][0]), generator=g) * 2
    lse[torch.rand(lse.shape, generator=g) < 0.3] = NINF
    return lse


def _split(t: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(torch.split(t, sizes)) if sizes else []


# --------------------------------------------------------------------------------------------
# oracles (pure python over splits; no plan code involved)


def cast_oracle(lay: Layout, inputs: list[torch.Tensor], d: int, like: torch.Tensor) -> torch.Tensor:
    parts = [_split(inputs[s], lay.in_sizes[s])[i] for s, i in lay.origin[d]]
    return torch.cat(parts) if parts else like.new_empty((0, *like.shape[1:]))


def _reduce_terms(lay: Layout, inputs, r: int):
    """For each output split i of rank r (reduce view): [(source d, that source's rows)] ascending."""
    splits = {d: _split(inputs[d], lay.out_sizes[d]) for d in range(lay.world)}
    terms = []
    for i, ds in enumerate(lay.dst[r]):
        t = []
        for d in sorted(ds):
            j = lay.origin[d].index((r, i))
            t.append((d, splits[d][j]))
        terms.append(t)
    return terms


def reduce_oracle_sum_avg(lay, inputs, r, old: torch.Tensor, op: str, acc: bool) -> torch.Tensor:
    """Sequential float32 (float64) accumulation in the documented order: bitwise reference."""
    adt = torch.float64 if old.dtype == torch.float64 else torch.float32
    olds = _split(old, lay.in_sizes[r])
    res = []
    for i, terms in enumerate(_reduce_terms(lay, inputs, r)):
        a = olds[i].to(adt) if acc else torch.zeros(olds[i].shape, dtype=adt)
        for _, x in terms:
            a = a + x.to(adt)
        if op == "avg":
            a = a / max(1, len(terms) + int(acc))
        res.append(a.to(old.dtype))
    return torch.cat(res) if res else old.clone()


def reduce_oracle_lse(lay, inputs, in_lses, r, old, old_lse, acc):
    """Direct float64 log-sum-exp merge."""
    olds, old_lses = _split(old, lay.in_sizes[r]), _split(old_lse, lay.in_sizes[r])
    lse_terms = _reduce_terms(lay, in_lses, r)
    outs, lses = [], []
    for i, terms in enumerate(_reduce_terms(lay, inputs, r)):
        os_ = [x.double() for _, x in terms]
        ls = [x.double() for _, x in lse_terms[i]]
        if acc:
            os_.insert(0, olds[i].double())
            ls.insert(0, old_lses[i].double())
        shape = olds[i].shape
        if not ls:
            outs.append(torch.zeros(shape, dtype=torch.float64))
            lses.append(torch.full(shape[:2], NINF, dtype=torch.float64))
            continue
        L = torch.stack(ls)  # (terms, rows, heads)
        lse = torch.logsumexp(L, dim=0)
        out = torch.zeros(shape, dtype=torch.float64)
        for o, l in zip(os_, ls):
            w = torch.exp(l - lse)
            w = torch.where(torch.isnan(w), 0.0, w)  # all -inf row: exp(nan)
            out += torch.where((w > 0)[..., None], w[..., None] * torch.nan_to_num(o), 0.0)
        outs.append(out)
        lses.append(lse)
    if not outs:
        return old.double(), old_lse.double()
    return torch.cat(outs), torch.cat(lses)


# --------------------------------------------------------------------------------------------
# one case on one rank


def _initial_output(case, r, rows, dtype, fill_nan: bool):
    t = rank_data(case, r, rows, dtype, salt=1)
    if fill_nan and dtype.is_floating_point:
        t.fill_(float("nan"))
    return t


def run_case(case: dict, rank: int, world: int, group=None, device: str = "cpu") -> None:
    """Run one case collectively on this rank and assert against the oracle.

    Data and oracle live on the CPU; the collective runs on copies on ``device``.
    """
    lay: Layout = case["layout"]
    dtype = DTYPES[case["dtype"]]
    old_debug = os.environ.get("MAGI_COMM_DEBUG")
    os.environ["MAGI_COMM_DEBUG"] = "1" if case["debug"] else "0"
    try:
        if case["kind"] == "cast":
            _run_cast(case, lay, rank, world, dtype, group, device)
        else:
            _run_reduce(case, lay, rank, world, dtype, group, device)
    finally:
        if old_debug is None:
            os.environ.pop("MAGI_COMM_DEBUG", None)
        else:
            os.environ["MAGI_COMM_DEBUG"] = old_debug


def _call(case, name, group, *args, **kw):
    if case["via_object"]:
        gc = magi_comm.get_group_collective(group)
        return getattr(gc, name)(*args, **kw)
    return getattr(magi_comm, name)(*args, group=group, **kw)


def _finish(case, work, output):
    if case["async"]:
        res = work.wait()
    else:
        assert work.is_completed()
        res = work.wait()
    assert res is output
    assert work.is_completed()


def _run_cast(case, lay, rank, world, dtype, group, device):
    inputs = [rank_data(case, r, sum(lay.in_sizes[r]), dtype) for r in range(world)]
    out = _initial_output(case, rank, sum(lay.out_sizes[rank]), dtype, fill_nan=True)
    ins, outs, dst, src = lay.cast_args(rank)
    out_dev = out.to(device)
    work = _call(
        case,
        "group_cast",
        group,
        inputs[rank].to(device),
        out_dev,
        ins,
        outs,
        dst,
        src,
        async_op=case["async"],
    )
    _finish(case, work, out_dev)
    out = out_dev.cpu()
    expected = cast_oracle(lay, inputs, rank, out)
    assert torch.equal(out, expected), f"group_cast mismatch on rank {rank}: {case}"


def _run_reduce(case, lay, rank, world, dtype, group, device):
    op, acc = case["op"], case["acc"]
    inputs = [rank_data(case, r, sum(lay.out_sizes[r]), dtype) for r in range(world)]
    rows = sum(lay.in_sizes[rank])
    old = _initial_output(case, rank, rows, dtype, fill_nan=not acc)
    out = old.clone()
    ins, outs, dst, src = lay.reduce_args(rank)
    kw = {"async_op": case["async"], "reduce_op": op, "acc_reduce": acc}
    if op == "lse":
        in_lses = [rank_lse(case, r, sum(lay.out_sizes[r])) for r in range(world)]
        old_lse = rank_lse(case, rank, rows, salt=1)
        if acc:  # rows whose lse is -inf may hold garbage; it must not leak into the result
            out[old_lse == NINF] = float("nan")
            old = out.clone()
        out_lse = old_lse.to(device, copy=True)
        kw.update(input_lse=in_lses[rank].to(device), output_lse=out_lse)
    out_dev = out.to(device, copy=True)
    work = _call(case, "group_reduce", group, inputs[rank].to(device), out_dev, ins, outs, dst, src, **kw)
    _finish(case, work, out_dev)
    out = out_dev.cpu()
    if op == "lse":
        out_lse = out_lse.cpu()
    if op == "lse":
        exp_out, exp_lse = reduce_oracle_lse(lay, inputs, in_lses, rank, old, old_lse, acc)
        assert not torch.isnan(out).any() and not torch.isnan(out_lse).any(), f"NaN on rank {rank}: {case}"
        assert torch.equal(torch.isneginf(out_lse), torch.isneginf(exp_lse)), case
        tol = {torch.float32: 1e-5, torch.float64: 1e-10}.get(dtype, 1e-2)
        torch.testing.assert_close(out_lse.double(), exp_lse, rtol=1e-5, atol=1e-5, equal_nan=False)
        torch.testing.assert_close(out.double(), exp_out, rtol=tol, atol=tol)
    else:
        expected = reduce_oracle_sum_avg(lay, inputs, rank, old, op, acc)
        # same additions in the same order: bitwise equal
        assert torch.equal(out, expected), f"group_reduce {op} mismatch on rank {rank}: {case}"


# --------------------------------------------------------------------------------------------
# in-process simulation of every rank (plans + reduction kernels, all-to-all done by hand)


def simulate_cast(lay: Layout, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    plans = [build_cast_plan(*lay.cast_args(r), r, lay.world) for r in range(lay.world)]
    chunks = _simulated_a2a(plans, inputs)
    outs = []
    for d, p in enumerate(plans):
        recv = torch.cat(chunks[d])
        out = inputs[d].new_empty((p.num_output_rows, *inputs[d].shape[1:]))
        if p.scatter_index is None:
            out.copy_(recv)
        else:
            out.index_copy_(0, p.scatter_index, recv)
        outs.append(out)
    return outs


def simulate_reduce(lay: Layout, inputs, olds, op, acc, in_lses=None, old_lses=None):
    plans = [build_reduce_plan(*lay.reduce_args(r), r, lay.world) for r in range(lay.world)]
    chunks = _simulated_a2a(plans, inputs)
    lse_chunks = _simulated_a2a(plans, in_lses) if op == "lse" else None
    res = []
    for d, p in enumerate(plans):
        out = olds[d].clone()
        recv = torch.cat(chunks[d])
        if op == "lse":
            assert lse_chunks is not None
            out_lse = old_lses[d].clone()
            reduce_lse(out, out_lse, recv, torch.cat(lse_chunks[d]), p.slots, acc_reduce=acc)
            res.append((out, out_lse))
        else:
            reduce_sum_avg(out, recv, p.slots, p.sources_per_row, average=op == "avg", acc_reduce=acc)
            res.append(out)
    return res


def _simulated_a2a(plans, inputs) -> list[list[torch.Tensor]]:
    world = len(plans)
    chunks: list[list[torch.Tensor | None]] = [[None] * world for _ in range(world)]
    for s, p in enumerate(plans):
        send = inputs[s] if p.gather_index is None else inputs[s].index_select(0, p.gather_index)
        assert send.shape[0] == p.num_send_rows
        for d, piece in enumerate(torch.split(send, list(p.send_counts))):
            assert piece.shape[0] == plans[d].recv_counts[s], "send/recv counts disagree"
            chunks[d][s] = piece
    return cast(list[list[torch.Tensor]], chunks)  # every slot filled: each rank sends each rank a piece


# --------------------------------------------------------------------------------------------
# multi-process worker


def gloo_worker(
    rank: int, world: int, store_path: str, cases: list[dict], subgroup_cases: list[dict]
) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    try:
        for case in cases:
            run_case(case, rank, world)
        if subgroup_cases:
            members = list(range(1, world, 2))  # e.g. ranks 1 and 3 of 4
            sub = dist.new_group(members, timeout=datetime.timedelta(seconds=60))
            if rank in members:
                for case in subgroup_cases:
                    run_case(case, members.index(rank), len(members), group=sub)
        _mismatch_checks(rank, world)
        dist.barrier()
    finally:
        magi_comm.close_default_collectives()
        dist.destroy_process_group()


def init_torchrun_gpus(timeout_s: float) -> tuple[int, int, int]:
    """A torchrun script's process group on its GPU: ``LOCAL_RANK``'s device made current,
    ``cpu:gloo,cuda:nccl`` (CPU tensors go over gloo, CUDA tensors over NCCL) with collectives
    bounded by ``timeout_s`` seconds. Returns ``(rank, world_size, local_rank)``."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group(
        "cpu:gloo,cuda:nccl",
        device_id=torch.device("cuda", local_rank),
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return dist.get_rank(), dist.get_world_size(), local_rank


def nccl_worker(rank: int, world: int, store_path: str, cases: list[dict]) -> None:
    """Same cases over NCCL with CUDA tensors (one process per GPU)."""
    torch.cuda.set_device(rank)
    store = dist.FileStore(store_path, world)
    dist.init_process_group(
        "nccl",
        store=store,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
        device_id=torch.device("cuda", rank),
    )
    try:
        for case in cases:
            run_case(case, rank, world, device=f"cuda:{rank}")
        _mismatch_checks(rank, world, device=f"cuda:{rank}")
        dist.barrier()
    finally:
        magi_comm.close_default_collectives()
        dist.destroy_process_group()


def _expect_mismatch(fn, needle: str) -> None:
    os.environ["MAGI_COMM_DEBUG"] = "1"
    try:
        fn()
    except magi_comm.PlanMismatchError as e:
        assert needle in str(e), str(e)
    else:
        raise AssertionError("expected PlanMismatchError")
    finally:
        os.environ.pop("MAGI_COMM_DEBUG", None)


def _mismatch_checks(rank: int, world: int, device: str = "cpu") -> None:
    """Debug mode must catch ranks whose arguments disagree (on every rank, no hang)."""
    # rank 0 sends 3 rows to rank 1, which expects 2 rows from rank 0
    args: tuple[list[int], list[int], list[list[int]], list[int]]  # group_cast's split arguments
    if rank == 0:
        args = ([3], [], [[1]], [])
    elif rank == 1:
        args = ([], [2], [], [0])
    else:
        args = ([], [], [], [])
    x = torch.zeros(sum(args[0]), 2, device=device)
    y = torch.zeros(sum(args[1]), 2, device=device)
    _expect_mismatch(
        lambda: magi_comm.group_cast(x, y, *args),
        "rank 0 sends rank 1 3 rows in 1 splits, but rank 1 expects 2",
    )
    # same totals, different split sizes (2+1 vs 1+2)
    rargs: tuple[list[int], list[int], list[int], list[list[int]]]  # group_reduce's split arguments
    if rank == 0:
        rargs = ([2, 1], [], [1, 1], [])
    elif rank == 1:
        rargs = ([], [1, 2], [], [[0], [0]])
    else:
        rargs = ([], [], [], [])
    x = torch.zeros(sum(rargs[0]), 2, device=device)
    y = torch.zeros(sum(rargs[1]), 2, device=device)
    _expect_mismatch(lambda: magi_comm.group_reduce(x, y, *rargs), "different split sizes")
    # dtype differs across ranks
    dt = torch.float64 if rank == world - 1 else torch.float32
    z = torch.zeros(1, 2, dtype=dt, device=device)
    _expect_mismatch(
        lambda: magi_comm.group_cast(z, z.clone(), [1], [1], [[rank]], [rank]), "shape/dtype codes"
    )
