"""examples/cp_train_transformers.py: a transformers causal LM trained with context parallelism
(dispatched input ids and position ids, attention through magi_dist.calc_attn, undispatched
logits) on 2 CPU gloo ranks matches the single-process run (attn_implementation="ffa").

Tolerance (the example's ``TOLERANCE``): per step, |loss - single-process loss| / |single-process
loss| <= 1e-5 in float32 and 1e-12 in float64 (measured: 6e-8 and 0). The example runs as a script,
as a user runs it (``--spawn 2``).
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

# (find_spec: the example's processes import transformers, this one need not)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cp_train_transformers.py"


@pytest.mark.parametrize(
    ("args", "tol"),
    [
        # Llama, float32, 2 overlap stages
        (["--dtype", "float32", "--degree", "2", "--chunk", "16"], 1e-5),
        # Mistral with a sliding window of 16 (shorter than most documents), float64
        (["--dtype", "float64", "--sliding-window", "16"], 1e-12),
    ],
    ids=["llama-float32", "mistral-window-float64"],
)
def test_cp_transformers_loss_curve_matches_single_process(tmp_path, args, tol):
    out = tmp_path / "result.json"
    common = ["--spawn", "2", "--steps", "4", "--seqlen", "300", "--check", "--result", str(out)]
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), *common, *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "check: passed" in proc.stdout, proc.stdout[-4000:]
    result = json.loads(out.read_text())
    history = result["history"]
    assert len(history) == 4 and result["ok"] and result["tolerance"] == tol
    for row in history:
        assert abs(row["loss"] - row["ref_loss"]) <= tol * abs(row["ref_loss"]), row
    assert history[-1]["loss"] < history[0]["loss"]  # it trains
