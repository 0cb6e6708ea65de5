"""examples/cp_train.py: context-parallel training matches the single-process run.

The example runs as a script, as a user runs it: its ``--spawn`` ranks (magi_dist.testing.run_ranks)
load its ``run`` function from the script's path, so it needs no import path of its own.
"""

import json
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cp_train.py"


def test_cp_losses_and_gradients_match_single_process(tmp_path):
    out = tmp_path / "result.json"
    args = ["--spawn", "3", "--steps", "4", "--seqlen", "700", "--chunk", "32", "--dtype", "float64"]
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), *args, "--result", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    history = json.loads(out.read_text())["history"]
    assert len(history) == 4
    for row in history:
        assert abs(row["loss"] - row["ref_loss"]) < 1e-10, row
        assert row["grad_diff"] < 1e-10, row
    assert history[-1]["loss"] < history[0]["loss"]  # it trains
