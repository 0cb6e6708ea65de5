"""examples/cp_train.py: context-parallel training matches the single-process run."""

import importlib
import sys
from pathlib import Path


def load_example():
    # importable by name: spawned ranks unpickle its worker function (they inherit sys.path)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    return importlib.import_module("cp_train")


def test_cp_losses_and_gradients_match_single_process():
    example = load_example()
    result = example.main(
        ["--spawn", "3", "--steps", "4", "--seqlen", "700", "--chunk", "32", "--dtype", "float64"]
    )
    history = result["history"]
    assert len(history) == 4
    for row in history:
        assert abs(row["loss"] - row["ref_loss"]) < 1e-10, row
        assert row["grad_diff"] < 1e-10, row
    assert history[-1]["loss"] < history[0]["loss"]  # it trains
