"""tools/bench_pull_floor.py's kernels on the CPU (Triton's interpreter, in a subprocess: the
variable must be set before triton is imported): the pull + add sums, and the one-launch call's
READY / DONE words and finished-programs counter with a rank that is its own peer."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1] / "tools"

SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[1])
    import torch
    import bench_pull_floor as b

    n = 5000  # not a multiple of the tile: the last tile is masked
    g = torch.Generator().manual_seed(0)
    out, own, peer = (torch.randn(n, generator=g) for _ in range(3))
    flags = torch.zeros(4, dtype=torch.int32)
    counter = torch.zeros(1, dtype=torch.int32)
    for protocol, epoch in ((False, 0), (True, 1), (True, 2)):
        want = out + own + peer
        b.pull_add[(3,)](out, own, peer, flags, flags, counter, epoch, n, BLOCK=1024, PROTOCOL=protocol)
        assert torch.equal(out, want), (protocol, (out - want).abs().max())
        assert flags[:2].tolist() == [epoch, epoch], flags  # READY and DONE raised to the epoch
        assert counter.item() == 0, counter  # zero again for the next launch
    b.ping_pong[(1,)](flags[2:], flags[2:], 5, FIRST=True)
    assert flags[2].item() == 5, flags
    print("ok")
    """
)


def test_pull_floor_kernels_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(TOOLS)], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().endswith("ok")
