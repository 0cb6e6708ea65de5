"""Context-parallel training against one process: a small transformer (attention + MLP blocks,
AdamW, packed documents of long-tailed lengths, varlen causal) trained on cp ranks with
``magi_dist.calc_attn`` and in one process with ``flex_flash_attn_func`` on the whole sequence.

The training code is examples/cp_train.py's (`TrainConfig`, `Trainer`, `train`, `compare`,
`Tolerance`). Here: 2 CPU gloo ranks with the reference kernels, float64 (the cp run equals the
one-process run up to the order of float sums) and float32 with ``deterministic=True`` twice
(bitwise equal weights on every rank). On 2 GPUs the same code runs with NCCL, bf16 autocast and
the CuTe kernels: `test_cp_training_on_two_gpus` (``pytest -m gpu``; tools/gpu_multi.sh).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from magi_dist.testing import run_ranks

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cp_train.py"
# 600 tokens in ~20 documents, chunks of 32 (19 chunks per rank), 2 remote stages, 6 AdamW steps
CFG = {"steps": 6, "seqlen": 600, "chunk": 32, "degree": 2}


def _example():
    """examples/cp_train.py as a module (loaded by path: examples/ is no package)."""
    name = "_cp_train_example"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
    return sys.modules[name]


def cp_training(rank: int, world: int, cfg: dict) -> dict:
    """On every rank: one float64 run, then two float32 runs with deterministic=True."""
    ex = _example()
    det = ex.TrainConfig(**cfg, dtype="float32", deterministic=True)
    return {
        "float64": ex.train(ex.TrainConfig(**cfg, dtype="float64"), cp=True),
        "det": [ex.train(det, cp=True) for _ in range(2)],
    }


def _flat(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([w.reshape(-1) for _, w in sorted(weights.items())])


def test_cp_training_matches_one_process():
    ex = _example()
    ranks = run_ranks(2, cp_training, CFG, timeout=240)
    ref64 = ex.train(ex.TrainConfig(**CFG, dtype="float64"), cp=False)
    ref32 = ex.train(ex.TrainConfig(**CFG, dtype="float32", deterministic=True), cp=False)
    assert ref64["losses"][-1] < 0.9 * ref64["losses"][0], ref64["losses"]  # it trains
    for rank, out in enumerate(ranks):
        # float64: loss curve and final weights within Tolerance.of("float64") of one process
        diff, tol = ex.compare(out["float64"], ref64), ex.Tolerance.of("float64")
        assert diff["loss"] <= tol.loss and diff["weight_rel"] <= tol.weight_rel, (rank, diff, tol)
        assert diff["weight_abs"] <= 1e-12, (rank, diff)
        # float32, deterministic: the same against one process at float32's tolerance ...
        first, second = out["det"]
        diff, tol = ex.compare(first, ref32), ex.Tolerance.of("float32")
        assert diff["loss"] <= tol.loss and diff["weight_rel"] <= tol.weight_rel, (rank, diff, tol)
        # ... and bitwise the same loss curve and weights when run again
        assert first["losses"] == second["losses"], rank
        assert torch.equal(_flat(first["weights"]), _flat(second["weights"])), rank
    # every rank holds bitwise the same model (the gradients are all-reduced once per step)
    for kind in ("float64", "det"):
        runs = [out[kind] if kind == "float64" else out[kind][0] for out in ranks]
        assert all(torch.equal(_flat(r["weights"]), _flat(runs[0]["weights"])) for r in runs), kind
        assert all(r["losses"] == runs[0]["losses"] for r in runs), kind


# On 2 GPUs: NCCL, float32 weights with bf16 autocast, head dim 64 (the sm90 kernels). The first
# run checks cp against one process (Tolerance.of("bfloat16")); the second, deterministic, also
# that a second cp run gives bitwise the same weights on every rank.
GPU_ARGS = ["--dtype", "bfloat16", "--steps", "8", "--seqlen", "16384", "--chunk", "512"]
GPU_ARGS += ["--dim", "256", "--hq", "4", "--hk", "2", "--check"]


@pytest.mark.gpu
@pytest.mark.parametrize("extra", [[], ["--deterministic"]], ids=["default", "deterministic"])
def test_cp_training_on_two_gpus(extra):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [*cmd, str(EXAMPLE), *GPU_ARGS, *extra], capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    assert "check: passed" in proc.stdout, proc.stdout[-6000:]
