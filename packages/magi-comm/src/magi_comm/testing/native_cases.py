"""Randomized calls of the native backend checked against the oracles, shared by the fake-world
tests (``test_native_fake.py``, ``test_native_compile.py``).

A *case* is one call: a random layout, a row shape and dtype, and for a cast whether ranks cast
into a symmetric output (direct mode), for a reduce whether ranks reduce from a symmetric input
(pull). :func:`draw` draws a list of them; :func:`run` runs one on a backend, collectively.
"""

from __future__ import annotations

import random

import torch

import magi_comm.testing as lib
from magi_comm._plan import build_cast_plan, build_reduce_plan

__all__ = ["draw", "run", "run_cast", "run_reduce"]


def draw(world: int, seed: int, n: int, big: bool) -> list[dict]:
    """``n`` cases on ``world`` ranks drawn from ``seed``; ``big``: rows of 64 KiB (calls in
    rounds with a 1 MiB buffer), else small rows."""
    rng = random.Random(seed)
    out = []
    for k in range(n):
        lay = lib.random_layout(rng, world, max_splits=4, max_size=5)
        row = rng.choice([(16384,), (2, 8192)]) if big else rng.choice([(), (3,), (2, 3), (4, 16)])
        case = {"layout": lay, "seed": seed * 1000 + k, "row_shape": row, "async": rng.random() < 0.3}
        if k % 2 == 0:
            case.update(kind="cast", dtype=rng.choice(["float32", "bfloat16", "int16", "bool", "int64"]))
            # symmetric outputs: which ranks cast into one (direct mode), at which row offset
            case.update(
                direct=rng.random() < 0.6, direct_bits=rng.randrange(1 << world), lead=rng.choice([0, 0, 1])
            )
        else:
            op = rng.choice(["sum", "avg", "lse"])
            case.update(kind="reduce", op=op, acc=rng.random() < 0.5)
            # symmetric inputs: which ranks reduce from one (peers may read it in place), at
            # which row offset (not 16-byte aligned for small rows: then the rows are sent)
            case.update(
                pull=rng.random() < 0.6, pull_bits=rng.randrange(1 << world), lead=rng.choice([0, 0, 1])
            )
            case["dtype"] = rng.choice(["float32", "bfloat16", "float64", "float16"])
            if op == "lse" and len(row) < 2:
                case["row_shape"] = (2, 3)
        out.append(case)
    return out


def run_cast(be, case, rank, world):
    lay, dtype = case["layout"], lib.DTYPES[case["dtype"]]
    inputs = [lib.rank_data(case, r, sum(lay.in_sizes[r]), dtype) for r in range(world)]
    ins, outs, dst, src = lay.cast_args(rank)
    plan = build_cast_plan(ins, outs, dst, src, rank, world)
    out = torch.zeros((sum(outs), *case["row_shape"]), dtype=dtype)
    sym = None
    if case.get("direct"):
        # collective; every rank allocates, the ranks in direct_bits cast into it (a row range
        # starting `lead` rows in: not 16-byte aligned for small rows, then regions are used)
        sym = be.empty_output((sum(outs) + 1, *case["row_shape"]), dtype)
        if case["direct_bits"] >> rank & 1:
            out = sym[case["lead"] : case["lead"] + sum(outs)]
            out.fill_(0)
    elif case["async"] and out.dim() > 1 and out.shape[0] > 1:
        out = out.t().contiguous().t() if out.dim() == 2 else out  # non-contiguous output
    be.group_cast(inputs[rank], out, plan, case["async"]).wait()
    exp = lib.cast_oracle(lay, inputs, rank, out)
    assert torch.equal(out, exp), (rank, case)
    if sym is not None:
        be.free_output(sym)


def run_reduce(be, case, rank, world):
    lay, dtype, op, acc = case["layout"], lib.DTYPES[case["dtype"]], case["op"], case["acc"]
    ins, outs, dst, src = lay.reduce_args(rank)
    plan = build_reduce_plan(ins, outs, dst, src, rank, world)
    inputs = [lib.rank_data(case, r, sum(lay.out_sizes[r]), dtype) for r in range(world)]
    rows = sum(lay.in_sizes[rank])
    old = lib.rank_data(case, rank, rows, dtype, salt=1)
    out = old.clone()
    sym = src = None
    if case.get("pull"):
        # collective; the ranks in pull_bits reduce from a row range of a symmetric tensor
        n = inputs[rank].shape[0]
        sym = be.empty_output((n + 1, *case["row_shape"]), dtype)
        if case["pull_bits"] >> rank & 1:
            src = sym[case["lead"] : case["lead"] + n]
            src.copy_(inputs[rank])
    if op == "lse":
        in_lses = [lib.rank_lse(case, r, sum(lay.out_sizes[r])) for r in range(world)]
        old_lse = lib.rank_lse(case, rank, rows, salt=1)
        out_lse = old_lse.clone()
        be.group_reduce(inputs[rank], out, plan, case["async"], op, in_lses[rank], out_lse, acc).wait()
        exp, exp_lse = lib.reduce_oracle_lse(lay, inputs, in_lses, rank, old, old_lse, acc)
        tol = {torch.float32: 1e-5, torch.float64: 1e-10}.get(dtype, 1e-2)
        torch.testing.assert_close(out_lse.double(), exp_lse, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.double(), exp, rtol=tol, atol=tol)
    else:
        own = inputs[rank] if src is None else src
        be.group_reduce(own, out, plan, case["async"], op, None, None, acc).wait()
        exp = lib.reduce_oracle_sum_avg(lay, inputs, rank, old, op, acc)
        assert torch.equal(out, exp), (rank, case)
        assert torch.equal(own, inputs[rank])  # read in place, never written
    if sym is not None:
        be.free_output(sym)  # collective: also waits until every peer is done reading it


def run(be, case, rank, world) -> None:
    """Run ``case`` on backend ``be`` as ``rank`` of ``world`` (collective) and check it."""
    (run_cast if case["kind"] == "cast" else run_reduce)(be, case, rank, world)
