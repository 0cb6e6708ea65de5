"""Static instruction mix of the sm90 kernels' block loops: ours beside FlashAttention-4's.

Both kernels are compiled on this machine, without a GPU (``CUTE_DSL_ARCH=sm_90a``; FA4 through
its own fake-tensor compile path), their cubins disassembled with the ``nvdisasm`` that Triton
ships, and every innermost loop that issues wgmma (``HGMMA``) is reported: its SASS instruction
count by opcode. In the backward one loop iteration is one q block (ours: ``tile_m`` rows; FA4:
its tile_m, 80 rows for full attention at D 128, 64 for causal); in the forward (``--fwd``) one
K/V block of ``tile_n`` keys. The counts say how many instructions each kernel issues per block
and on what: a candidate change can be counted before a GPU run.

These are static counts of the instruction stream, not measurements: they say nothing about
stalls, and an instruction the profile shows as cheap counts as much as an expensive one.

FA4 comes from the device kit (``../shared/devkit``, staged into ``.dk/``): its bundle is
unpacked once into ``build/fa4site`` (CuTe DSL itself comes from this venv). The kit's
``tvm_ffi`` is built for another Python, and ``einops`` is only used by FA4's tests; both are
replaced by stubs there, and FA4's ``--enable-tvm-ffi`` compile option is dropped.

Usage:
    python tools/sass_mix.py                      # ours (default config) vs FA4, full, D 128
    python tools/sass_mix.py --causal --head-dim 64
    python tools/sass_mix.py --ours-src /tmp/patched/packages/ffa-kernels/src   # a patched tree
    python tools/sass_mix.py --config tile_m=128  # BwdConfig fields for ours
    python tools/sass_mix.py --fwd --head-dim 64  # the forward kernels (FwdConfig fields for --config)
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "build" / "fa4site"
_TVM_STUB = '''"""Stub (tools/sass_mix.py): the kit's tvm_ffi extension is built for another Python."""
class _Meta(type):
    def __getattr__(cls, name):
        return _Any
class _Any(metaclass=_Meta):
    def __init__(self, *a, **k):
        pass
    def __getattr__(self, name):
        return _Any()
    def __call__(self, *a, **k):
        return _Any()
def __getattr__(name):
    return _Any
'''
_EINOPS_STUB = '''"""Stub (tools/sass_mix.py): only FA4's test helpers use einops."""
def rearrange(*a, **k):
    raise NotImplementedError
repeat = reduce = rearrange
'''

# Compile FA4's sm90 backward from fake tensors (run in a child process: env and stubs).
_FA4_CHILD = r"""
import sys, torch, cutlass, cutlass.cute as cute
from torch._subclasses.fake_tensor import FakeTensorMode
_compile = cute.compile
def _no_tvm(*a, options=None, **k):
    options = (options or "").replace("--enable-tvm-ffi", "").strip()
    return _compile(*a, options=options, **k) if options else _compile(*a, **k)
cute.compile = _no_tvm
from flash_attn.cute import interface as fi
_DT = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16,
       torch.float32: cutlass.Float32, torch.int32: cutlass.Int32}
def to_cute_tensor(t, assumed_align=16, leading_dim=-1, fully_dynamic=False, enable_tvm_ffi=True):
    if t is None:
        return None
    dt, nd = _DT[t.dtype], t.dim()
    ld = None if fully_dynamic else (nd - 1 if leading_dim == -1 else leading_dim)
    div = max(assumed_align * 8 // dt.width, 1)
    shape = tuple(cute.sym_int() for _ in range(nd))
    stride = tuple(1 if i == ld else cute.sym_int64(divisibility=div) for i in range(nd))
    return cute.runtime.make_fake_tensor(dt, shape, stride=stride, assumed_align=assumed_align)
fi.to_cute_tensor = to_cute_tensor
causal, d, fwd = sys.argv[1] == "causal", int(sys.argv[2]), sys.argv[3] == "fwd"
with FakeTensorMode():
    q = torch.empty(1, 8192, 16, d, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(1, 16, 8192, dtype=torch.float32, device="cuda")
    if fwd:
        fi._flash_attn_fwd(q, q, q, causal=causal)
    else:
        fi._flash_attn_bwd(q, q, q, q, q, lse, causal=causal)
"""

_OURS_CHILD = r"""
import dataclasses, sys, torch
from ffa_kernels.cute import bwd_interface as bi, interface as fwd_i
from ffa_kernels.cute.config import default_bwd_config, default_config
d, fwd = int(sys.argv[1]), sys.argv[2] == "fwd"
fields = {k: int(v) for k, v in (kv.split("=") for kv in sys.argv[3:])}
if fwd:
    cfg = dataclasses.replace(default_config(d), **fields)
    fwd_i.get_kernel(torch.bfloat16, cfg, False, use_disk_cache=False)
else:
    cfg = dataclasses.replace(default_bwd_config(d), **fields)
    bi.get_bwd_kernel(torch.bfloat16, cfg, False, True, False, use_disk_cache=False)
"""


def _nvdisasm() -> str:
    import triton  # ships nvdisasm with its NVIDIA backend

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not path.exists():
        raise SystemExit(f"nvdisasm not found at {path}")
    return str(path)


def _fa4_site() -> Path:
    """build/fa4site: FA4 and quack from the device kit, plus the two stubs."""
    if (SITE / "flash_attn").exists():
        return SITE
    parts = sorted((ROOT / ".dk").glob("bundle.part-*"))
    if not parts:
        raise SystemExit("no device kit in .dk/: run ../shared/devkit/stage first")
    tmp = SITE.with_suffix(".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    # the parts are one xz stream split in two: concatenated, then decompressed on every core
    unpack = subprocess.Popen(
        ["sh", "-c", 'cat "$@" | xz -d -T0', "sh", *map(str, parts)], stdout=subprocess.PIPE
    )
    assert unpack.stdout is not None
    with tarfile.open(fileobj=unpack.stdout, mode="r|") as tar:
        for member in tar:
            top = member.name.removeprefix("./").split("/", 1)[0]
            if top in ("flash_attn", "quack"):
                tar.extract(member, tmp, filter="data")
    if unpack.wait():
        raise SystemExit("could not unpack the device kit's bundle")
    (tmp / "tvm_ffi").mkdir(exist_ok=True)
    (tmp / "tvm_ffi" / "__init__.py").write_text(_TVM_STUB)
    (tmp / "einops").mkdir(exist_ok=True)
    (tmp / "einops" / "__init__.py").write_text(_EINOPS_STUB)
    tmp.rename(SITE)
    return SITE


def _compile(child: str, args: list[str], pythonpath: str, extra_env: dict[str, str], kind: str) -> str:
    """Run ``child`` with a fresh dump folder; return the SASS of its main ``kind`` kernel
    (``Forward`` or ``Backward``)."""
    with tempfile.TemporaryDirectory() as dump:
        env = {
            **os.environ,
            "PYTHONPATH": pythonpath,
            "CUTE_DSL_ARCH": "sm_90a",
            "CUTE_DSL_KEEP_CUBIN": "1",
            "CUTE_DSL_DUMP_DIR": dump,
            **extra_env,
        }
        r = subprocess.run([sys.executable, "-c", child, *args], env=env, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"compile failed:\n{r.stderr[-3000:]}")
        cubins = [p for p in Path(dump).glob("*.cubin") if re.search(kind + r"(Sm90)?_", p.name)]
        main = [p for p in cubins if "Sm90" in p.name] or cubins
        if not main:
            raise SystemExit(f"no {kind} cubin in the dump: {[p.name for p in Path(dump).iterdir()]}")
        return subprocess.run(
            [_nvdisasm(), "-c", str(main[0])], capture_output=True, text=True, check=True
        ).stdout


_ADDR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


def _loop_spans(sass: str) -> list[list[tuple[str, str]]]:
    """The instructions ``(opcode with modifiers, operands)`` of each innermost loop (a backward
    branch's span) that issues HGMMA, in program order."""
    instrs: list[tuple[str, str]] = []  # (e.g. "WARPGROUP.DEPBAR.LE", "gsb0, 0x1 ;")
    labels: dict[str, int] = {}
    for line in sass.splitlines():
        m = _LABEL.match(line.strip())
        if m:
            labels[m.group(1)] = len(instrs)
            continue
        m = _ADDR.search(line)
        if m:
            instrs.append((m.group(2), m.group(3)))
    loops = []
    for i, (op, rest) in enumerate(instrs):
        t = _TARGET.search(rest) if op.split(".")[0] == "BRA" else None
        if t and labels.get(t.group(1), i + 1) <= i:
            lo = labels[t.group(1)]
            body = [o.split(".")[0] for o, _ in instrs[lo : i + 1]]
            # a span with an EXIT is a retry stub after the kernel's end jumping back, not a loop
            if "HGMMA" in body and "EXIT" not in body:
                loops.append((lo, i))
    inner = [a for a in loops if not any(b != a and a[0] <= b[0] and b[1] <= a[1] for b in loops)]
    return [instrs[lo : hi + 1] for lo, hi in sorted(set(inner))]


def block_loops(sass: str) -> list[collections.Counter]:
    """Opcode counts of each innermost loop that issues HGMMA."""
    return [collections.Counter(o.split(".")[0] for o, _ in span) for span in _loop_spans(sass)]


def wait_order(sass: str) -> list[str]:
    """Per loop, its wgmma issues, ``WARPGROUP.DEPBAR`` waits (``wait<N>``: at most N groups
    left in flight), exponentials and named barriers in program order, runs collapsed: where
    ptxas put the waits relative to the exp work shows which GEMM the softmax overlaps."""
    out = []
    for span in _loop_spans(sass):
        seq = []
        for op, rest in span:
            if op.startswith("HGMMA"):
                seq.append("HGMMA")
            elif op == "MUFU.EX2":
                seq.append("ex2")
            elif op.startswith("WARPGROUP.DEPBAR"):
                seq.append("wait<" + rest.split("gsb0,")[1].split(";")[0].strip().replace("0x", "") + ">")
            elif op.startswith("BAR"):
                seq.append("bar")
        runs: list[list] = []
        for x in seq:
            if runs and runs[-1][0] == x:
                runs[-1][1] += 1
            else:
                runs.append([x, 1])
        out.append(" ".join(f"{x}x{n}" if n > 1 else x for x, n in runs))
    return out


def _table(named: list[tuple[str, collections.Counter]]) -> str:
    ops = sorted({o for _, c in named for o in c}, key=lambda o: -sum(c[o] for _, c in named))
    head = "| opcode | " + " | ".join(n for n, _ in named) + " |"
    rows = [head, "|---" * (len(named) + 1) + "|"]
    rows.append("| **total** | " + " | ".join(str(sum(c.values())) for _, c in named) + " |")
    rows += [f"| {o} | " + " | ".join(str(c[o]) for _, c in named) + " |" for o in ops]
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument(
        "--causal", action="store_true", help="FA4's causal kernel (ours has one kernel for all masks)"
    )
    ap.add_argument("--fwd", action="store_true", help="the forward kernels (default: the backward)")
    ap.add_argument("--config", nargs="*", default=[], help="config fields for ours, e.g. tile_m=128")
    ap.add_argument("--ours-src", default=str(ROOT / "packages" / "ffa-kernels" / "src"),
                    help="the ffa_kernels source tree to compile (e.g. a patched copy)")  # fmt: skip
    ap.add_argument("--no-fa4", action="store_true")
    ap.add_argument(
        "--order", action="store_true", help="also print each loop's order of GEMMs, waits and exps"
    )
    a = ap.parse_args()

    kind, mode = ("Forward", "fwd") if a.fwd else ("Backward", "bwd")
    sass = {"ours": _compile(_OURS_CHILD, [str(a.head_dim), mode, *a.config], a.ours_src, {}, kind)}
    if not a.no_fa4:
        env = {"FLASH_ATTENTION_ARCH": "sm_90", "FLASH_ATTENTION_NUM_SMS": "132"}
        fa4_args = ["causal" if a.causal else "full", str(a.head_dim), mode]
        sass["FA4"] = _compile(_FA4_CHILD, fa4_args, str(_fa4_site()), env, kind)
    named = [
        (f"{who} loop {i + 1}", c) for who, text in sass.items() for i, c in enumerate(block_loops(text))
    ]
    print(_table(named))
    if a.order:
        for who, text in sass.items():
            for i, line in enumerate(wait_order(text)):
                print(f"\n{who} loop {i + 1}: {line}")


if __name__ == "__main__":
    main()
