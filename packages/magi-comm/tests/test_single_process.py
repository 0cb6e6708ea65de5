"""World-size-1 gloo group in the test process: argument validation, semantics, lifecycle."""

import datetime
import random

import pytest
import torch
import torch.distributed as dist

import magi_comm
import magi_comm.testing as lib
from magi_comm import BackendUnavailableError, GroupCollective, group_cast, group_reduce


@pytest.fixture(scope="module", autouse=True)
def world1(tmp_path_factory):
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    store = dist.FileStore(str(tmp_path_factory.mktemp("magi_comm") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    yield
    magi_comm.close_default_collectives()
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv("MAGI_COMM_BACKEND", raising=False)
    monkeypatch.delenv("MAGI_COMM_DEBUG", raising=False)


def x(rows, *shape, dtype=torch.float32):
    return (
        torch.arange(rows * max(1, torch.Size(shape).numel()), dtype=torch.float32)
        .view(rows, *shape)
        .to(dtype)
    )


# ---------------------------------------------------------------------------------------------
# validation: every error names the argument and the value seen

CAST_OK = {
    "input_split_sizes": [2, 2],
    "output_split_sizes": [2, 2],
    "dst_indices": [[0], [0]],
    "src_index": [0, 0],
}

CAST_BAD = [
    ({"input_split_sizes": [2, 1]}, ValueError, r"input_split_sizes sum to 3, but input has 4 rows"),
    (
        {"output_split_sizes": [2, 3], "src_index": [0, 0]},
        ValueError,
        r"output_split_sizes sum to 5, but output",
    ),
    ({"dst_indices": [[0], [1]]}, ValueError, r"dst_indices\[1\]\[0\] = 1 is not a rank .*world_size 1"),
    ({"dst_indices": [[0], [-1]]}, ValueError, r"dst_indices\[1\]\[0\] = -1 is not a rank"),
    ({"src_index": [0, 3]}, ValueError, r"src_index\[1\] = 3 is not a rank"),
    ({"dst_indices": [[0]]}, ValueError, r"len\(dst_indices\) = 1 != len\(input_split_sizes\) = 2"),
    ({"src_index": [0]}, ValueError, r"len\(src_index\) = 1 != len\(output_split_sizes\) = 2"),
    ({"input_split_sizes": [5, -1]}, ValueError, r"input_split_sizes\[1\] = -1 is negative"),
    ({"input_split_sizes": [2.0, 2]}, TypeError, r"input_split_sizes\[0\] must be an int, got 2.0"),
    ({"dst_indices": [[0, 0], [0]]}, ValueError, r"dst_indices\[0\] = \[0, 0\] names a rank more than once"),
    ({"dst_indices": [0, [0]]}, TypeError, r"dst_indices\[0\] must be a list of ranks, got 0"),
    (
        {"input_split_sizes": [4], "dst_indices": [[0]], "output_split_sizes": [2, 2]},
        ValueError,
        r"sends itself splits of sizes \[4\] but its output splits from itself have sizes \[2, 2\]",
    ),
]


@pytest.mark.parametrize(("patch", "exc", "match"), CAST_BAD)
def test_group_cast_rejects(patch, exc, match):
    kw = dict(CAST_OK, **patch)
    with pytest.raises(exc, match=match):
        group_cast(x(4, 3), torch.empty(4, 3), **kw)


def test_group_cast_rejects_tensor_mismatch():
    with pytest.raises(TypeError, match=r"output.dtype \(torch.float16\) != input.dtype \(torch.float32\)"):
        group_cast(x(4, 3), torch.empty(4, 3, dtype=torch.float16), **CAST_OK)
    with pytest.raises(ValueError, match=r"input.shape = \(4, 3\), output.shape = \(4, 2\)"):
        group_cast(x(4, 3), torch.empty(4, 2), **CAST_OK)
    with pytest.raises(TypeError, match=r"input must be a torch\.Tensor, got list"):
        group_cast([1, 2], torch.empty(4, 2), **CAST_OK)


RED_OK = {
    "input_split_sizes": [2, 2],
    "output_split_sizes": [2, 2],
    "dst_index": [0, 0],
    "src_indices": [[0], [0]],
}

RED_BAD = [
    ({"dst_index": [0, 2]}, {}, ValueError, r"dst_index\[1\] = 2 is not a rank"),
    ({"src_indices": [[0], [0, 1]]}, {}, ValueError, r"src_indices\[1\]\[1\] = 1 is not a rank"),
    ({"dst_index": [0]}, {}, ValueError, r"len\(dst_index\) = 1 != len\(input_split_sizes\) = 2"),
    ({"src_indices": [[0]]}, {}, ValueError, r"len\(src_indices\) = 1 != len\(output_split_sizes\) = 2"),
    ({"input_split_sizes": [3, 2]}, {}, ValueError, r"input_split_sizes sum to 5, but input has 4 rows"),
    ({}, {"reduce_op": "max"}, ValueError, r"unknown reduce_op 'max'; expected one of sum, avg, lse"),
    (
        {},
        {"reduce_op": "lse"},
        TypeError,
        r"reduce_op='lse' needs input_lse as a \(rows, heads\) tensor, got NoneType",
    ),
    (
        {},
        {"reduce_op": "lse", "input_lse": torch.zeros(4, 3), "output_lse": torch.zeros(4, 2)},
        ValueError,
        r"input_lse.shape = \(4, 3\) must be input.shape\[:2\] = \(4, 2\)",
    ),
    (
        {},
        {"reduce_op": "lse", "input_lse": torch.zeros(4, 2), "output_lse": torch.zeros(3, 2)},
        ValueError,
        r"output_lse.shape = \(3, 2\) must be output.shape\[:2\] = \(4, 2\)",
    ),
    (
        {},
        {"input_lse": torch.zeros(4, 2)},
        ValueError,
        r"input_lse is only used with reduce_op='lse', got .*'sum'",
    ),
]


@pytest.mark.parametrize(("patch", "extra", "exc", "match"), RED_BAD)
def test_group_reduce_rejects(patch, extra, exc, match):
    kw = dict(RED_OK, **patch, **extra)
    with pytest.raises(exc, match=match):
        group_reduce(x(4, 2, 3), torch.zeros(4, 2, 3), **kw)


def test_group_reduce_rejects_integer_and_dtype_mismatch():
    with pytest.raises(TypeError, match=r"floating-point dtype, got input.dtype = torch.int64"):
        group_reduce(torch.zeros(4, 2, dtype=torch.int64), torch.zeros(4, 2, dtype=torch.int64), **RED_OK)
    with pytest.raises(TypeError, match=r"output.dtype \(torch.bfloat16\) != input.dtype \(torch.float32\)"):
        group_reduce(torch.zeros(4, 2), torch.zeros(4, 2, dtype=torch.bfloat16), **RED_OK)


def test_unknown_backend(monkeypatch):
    with pytest.raises(ValueError, match=r"unknown backend 'nccl2' \(from backend\); known: a2av, native"):
        group_cast(x(4, 3), torch.empty(4, 3), **CAST_OK, backend="nccl2")
    monkeypatch.setenv("MAGI_COMM_BACKEND", "bogus")
    with pytest.raises(ValueError, match=r"unknown backend 'bogus' \(from \$MAGI_COMM_BACKEND\)"):
        group_cast(x(4, 3), torch.empty(4, 3), **CAST_OK)


def test_native_backend_missing_is_clear(monkeypatch):
    with pytest.raises(BackendUnavailableError, match=r"backend 'native' is unavailable.*backend='a2av'"):
        group_cast(x(4, 3), torch.empty(4, 3), **CAST_OK, backend="native")
    monkeypatch.setenv("MAGI_COMM_BACKEND", "native")
    with pytest.raises(BackendUnavailableError):
        GroupCollective()
    monkeypatch.setenv("MAGI_COMM_BACKEND", "a2av")
    out = torch.empty(4, 3)
    group_cast(x(4, 3), out, **CAST_OK)  # a failed native selection leaves a2av usable
    assert torch.equal(out, x(4, 3))


def test_register_backend_seam():
    calls = []

    class Fake:
        name = "fake"

        def __init__(self, group, rank, world_size):
            calls.append((rank, world_size))

        def close(self):
            calls.append("closed")

    magi_comm.register_backend("fake-test", Fake)
    with GroupCollective(backend="FAKE-test") as gc:
        assert gc.backend_name == "fake-test"
    assert calls == [(0, 1), "closed"]
    assert "fake-test" in magi_comm.available_backends()


# ---------------------------------------------------------------------------------------------
# semantics on one rank


def test_cast_drops_unsent_splits():
    inp = x(5, 2)  # splits [0:2] [2:3] [3:5]; the middle one goes nowhere
    out = torch.full((4, 2), float("nan"))
    w = group_cast(inp, out, [2, 1, 2], [2, 2], [[0], [], [0]], [0, 0])
    assert w.is_completed()
    assert torch.equal(out, torch.cat([inp[0:2], inp[3:5]]))


def test_cast_into_non_contiguous_output_and_1d():
    inp = x(4, 3)
    out = torch.zeros(3, 4).t()  # (4, 3), not contiguous
    group_cast(inp, out, [4], [4], [[0]], [0])
    assert torch.equal(out, inp)
    v = torch.arange(5.0)
    o = torch.zeros(5)
    group_cast(v, o, [2, 3], [2, 3], [[0], [0]], [0, 0])
    assert torch.equal(o, v)


def test_avg_semantics():
    inp = torch.tensor([[4.0], [8.0]])
    for acc, expected in ((True, [[3.0], [5.0]]), (False, [[4.0], [8.0]])):
        out = torch.tensor([[2.0], [2.0]])
        group_reduce(inp, out, [2], [2], [0], [[0]], reduce_op="avg", acc_reduce=acc)
        assert out.tolist() == expected
    # a split without sources: unchanged with acc_reduce, 0 without
    for acc, expected in ((True, [[2.0], [2.0]]), (False, [[0.0], [0.0]])):
        out = torch.tensor([[2.0], [2.0]])
        group_reduce(inp[:0], out, [], [2], [], [[]], reduce_op="avg", acc_reduce=acc)
        assert out.tolist() == expected


def test_lse_all_neg_inf_gives_zero_not_nan():
    ninf = float("-inf")
    inp = torch.full((2, 1, 3), float("nan"))  # garbage under lse = -inf
    in_lse = torch.full((2, 1), ninf)
    out = torch.full((2, 1, 3), float("nan"))
    out_lse = torch.full((2, 1), ninf)
    group_reduce(inp, out, [2], [2], [0], [[0]], reduce_op="lse", input_lse=in_lse, output_lse=out_lse)
    assert torch.equal(out, torch.zeros(2, 1, 3))
    assert torch.isneginf(out_lse).all()


def test_lse_merge_two_terms():
    a, b = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    la, lb = torch.randn(3, 2), torch.randn(3, 2)
    out, out_lse = a.clone(), la.clone()
    group_reduce(b, out, [3], [3], [0], [[0]], reduce_op="lse", input_lse=lb, output_lse=out_lse)
    lse = torch.logaddexp(la.double(), lb.double())
    ref = (torch.exp(la.double() - lse)[..., None] * a.double()) + (
        torch.exp(lb.double() - lse)[..., None] * b
    )
    torch.testing.assert_close(out_lse.double(), lse)
    torch.testing.assert_close(out.double(), ref)


def test_async_work_runs_post_processing_on_wait():
    inp = x(4, 3)
    out = torch.zeros(4, 3)
    w = group_cast(inp, out, [1, 3], [1, 3], [[0], [0]], [0, 0], async_op=True)
    assert w.wait(timeout=datetime.timedelta(seconds=30)) is out
    assert w.is_completed() and torch.equal(out, inp)
    # reduction happens in wait(): the output is untouched before it
    out = torch.ones(4, 3)
    w = group_reduce(inp, out, [4], [4], [0], [[0]], async_op=True)
    assert torch.equal(out, torch.ones(4, 3))
    w.wait()
    assert torch.equal(out, inp + 1)


def test_world1_random_cases():
    cases = lib.make_cases(1, 7, 40)
    for case in cases:
        lib.run_case(case, 0, 1)


# ---------------------------------------------------------------------------------------------
# lifecycle and caching


def test_group_collective_lifecycle():
    with GroupCollective() as gc:
        assert not gc.closed and gc.rank == 0 and gc.world_size == 1
        out = torch.zeros(2, 1)
        gc.group_cast(x(2, 1), out, [2], [2], [[0]], [0])
    assert gc.closed
    with pytest.raises(RuntimeError, match="closed"):
        gc.group_cast(x(2, 1), out, [2], [2], [[0]], [0])
    gc.close()  # idempotent


def _stub_backend(name: str, **methods) -> str:
    """Register a backend that does nothing but ``methods`` (a no-op constructor and close
    beside them); returns the name it is registered under."""

    def init(self, group, rank, world_size):
        pass

    cls = type(name, (), {"name": name, "__init__": init, "close": lambda self: None, **methods})
    magi_comm.register_backend(f"{name}-test", cls)
    return f"{name}-test"


def test_empty_output_falls_back_to_plain_tensors():
    """a2av has no symmetric outputs: empty_output is torch.empty, free_output a no-op; a
    backend that has them gets the calls."""
    with GroupCollective() as gc:
        out = gc.empty_output((3, 2), torch.float64)
        assert out.shape == (3, 2) and out.dtype == torch.float64 and out.device.type == "cpu"
        gc.group_cast(x(3, 2).double(), out, [3], [3], [[0]], [0])
        assert torch.equal(out, x(3, 2).double())
        gc.free_output(out)
    calls = []

    def empty_output(self, shape, dtype):
        calls.append(("empty", tuple(shape), dtype))
        return torch.zeros(shape, dtype=dtype)

    def free_output(self, tensor):
        calls.append(("free", tuple(tensor.shape)))

    name = _stub_backend("with-outputs", empty_output=empty_output, free_output=free_output)
    with GroupCollective(backend=name) as gc:
        gc.free_output(gc.empty_output((4,), torch.int8))
    assert calls == [("empty", (4,), torch.int8), ("free", (4,))]


def test_reserve_rows_reaches_backends_that_have_it():
    """a2av has nothing to reserve; a backend with ``reserve_rows`` gets the call (none for
    zero rows or bytes); bad arguments are named before any backend sees them."""
    with GroupCollective() as gc:
        assert not hasattr(gc._require_backend(), "reserve_rows")  # a2av: no buffer to grow
        gc.reserve_rows(1000, 4096)
        rows = torch.randn(4, 3)  # and the group still works after the call (one rank: a copy)
        out = torch.full((4, 3), float("nan"))
        gc.group_cast(rows, out, **CAST_OK).wait()
        assert torch.equal(out, rows)
    calls = []
    name = _stub_backend("with-buffer", reserve_rows=lambda self, rows, nbytes: calls.append((rows, nbytes)))
    with GroupCollective(backend=name) as gc:
        gc.reserve_rows(7, 256)
        gc.reserve_rows(0, 256)
        gc.reserve_rows(7, 0)
        for bad in ((-1, 8), (3, 2.5), (True, 8)):
            name = "row_bytes" if bad[0] == 3 else "rows_per_peer"
            with pytest.raises(ValueError, match=name):
                gc.reserve_rows(*bad)
    assert calls == [(7, 256)]


def test_default_instance_is_shared_and_replaced_after_close():
    a = magi_comm.get_group_collective()
    assert magi_comm.get_group_collective(None, "a2av") is a
    a.close()
    b = magi_comm.get_group_collective()
    assert b is not a and not b.closed


def test_plan_cache_hits():
    gc = magi_comm.get_group_collective()
    p1 = gc.cast_plan([1, 2], [1, 2], [[0], [0]], [0, 0])
    p2 = gc.cast_plan((1, 2), (1, 2), ([0], (0,)), [0, 0])
    p3 = gc.cast_plan(torch.tensor([1, 2]), [1, 2], [torch.tensor([0]), [0]], torch.tensor([0, 0]))
    assert p1 is p2 is p3
    r1 = gc.reduce_plan([1, 2], [1, 2], [0, 0], [[0], [0]])
    assert gc.reduce_plan([1, 2], [1, 2], [0, 0], [[0], [0]]) is r1


def test_debug_mode_passes_on_consistent_plans(monkeypatch):
    monkeypatch.setenv("MAGI_COMM_DEBUG", "1")
    rng = random.Random(3)
    for _ in range(5):
        lay = lib.random_layout(rng, 1)
        case = {"layout": lay, "seed": 1, "async": False, "debug": True, "via_object": False}
        lib.run_case(dict(case, kind="cast", dtype="float32", row_shape=(2,)), 0, 1)


def test_flags_must_be_bools():
    inp, out = x(4, 3), torch.zeros(4, 3)
    with pytest.raises(TypeError, match="acc_reduce: expected a bool"):
        group_reduce(inp, out, [4], [4], [0], [[0]], acc_reduce="no")
    with pytest.raises(TypeError, match="async_op: expected a bool"):
        group_cast(inp, out, [4], [4], [[0]], [0], async_op=1)


def test_a_transport_error_names_the_call_and_post_processing_is_skipped():
    class FailingWork:
        def wait(self, timeout=None):
            raise RuntimeError("Connection closed by peer")

    ran = []
    work = magi_comm.GroupCollectiveWork(
        torch.zeros(2),
        [FailingWork()],
        lambda: ran.append(1),
        what="magi_comm.group_cast (a2av backend, rank 0 of 2)",
    )
    with pytest.raises(RuntimeError, match="Connection closed by peer") as info:
        work.wait()
    assert any(
        "group_cast (a2av backend, rank 0 of 2): the transport failed" in n for n in info.value.__notes__
    )
    assert not ran and not work.is_completed()
