"""The native backend's Triton kernels compiled and run on one GPU (no NVLink peer needed).

Every rank's memory of the simulation lies on the one device, so "peer" addresses are local:
this checks the compiled code paths (vector loads at the pull offsets, the publish step, the
DONE step's atomics, the launch through the cached compiled kernel) against the oracle, not
the transport between GPUs (``gpu_native_check.py`` does that on two).
"""

import random

import pytest
import torch

import magi_comm.testing as lib
from magi_comm.testing import native_sim, native_sim_reduce

pytestmark = pytest.mark.gpu


def test_publish_step_on_gpu():
    native_sim.main_triton_publish("cuda")


@pytest.mark.parametrize("seed", range(6))
def test_fused_reduce_reads_pulled_rows_on_gpu(seed):
    rng = random.Random(seed)
    for _ in range(4):
        world = rng.randint(2, 4)
        lay = lib.random_layout(rng, world, max_splits=4, max_size=40)
        dtype = rng.choice([torch.bfloat16, torch.float32, torch.float16, torch.float64])
        pull = frozenset(r for r in range(world) if rng.random() < 0.6)
        E = rng.choice([3, 8, 64, 1024])  # 16-byte rows and wider: vector loads at pull offsets
        native_sim_reduce.check_fused_reduce(lay, 200, dtype, rng.choice(["sum", "avg"]), rng.random() < 0.5,
                                             use_triton=True, E=E, waits=rng.random() < 0.3, pull_ranks=pull,
                                             device="cuda")  # fmt: skip
