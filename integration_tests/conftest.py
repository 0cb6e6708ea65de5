"""The tools' tests import tools/*.py by name, as the scripts import their neighbours (a script's
own folder is first on its sys.path): tools/ goes first on sys.path here, before the test modules
are collected. `run_ranks`' ranks load a test module by path in a spawned process, which starts
with its parent's sys.path (multiprocessing's spawn passes it on), so the same imports work there."""

import sys
from pathlib import Path

TOOLS = str(Path(__file__).resolve().parents[1] / "tools")
if TOOLS not in sys.path:
    sys.path.insert(0, TOOLS)
