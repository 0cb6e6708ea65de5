"""Multi-process gloo tests: random global layouts on 2, 3 and 4 ranks against the oracle.

One start per world size; every worker runs the same deterministic list of cases (drawn in
the parent from a fixed seed). Workers come from a "forkserver" that imported torch once
(preload), which cuts start-up from ~2.5 s of CPU per worker (a fresh torch import under
"spawn") to a fork; unlike plain "fork" the workers do not inherit the test process's state
(gloo groups of other tests, thread pools).
"""

import multiprocessing

import pytest
import torch.multiprocessing as mp

import magi_comm.testing as lib

SEED = 20240611
CASES_PER_WORLD = 60
# Only takes effect when this process starts its forkserver; import errors there are ignored.
multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "magi_comm", "magi_comm.testing"])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_gloo_random_layouts(world, tmp_path):
    cases = lib.make_cases(world, SEED, CASES_PER_WORLD)
    # On 4 ranks also run a few layouts on the subgroup {1, 3} (group ranks 0, 1).
    sub_cases = lib.make_cases(2, SEED + 1, 10) if world == 4 else []
    mp.spawn(
        lib.gloo_worker, args=(world, str(tmp_path / "store"), cases, sub_cases), nprocs=world, join=True
    )


def test_case_mix_covers_everything():
    """The drawn cases exercise every feature the brief lists (guards against a weak seed)."""
    cases = [c for w in (2, 3, 4) for c in lib.make_cases(w, SEED, CASES_PER_WORLD)]
    kinds = {(c["kind"], c.get("op"), c.get("acc")) for c in cases}
    for op in ("sum", "avg", "lse"):
        for acc in (True, False):
            assert ("reduce", op, acc) in kinds
    assert ("cast", None, None) in kinds
    assert {c["dtype"] for c in cases} >= {"float32", "bfloat16", "float16"}
    assert any(c["async"] for c in cases) and any(c["debug"] for c in cases)
    lays = [c["layout"] for c in cases]
    assert any(0 in sizes for lay in lays for sizes in lay.in_sizes)  # empty splits
    assert any(len(d) > 1 for lay in lays for ds in lay.dst for d in ds)  # one split, many ranks
    assert any(r in d for lay in lays for r, ds in enumerate(lay.dst) for d in ds)  # send to self
    assert any(len(d) == 0 for lay in lays for ds in lay.dst for d in ds)  # sent nowhere


@pytest.mark.gpu
def test_nccl_random_layouts(tmp_path):
    import torch

    world = min(torch.cuda.device_count(), 4)
    if world < 2:
        pytest.skip("needs at least 2 CUDA devices")
    cases = lib.make_cases(world, SEED, CASES_PER_WORLD)
    mp.start_processes(
        lib.nccl_worker,
        args=(world, str(tmp_path / "store"), cases),
        nprocs=world,
        join=True,
        start_method="spawn",
    )
