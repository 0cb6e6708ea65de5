"""The magi-plan CLI and the package's import footprint."""

import json
import subprocess
import sys

import pytest

from magi_solver import DistAttnPlan
from magi_solver.cli import main


def test_demo_report(capsys):
    assert main(["--demo"]) == 0
    out = capsys.readouterr().out
    assert "imbalance (max/mean area)" in out and "ring attention" in out
    assert "cp 8" in out and "lpt_swap" in out


def test_builder_args_json_out_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png, js = tmp_path / "m.png", tmp_path / "plan.json"
    args = [
        "--mask",
        "varlen",
        "--mask-args",
        '{"cu_seqlens_q": [0, 300, 1024], "causal": true}',
        "--cp",
        "4",
    ]
    assert (
        main([*args, "--chunk-size", "64", "--degree", "dynamic", "--plot", str(png), "--json-out", str(js)])
        == 0
    )
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    plan = DistAttnPlan.model_validate_json(js.read_text())
    assert plan.cp_size == 4 and plan.chunk_size == 64


def test_slices_file(tmp_path, capsys):
    f = tmp_path / "mask.json"
    f.write_text(
        json.dumps(
            {
                "q_ranges": [[0, 64], [64, 128]],
                "k_ranges": [[0, 64], [0, 128]],
                "mask_types": ["full", "causal"],
                "total_seqlen_q": 128,
                "total_seqlen_k": 128,
            }
        )
    )
    assert main(["--slices", str(f), "--cp", "2", "--degree", "0"]) == 0
    assert "overlap degree 0" in capsys.readouterr().out


def test_unknown_builder_is_reported(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--mask", "spiral", "--cp", "2"])
    assert exc.value.code == 2
    assert "magi-plan: error: --mask: unknown builder 'spiral'" in capsys.readouterr().err


def test_import_pulls_neither_torch_nor_numpy():
    code = "import sys, magi_solver, magi_solver.cli; print('torch' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
