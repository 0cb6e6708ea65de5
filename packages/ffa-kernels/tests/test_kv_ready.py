"""``ffa_forward``'s ``kv_ready`` (late key/value rows) on the CPU: its checks name the field and
the value seen, and the reference backend computes the same result once the flag holds."""

import pytest
import torch

from ffa_kernels import KVReady, ffa_forward

I32 = torch.int32


def _inputs(seed=0, tq=40, tk=56, hq=4, hk=2, d=16):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(t, h, d, generator=g, dtype=torch.float64) for t, h in ((tq, hq), (tk, hk), (tk, hk))
    )
    qr = torch.tensor([[0, 40], [0, 24], [24, 40]], dtype=I32)
    kr = torch.tensor([[0, 20], [20, 44], [44, 56]], dtype=I32)
    return q, k, v, qr, kr, torch.tensor([0, 1, 3], dtype=I32)


@pytest.mark.parametrize("first_row", [0, 20, 31, 56])
def test_a_flag_that_holds_is_taken_and_changes_nothing(first_row):
    """On the reference backend a flag that holds (equal to its value or past it) is accepted at
    every first row, and the result is the call's without ``kv_ready``: the check refuses no
    good flag, and nothing of the reference reads differently (the waiting itself is tested on
    the GPU, test_kv_ready_gpu.py)."""
    q, k, v, qr, kr, tm = _inputs()
    plain = ffa_forward(q, k, v, qr, kr, tm, return_max_logits=True)
    flag = torch.tensor([7, -1], dtype=I32)  # the first element is the word
    for ready in (KVReady(flag, 7, first_row), (flag, 3, first_row)):
        got = ffa_forward(q, k, v, qr, kr, tm, return_max_logits=True, kv_ready=ready)
        assert all(torch.equal(a, b) for a, b in zip(got, plain))


def test_a_flag_below_its_value_on_the_cpu_is_an_error_unless_no_row_is_late():
    q, k, v, qr, kr, tm = _inputs()
    flag = torch.tensor([2], dtype=I32)
    with pytest.raises(ValueError, match=r"kv_ready\.flag: holds 2 < value 3"):
        ffa_forward(q, k, v, qr, kr, tm, kv_ready=(flag, 3, 55))
    ffa_forward(q, k, v, qr, kr, tm, kv_ready=(flag, 3, 56))  # first_row == Tk: nothing is late


def test_numpy_and_torch_integers_are_taken():
    np = pytest.importorskip("numpy")
    q, k, v, qr, kr, tm = _inputs()
    plain = ffa_forward(q, k, v, qr, kr, tm)
    got = ffa_forward(
        q, k, v, qr, kr, tm, kv_ready=(torch.tensor([4], dtype=I32), np.int64(4), torch.tensor(9))
    )
    assert torch.equal(got[0], plain[0])


@pytest.mark.parametrize("which", ["k", "v"])
def test_late_rows_must_be_read_in_place(which):
    """A k or v the call would copy first (here: rows whose heads are not contiguous) is refused:
    the copy would read the late rows before they arrive."""
    q, k, v, qr, kr, tm = _inputs()
    t = {"k": k, "v": v}[which]
    strided = t.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, heads not dense
    args = dict(k=k, v=v) | {which: strided}
    flag = torch.tensor([1], dtype=I32)
    with pytest.raises(ValueError, match=rf"kv_ready: {which} must be read in place .*got strides"):
        ffa_forward(q, args["k"], args["v"], qr, kr, tm, kv_ready=(flag, 1, 20))
    ffa_forward(q, args["k"], args["v"], qr, kr, tm, kv_ready=(flag, 1, 56))  # nothing late: any layout


@pytest.mark.parametrize(
    "ready, exc, pattern",
    [
        ([torch.zeros(1, dtype=I32), 0, 0], TypeError, r"kv_ready: expected KVReady"),
        ((torch.zeros(1, dtype=I32), 0), TypeError, r"kv_ready: expected KVReady"),
        ((torch.zeros(1), 0, 0), TypeError, r"kv_ready\.flag: .*float32 tensor of 1 elements"),
        ((torch.zeros(0, dtype=I32), 0, 0), TypeError, r"kv_ready\.flag: .*0 elements"),
        ((3, 0, 0), TypeError, r"kv_ready\.flag: .*got int$"),
        (
            (torch.zeros(1, dtype=I32), -1, 0),
            ValueError,
            r"kv_ready\.value: must lie in \[0, 2147483647\], got -1",
        ),
        ((torch.zeros(1, dtype=I32), 2**31, 0), ValueError, r"kv_ready\.value: .*got 2147483648"),
        ((torch.zeros(1, dtype=I32), True, 0), TypeError, r"kv_ready\.value: expected an int, got bool"),
        (
            (torch.zeros(1, dtype=I32), 0, 57),
            ValueError,
            r"kv_ready\.first_row: must lie in \[0, 56\], got 57",
        ),
        ((torch.zeros(1, dtype=I32), 0, 1.0), TypeError, r"kv_ready\.first_row: expected an int, got float"),
        (
            (torch.zeros(1, dtype=I32, device="meta"), 0, 0),
            ValueError,
            r"kv_ready\.flag: must be on k's device",
        ),
    ],
)
def test_bad_kv_ready_names_the_field(ready, exc, pattern):
    q, k, v, qr, kr, tm = _inputs()
    with pytest.raises(exc, match=pattern):
        ffa_forward(q, k, v, qr, kr, tm, kv_ready=ready)


@pytest.mark.parametrize("which", ["k", "v"])
def test_the_launch_refuses_to_copy_late_rows(which):
    """The CuTe launch itself refuses a k or v it would copy when some rows are late, before any
    kernel is built (the frontend's check stands in front of it; this keeps the rule where the
    copy would be made)."""
    interface = pytest.importorskip("ffa_kernels.cute.interface")
    q, k, v, *_ = _inputs()
    strided = {"k": k, "v": v}[which].transpose(1, 2).contiguous().transpose(1, 2)
    args = dict(k=k, v=v) | {which: strided}
    lse = torch.empty(q.shape[0], q.shape[1])
    ready = KVReady(torch.tensor([1], dtype=I32), 1, 20)
    with pytest.raises(ValueError, match=rf"kv_ready: {which} must be read in place"):
        interface._launch(None, False, None, q, args["k"], args["v"], None, lse, None, None, None,
                          1.0, 0.0, 0, None, 1, ready)  # fmt: skip


@pytest.mark.parametrize("name", ["stream_wait_value32", "stream_write_value32"])
@pytest.mark.parametrize(
    "word, seen",
    [
        (torch.zeros(1, dtype=torch.int32), "torch.int32 on cpu"),
        (torch.zeros(1, dtype=torch.int64), "torch.int64 on cpu"),
        (0x1000, "int"),
    ],
)
def test_stream_memory_operations_refuse_a_word_that_is_not_an_int32_cuda_tensor(name, word, seen):
    """The driver takes any address (a host one too) and compares 32 bits of what lies there:
    the wrappers refuse such a word before calling it, naming the argument and what they got."""
    from ffa_kernels import _kv_ready

    with pytest.raises(ValueError, match=rf"word: cuStream\w+Value32 needs an int32 CUDA tensor, got {seen}"):
        getattr(_kv_ready, name)(None, word, 1)
