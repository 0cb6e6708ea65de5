"""Every kernel launch the native backend makes compiles for Hopper (sm_90), without a GPU.

The backend runs in the fake world (``magi_comm.testing.native_fake``: ranks are threads, the data moves through
the reference kernels), and every launch is also handed to the real Triton launch objects,
whose launch step is replaced by a compile for sm_90 with exactly the specialization Triton
would derive from the arguments (types, 16-byte divisibility, constants equal to 1). That
covers what the interpreter tests cannot: types (an address of 0 is a 32-bit integer to
Triton), the handshake variants, empty tables, word sizes and vector widths of the cases.
"""

from __future__ import annotations

import importlib.util
import threading
import types

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton not installed", allow_module_level=True)

import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend

from magi_comm.backends import native
from magi_comm.backends.native import NativeBackend, NativeConfig, kernels
from magi_comm.backends.native import protocol as proto
from magi_comm.backends.native.kernels.compiled import CompiledKernel
from magi_comm.testing import native_cases as cases
from magi_comm.testing import native_fake

HOPPER = GPUTarget("cuda", 90, 32)


class CompileOnly:
    """Stands in for ``CompiledKernel.__call__``: compiles each new specialization for sm_90."""

    def __init__(self) -> None:
        self.compiled: set = set()
        # the fake world's ranks are threads; CPython 3.11's ast.parse (Triton parses the
        # kernel's source) is not safe to run in several threads at once
        self.lock = threading.Lock()

    def __call__(self, launcher, grid, args, consts, num_warps, stream, key=None) -> None:
        with self.lock:
            self._compile(launcher, args, consts, num_warps)

    def _compile(self, launcher, args, consts, num_warps):
        """The compiled kernel (None when this specialization was compiled before)."""
        fn = launcher.jit_fn
        free = set(fn.do_not_specialize)
        signature, constexprs, attrs = {}, {}, {}
        for i, (name, value) in enumerate(zip(fn.arg_names, [*args, *consts.values()])):
            if name in consts:
                signature[name], constexprs[(i,)] = "constexpr", value
                continue
            ty, attr = native_specialize_impl(
                CUDABackend, value, False, i not in free and name not in free, True
            )
            if ty == "constexpr":  # an integer equal to 1
                signature[name], constexprs[(i,)] = "constexpr", attr
                continue
            signature[name] = ty
            if attr:
                attrs[(i,)] = CUDABackend.parse_attr(attr)
        spec = (
            fn.__name__,
            num_warps,
            tuple(signature.values()),
            repr(sorted(constexprs.items())),
            tuple(attrs),
        )
        if spec in self.compiled:
            return
        src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        kernel = triton.compile(src, target=HOPPER, options={"num_warps": num_warps})
        self.compiled.add(spec)
        return kernel


@pytest.mark.parametrize("world", [2, 3])
def test_every_backend_launch_compiles_for_hopper(monkeypatch, world):
    fw = native_fake.FakeWorld(world)
    compiler = CompileOnly()
    monkeypatch.setattr(CompiledKernel, "__call__", lambda self, *a, **k: compiler(self, *a, **k))
    monkeypatch.setattr(CompiledKernel, "direct", True, raising=False)

    class Both(native_fake.CopyLaunch):
        """The fake moves the rows; the real launch object compiles its kernel."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, world=fw, **kwargs)
            self.real = kernels.CopyLaunch(*args, **kwargs)

        def __call__(self, src, sink, stream=None, sync=0, words=(), pub=0):
            self.real(src, sink, stream, sync, words, pub)
            super().__call__(src, sink, stream, sync, words, pub)

    def reduce_both(*args, **kwargs):
        kernels.launch_reduce(*args, **kwargs)
        native_fake.launch_reduce(*args, **kwargs, world=fw)

    # the ranks' platforms hand these to the backend
    fw.kernels = types.SimpleNamespace(
        CopyLaunch=Both, launch_reduce=reduce_both, reduce_tile_rows=kernels.reduce_tile_rows
    )
    small = cases.draw(world, 100 + world, 24, big=False)

    def rank_fn(rank):
        overlap = NativeConfig(
            buffer_bytes=1 << 20, block_bytes=16, overlap_chunk_bytes=16, overlap_reduce=True
        )
        with NativeBackend("group", rank, world, NativeConfig(buffer_bytes=1 << 20)) as be:
            for case in small:
                cases.run(be, case, rank, world)
            with NativeBackend("group", rank, world, overlap) as be2:  # progress and waiting variants
                for case in small:
                    cases.run(be2, case, rank, world)
            shaped = NativeConfig(buffer_bytes=1 << 20, reduce_tile_rows=4, reduce_warps=8)
            with NativeBackend("group", rank, world, shaped) as be3:  # a reduction tile of the sweep
                for case in small:
                    cases.run(be3, case, rank, world)
        native.shutdown()

    native_fake.run_ranks(fw, rank_fn)
    names = {spec[0] for spec in compiler.compiled}
    assert names == {"_copy_kernel", "_reduce_kernel"}, names
    assert len(compiler.compiled) > 20, len(compiler.compiled)
    assert fw.overlapped > 0 and fw.progress_signals > 0, (fw.overlapped, fw.progress_signals)
    assert fw.unpulled_checks > 0, "no staged receive copy (its check of the sources) compiled"
    assert fw.reduce_shapes == {(4, 8)}, fw.reduce_shapes
    # on 2 ranks some reduces from symmetric inputs took one launch (its start steps compiled)
    assert (fw.one_launch_reduces > 0) == (world == 2), fw.one_launch_reduces


def _capture_ptx(monkeypatch) -> list[str]:
    """Launches compile for sm_90 instead of running: the PTX of each lands in the list."""
    compiler, ptx = CompileOnly(), []
    monkeypatch.setattr(
        CompiledKernel,
        "__call__",
        lambda self, grid, args, consts, num_warps, stream, key=None: ptx.append(
            compiler._compile(self, args, consts, num_warps).asm["ptx"]
        ),
    )
    monkeypatch.setattr(CompiledKernel, "direct", True, raising=False)
    return ptx


@pytest.mark.parametrize("pull", [False, True])
def test_fused_reduction_loads_are_16_byte_vectors(monkeypatch, pull):
    """The fused reduction of 16-byte rows (1024 bf16) reads every term, from the regions and
    pulled from a peer's input, with 16-byte vector loads on sm_90 (a pointer made from an
    integer address, or a hint on the wrong dimension, turns them into 2-byte loads), with the
    streaming cache hints."""
    ptx = _capture_ptx(monkeypatch)
    W, E, n = 2, 1024, 8
    out = torch.zeros((n, E), dtype=torch.bfloat16)
    inp = torch.zeros((n, E), dtype=torch.bfloat16)
    region = torch.zeros(n * E * 2, dtype=torch.uint8)
    term_row = torch.zeros((n, W), dtype=torch.int64)
    term_self = torch.zeros((n, W), dtype=torch.int8)
    nterms = torch.ones(n, dtype=torch.int64)
    words = torch.zeros(64, dtype=torch.int64)
    hs = proto.Handshake(words.data_ptr(), words.data_ptr(), words.data_ptr(), 0)
    extra = {}
    if pull:
        extra = dict(
            pull=(term_row, words.data_ptr(), words.data_ptr(), 9),
            end=(hs, words.data_ptr(), words.data_ptr(), (proto.pack_done(),) * W, True),
        )
    kernels.launch_reduce(
        out, inp, region, term_row, term_self, nterms, acc_reduce=True, average=False, **extra
    )
    (code,) = ptx
    assert "ld.global.b16" not in code and "ld.global.u16" not in code, "2-byte data loads"
    # per term: the own input and the region (and the pulled input); and the output
    assert code.count("ld.global.v4") >= (4 if pull else 3), code.count("ld.global.v4")
    # read once, written once: streaming hints (docs/perf.md, "group_reduce: the arm known by default")
    # (the own term and the output, and the pulled rows)
    assert code.count("L1::evict_first") >= (3 if pull else 2), code.count("L1::evict_first")
    assert "st.global.cs" in code, "the output's streaming store is gone"


@pytest.mark.parametrize("src_shift", [0, 8])
def test_copy_moves_16_byte_vectors_where_aligned(monkeypatch, src_shift):
    """The copy kernel of 16-byte rows moves 16-byte vectors (two int64 words) from a 16-byte
    aligned source to the sink and to a peer's region on sm_90 (a pointer made from an integer
    address would leave them single words); a source 8 bytes off 16 is read word by word (a
    vector load there would fault), its stores stay vectors."""
    from magi_comm.backends.native.layout import TaskTable, to_blocks

    ptx = _capture_ptx(monkeypatch)
    n = 4096  # words, two rows of 16 KiB, one peer and this rank (W = 2)
    buf = torch.zeros(3 * n + 2, dtype=torch.int64)
    base = buf.data_ptr() + (-buf.data_ptr()) % 16  # 16-byte aligned
    task = TaskTable(torch.tensor([0]), torch.tensor([2]), torch.tensor([[0, -1, 0]]))
    send = kernels.CopyLaunch(to_blocks(task, n // 2, 2048), [base + 8 * n, None], torch.int64, vec=2)
    send(base + src_shift, base + 16 * n)
    (code,) = ptx
    assert code.count("st.global.v2.b64") >= 2, "the sink's and the peer's stores"
    assert "st.global.b64" not in code, "a store of single words"
    vector_loads = code.count("ld.global.v2.b64")
    assert (vector_loads > 0) == (src_shift == 0), vector_loads


def test_one_launch_reduction_waits_are_bounded(monkeypatch):
    """The one-launch reduction's start (the destination's arm, the source's READY) reads the
    global timer and traps past the bound: the start adds traps to the reduction it begins (the
    refusal's trap is among them; the fake world checks when it fires)."""
    ptx = _capture_ptx(monkeypatch)
    W, E, n = 2, 1024, 8
    out = torch.zeros((n, E), dtype=torch.bfloat16)
    term_row = torch.zeros((n, W), dtype=torch.int64)
    words = torch.zeros(64, dtype=torch.int64)
    hs = proto.Handshake(words.data_ptr(), words.data_ptr(), words.data_ptr(), 0)
    start = (
        (proto.pack_peer(), proto.pack_peer(1, 1, True)),
        words.data_ptr(),
        words.data_ptr(),
        words.data_ptr(),
    )
    for one_launch in (False, True):
        kernels.launch_reduce(
            out, out.clone(), None, term_row, term_row.to(torch.int8), torch.ones(n, dtype=torch.int64),
            acc_reduce=True, average=False, pull=(term_row, words.data_ptr(), words.data_ptr(), 9),
            end=(hs, words.data_ptr(), words.data_ptr(), (proto.pack_done(),) * W, True),
            start=start if one_launch else None,
        )  # fmt: skip
    plain, started = ptx
    assert "%globaltimer" in started, "unbounded waits"
    # the arm wait, the READY wait and the refusal, each at least once
    assert started.count("trap;") >= plain.count("trap;") + 3, (plain.count("trap;"), started.count("trap;"))


def test_waits_for_peers_are_bounded_by_the_global_timer(monkeypatch):
    """Every wait for a peer's signal in the compiled copy kernel (its arm, its READY count, its
    rows) reads the GPU's global timer and traps past MAGI_COMM_NATIVE_WAIT_TIMEOUT_S (a peer
    that died: an error on this rank, not a hang)."""
    from magi_comm.backends.native.layout import TaskTable, to_blocks

    ptx = _capture_ptx(monkeypatch)
    n = 64  # words, one peer and this rank (W = 2)
    words = torch.zeros(64, dtype=torch.int64)
    buf = torch.zeros(2 * n, dtype=torch.int64)
    hs = proto.Handshake(words.data_ptr(), words.data_ptr(), words.data_ptr(), 1)
    task = TaskTable(torch.tensor([0]), torch.tensor([n]), torch.tensor([[0, -1, 0]]))
    send = kernels.CopyLaunch(to_blocks(task, 1, 16), [buf.data_ptr(), None], torch.int64, handshake=hs)
    steps = proto.ARM_AND_WAIT | proto.READY_END | proto.WAIT_READY_END
    send(buf.data_ptr(), buf.data_ptr() + 8 * n, sync=steps, words=(proto.pack_peer(1, 1), proto.pack_peer()))
    rtask = TaskTable(torch.tensor([0]), torch.tensor([n]), torch.tensor([[-1, -1, 0]]))
    rtable = to_blocks(rtask, 1, 16)
    waits = (torch.zeros(rtable.num_blocks, dtype=torch.int32), torch.full((rtable.num_blocks,), n))
    recv = kernels.CopyLaunch(rtable, [None, None], torch.int64, handshake=hs, waits=waits)
    recv(
        buf.data_ptr(),
        buf.data_ptr() + 8 * n,
        sync=proto.AWAIT_ROWS,
        words=(proto.pack_peer(1, 1), proto.pack_peer()),
    )
    assert len(ptx) == 2
    for code in ptx:
        assert "%globaltimer" in code and "trap;" in code, code[-2000:]


def test_a_waiting_reduction_refuses_another_tile():
    """launch_reduce beside the transfer reads wait tables cut by reduce_tile_rows(E, True): any
    other tile height is refused before a launch, as the fake world refuses it."""
    n, E, W = 8, 1024, 2
    out = torch.zeros((n, E), dtype=torch.bfloat16)
    rows = torch.zeros((n, W), dtype=torch.int64)
    waits = (rows, torch.zeros(1, dtype=torch.int32), 0, (), 1)
    with pytest.raises(ValueError, match="tile_rows"):
        kernels.launch_reduce(out, out, None, rows, rows.to(torch.int8), torch.ones(n, dtype=torch.int64),
                              acc_reduce=False, average=False, waits=waits, tile_rows=4)  # fmt: skip


def test_a_known_arm_is_for_the_one_launch_reduce_only(monkeypatch):
    """A packed word with the arm known keeps its counts (the sign bit carries the flag), is
    refused for a source-only word, and a copy launch refuses it before compiling (what makes
    an arm known covers the peer's reads of our input, not the regions a copy launch writes)."""
    from magi_comm.backends.native.layout import TaskTable, to_blocks

    word = proto.pack_peer(7, 3, True, known=True)
    assert proto.arm_known(word) and word < 0 and proto.unpack_peer(word) == (7, 3, True)
    assert not proto.arm_known(proto.pack_peer(7, 3, True))
    with pytest.raises(ValueError, match=r"known=True needs a destination .*arm_wait=0"):
        proto.pack_peer(0, 3, known=True)
    ptx = _capture_ptx(monkeypatch)
    n = 64
    sig = torch.zeros(64, dtype=torch.int64)  # the signal array (and the other words the launch takes)
    buf = torch.zeros(2 * n, dtype=torch.int64)
    hs = proto.Handshake(sig.data_ptr(), sig.data_ptr(), sig.data_ptr(), 1)
    task = TaskTable(torch.tensor([0]), torch.tensor([n]), torch.tensor([[0, -1, 0]]))
    send = kernels.CopyLaunch(to_blocks(task, 1, 16), [buf.data_ptr(), None], torch.int64, handshake=hs)
    with pytest.raises(ValueError, match=r"words\[0\]: a known arm .* one-launch reduce only"):
        send(buf.data_ptr(), buf.data_ptr() + 8 * n, sync=proto.ARM_AND_WAIT, words=(word, proto.pack_peer()))
    assert not ptx


@pytest.mark.parametrize("launch", ["real", "fake"])
def test_copy_launch_roles_are_one_rule(launch):
    """The real copy launch and the CPU fake's refuse the same role combinations, with the same
    errors (protocol.check_copy_roles), before anything is compiled or run."""
    from magi_comm.backends.native.layout import TaskTable, to_blocks

    n = 64
    sig = torch.zeros(64, dtype=torch.int64)
    buf = torch.zeros(2 * n, dtype=torch.int64)
    hs = proto.Handshake(sig.data_ptr(), sig.data_ptr(), sig.data_ptr(), 1)
    table = to_blocks(TaskTable(torch.tensor([0]), torch.tensor([n]), torch.tensor([[0, -1, 0]])), 1, 16)
    make = kernels.CopyLaunch if launch == "real" else native_fake.CopyLaunch
    extra = {} if launch == "real" else {"world": native_fake.FakeWorld(2)}
    pulls = (sig.data_ptr(), 2, 0b11)  # (pull-map area, map width, sources)
    waits = (
        torch.zeros(table.num_blocks, dtype=torch.int32),
        torch.ones(table.num_blocks, dtype=torch.int32),
    )
    bad = [
        (dict(publish=(1, 2, 3, 4)), r"publish need a handshake .*got handshake=None"),
        (dict(waits=waits), r"waits need a handshake"),
        (dict(handshake=hs, publish=(1, 2, 3, 4), direct=(1, 2, 3)), "direct .* and publish .* exclude"),
        (dict(peers=[buf.data_ptr(), None], unpulled=pulls), "got peers"),
        (dict(handshake=hs, unpulled=pulls, publish=(1, 2, 3, 4)), "got publish"),
        (dict(handshake=hs, unpulled=pulls, waits=waits), "got waits"),
        (dict(unpulled=pulls, direct=(1, 2, 3)), "got direct"),
        (dict(unpulled=(sig.data_ptr(), 0, 1)), "map_width >= 1"),
        (dict(unpulled=(sig.data_ptr(), 2, 0b100)), r"sources in \[1, 2\*\*2\)"),
    ]
    for kw, match in bad:
        peers = kw.pop("peers", [None, None])
        with pytest.raises(ValueError, match=match):
            make(table, peers, torch.int64, **kw, **extra)
    make(table, [None, None], torch.int64, unpulled=pulls, **extra)  # a staged receive copy: accepted
