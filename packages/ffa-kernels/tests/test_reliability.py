"""Reliability of flex_flash_attn_func (issue 23): a right result or a clear error, no stale cache,
no NaN that reaches rows which do not see its key (reference backend), no untrusted kernel loaded
from the compile disk cache.

The multi-rank rows (ranges rewritten by ``dist.broadcast``, keys that differ between ranks)
are in integration_tests/test_reliability.py.
"""

import hashlib
import logging
import os
import pathlib
import stat
import types

import pytest
import torch

from ffa_kernels import flex_flash_attn_func, validate_attn_inputs
from ffa_kernels._identity_cache import IdentityCache

I32 = torch.int32


def _qkv(t=256, hq=2, hk=2, d=8, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(t, h, d, generator=g, dtype=dtype) for h in (hq, hk, hk))


def _ranges(*rows):
    return torch.tensor(rows, dtype=I32).reshape(-1, 2)


# ----------------------------------------------------------------------------- in-place rewrites


def _rewrite_numpy(t, i, j, value):
    t.numpy()[i, j] = value


def _rewrite_data(t, i, j, value):
    t.data[i, j] = value


def _rewrite_from_numpy_view(t, i, j, value):
    view = torch.from_numpy(t.numpy())  # another tensor on the same memory, its own version
    view[i, j] = value


REWRITES = [_rewrite_numpy, _rewrite_data, _rewrite_from_numpy_view]


@pytest.mark.parametrize("rewrite", REWRITES, ids=lambda f: f.__name__)
def test_ranges_rewritten_in_place_without_version_bump_are_checked_again(rewrite):
    q, k, v = _qkv()
    qr, kr = _ranges([0, 256]), _ranges([0, 256])
    flex_flash_attn_func(q, k, v, qr, kr)
    version = kr._version
    rewrite(kr, 0, 1, 10_000)
    assert kr._version == version  # the write is invisible to the version counter
    with pytest.raises(ValueError, match=r"k_ranges\[0\] = \[0, 10000\).*Tk = 256"):
        flex_flash_attn_func(q, k, v, qr, kr)


@pytest.mark.parametrize("rewrite", REWRITES, ids=lambda f: f.__name__)
def test_ranges_rewritten_in_place_give_the_new_mask(rewrite):
    q, k, v = _qkv()
    qr, kr, tm = _ranges([0, 256], [0, 100]), _ranges([0, 256], [0, 10]), torch.tensor([1, 0], dtype=I32)
    flex_flash_attn_func(q, k, v, qr[:1], kr[:1], tm[:1])
    flex_flash_attn_func(q, k, v, qr, kr, tm)
    rewrite(kr, 0, 1, 128)
    rewrite(qr, 1, 0, 150)
    rewrite(qr, 1, 1, 200)
    tm.numpy()[1] = 2
    out, meta = flex_flash_attn_func(q, k, v, qr, kr, tm)
    ref, ref_meta = flex_flash_attn_func(q, k, v, qr.clone(), kr.clone(), tm.clone())
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    torch.testing.assert_close(meta.lse, ref_meta.lse, atol=0, rtol=0)


def test_equal_content_in_another_tensor_gives_that_tensors_values():
    """A content hit never hands back another (since rewritten) tensor's values."""
    q, k, v = _qkv()
    a, kr = _ranges([0, 256]), _ranges([0, 256])
    flex_flash_attn_func(q, k, v, a, kr)  # content [0, 256) cached
    b = a.clone()
    a.numpy()[0, 1] = 100  # a changes behind the version counter
    out, _ = flex_flash_attn_func(q, k, v, b, kr)  # b still holds [0, 256)
    ref, _ = flex_flash_attn_func(q, k, v, _ranges([0, 256]), kr.clone())
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


# ----------------------------------------------------------------------------- inference mode


def test_inference_mode_ranges_run_and_the_next_normal_call_works():
    q, k, v = _qkv()
    with torch.inference_mode():
        qr, kr = _ranges([0, 256]), _ranges([0, 200])
        out, _ = flex_flash_attn_func(q, k, v, qr, kr, torch.tensor([1], dtype=I32))
        assert out.is_inference()
    qn = q.clone().requires_grad_()
    ref, _ = flex_flash_attn_func(
        qn, k, v, _ranges([0, 256]), _ranges([0, 200]), torch.tensor([1], dtype=I32)
    )
    torch.testing.assert_close(out, ref.detach(), atol=0, rtol=0)
    ref.sum().backward()  # a normal (training) call after it, with the inference-mode ranges too
    out2, _ = flex_flash_attn_func(qn, k, v, qr, kr, torch.tensor([1], dtype=I32))
    torch.testing.assert_close(out2.detach(), ref.detach(), atol=0, rtol=0)


def test_identity_cache_skips_inference_tensors():
    cache = IdentityCache(maxsize=4)
    with torch.inference_mode():
        t = torch.zeros(3, dtype=I32)
    cache.put((t,), None, "value")  # no version counter to trust: not stored, no error
    assert cache.get((t,)) is None
    n = torch.zeros(3, dtype=I32)
    cache.put((n,), None, "value")
    assert cache.get((n,)) == "value"


# ----------------------------------------------------------------------------- double backward


def test_double_backward_is_refused():
    q, k, v = (x.requires_grad_() for x in _qkv(t=64))
    out, _ = flex_flash_attn_func(q, k, v, _ranges([0, 64]), _ranges([0, 64]), torch.tensor([1], dtype=I32))
    (gq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        torch.autograd.grad(gq.sum(), q)


# ----------------------------------------------------------------------------- shared validation


BAD_INPUTS = [
    # (overrides, exception, message) for the checks magi_dist.calc_attn shares
    (dict(softcap=True), TypeError, r"softcap must be a real number, got bool True"),
    (dict(softmax_scale="0.5"), TypeError, r"softmax_scale must be a real number, got str '0.5'"),
    (dict(softmax_scale=float("nan")), ValueError, r"softmax_scale must be finite, got nan"),
    (dict(sink=torch.zeros(2, 2, dtype=torch.float16)), TypeError, r"sink must be float32.*float16"),
    (dict(sink=torch.zeros(2, 2, dtype=torch.bfloat16)), TypeError, r"sink must be float32.*bfloat16"),
    (dict(sink=torch.zeros(2, 2, dtype=torch.int64)), TypeError, r"sink must be float32.*int64"),
    (dict(sink=torch.zeros(2, 3)), ValueError, r"sink with sink_layout='sh' must have shape \(S_sink, 2\)"),
    (dict(return_max_logits=1), TypeError, r"return_max_logits must be a bool, got int"),
]


@pytest.mark.parametrize(("overrides", "exc", "pattern"), BAD_INPUTS, ids=[c[2][:30] for c in BAD_INPUTS])
def test_validate_attn_inputs_matches_flex_flash_attn_func(overrides, exc, pattern):
    q, k, v = _qkv(t=16, dtype=torch.float32)
    with pytest.raises(exc, match=pattern):
        validate_attn_inputs(q, k, v, **overrides)
    with pytest.raises(exc, match=pattern):
        flex_flash_attn_func(q, k, v, _ranges([0, 16]), _ranges([0, 16]), **overrides)


def test_validate_attn_inputs_resolves_defaults():
    q, k, v = _qkv(t=16, d=16, dtype=torch.float32)
    sink = torch.zeros(16, 1, 2)
    got = validate_attn_inputs(q, k, v, sink=sink, sink_layout="ssh", softcap=2)
    assert got.softmax_scale == 16**-0.5 and got.softcap == 2.0 and isinstance(got.softcap, float)
    assert got.sink is sink and got.sink_layout == "ssh" and got.return_max_logits is False


# ----------------------------------------------------------------------------- non-finite K / V (reference)


def _causal_call(q, k, v, t, typ=1, **kw):
    return flex_flash_attn_func(
        q, k, v, _ranges([0, t]), _ranges([0, t]), torch.tensor([typ], dtype=I32), **kw
    )


def _grads(q, k, v, t, typ, **kw):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out, meta = _causal_call(q, k, v, t, typ, **kw)
    out.backward(torch.ones_like(out))
    return out.detach(), meta.lse, q.grad, k.grad, v.grad


def _bad_rows(x):
    return (~torch.isfinite(x)).flatten(1).any(dim=1).nonzero().flatten().tolist()


@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize(
    ("dtype", "hq", "softcap"), [(torch.float64, 2, 0.0), (torch.float32, 4, 0.0), (torch.float32, 4, 5.0)]
)
def test_non_finite_key_reaches_only_the_rows_that_see_it(where, bad, dtype, hq, softcap):
    """A causal slice of 64 rows with a NaN/inf at the last key: only the last row sees it. Before,
    P @ V multiplied the hidden cells' 0 by NaN and 63 rows came out NaN (and every dq)."""
    t = 64
    q, k, v = _qkv(t=t, hq=hq, hk=2, dtype=dtype)
    k_bad, v_bad = k.clone(), v.clone()
    {"k": k_bad, "v": v_bad}[where][t - 1, 0, 0] = bad
    out, lse, dq, _, _ = _grads(q, k_bad, v_bad, t, 1, softcap=softcap)
    ref_out, ref_lse, ref_dq, _, _ = _grads(q, k, v, t, 1, softcap=softcap)
    assert set(_bad_rows(out)) <= {t - 1} and set(_bad_rows(dq)) <= {t - 1}
    # the rows that do not see the key: the same numbers as with a finite value there
    torch.testing.assert_close(out[: t - 1], ref_out[: t - 1], atol=0, rtol=0)
    torch.testing.assert_close(lse[: t - 1], ref_lse[: t - 1], atol=0, rtol=0)
    torch.testing.assert_close(dq[: t - 1], ref_dq[: t - 1])


@pytest.mark.parametrize("where", ["k", "v"])
def test_non_finite_key_in_a_window_spares_rows_and_keys_apart_from_it(monkeypatch, where):
    """A sliding window (BICAUSAL) over several row blocks and column tiles: the rows that do not see
    key 90 keep finite out and dq, and the keys that only such rows see keep finite dk and dv."""
    from ffa_kernels.reference import masks as _masks

    monkeypatch.setattr(_masks, "BLOCK_ROWS", 32)
    monkeypatch.setattr(_masks, "TILE_ELEMS", 32 * 2 * 16)  # 16-column tiles
    monkeypatch.setattr(_masks, "MIN_TILE_COLS", 16)
    t, w = 128, 12
    q, k, v = _qkv(t=t, hq=2, hk=1)
    qr, kr, tm = _ranges([0, t]), _ranges([0, t + w]), torch.tensor([3], dtype=I32)  # j in [i, i + w]
    k2, v2 = torch.cat([k, k[:w]]), torch.cat([v, v[:w]])
    {"k": k2, "v": v2}[where][90, 0, 3] = float("nan")
    q, k2, v2 = (x.requires_grad_() for x in (q, k2, v2))
    out, _ = flex_flash_attn_func(q, k2, v2, qr, kr, tm)
    out.backward(torch.ones_like(out))
    seers = set(range(90 - w, 91))  # rows i with i <= 90 <= i + w
    assert set(_bad_rows(out)) == seers and set(_bad_rows(q.grad)) <= seers
    keys_of_seers = set(range(90 - w, 91 + w))
    assert set(_bad_rows(k2.grad)) <= keys_of_seers and set(_bad_rows(v2.grad)) <= keys_of_seers


def test_finite_inputs_take_the_unchanged_path(monkeypatch):
    """Finite K/V never reach the masked product (results stay bitwise what they were)."""
    from ffa_kernels.reference import forward as _forward

    def boom(*a, **kw):
        raise AssertionError("masked_bmm used for finite inputs")

    monkeypatch.setattr(_forward, "masked_bmm", boom)
    q, k, v = (x.requires_grad_() for x in _qkv(t=64))
    out, _ = _causal_call(q, k, v, 64)
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


def test_masked_bmm_matches_bmm_on_finite_values():
    from ffa_kernels.reference.forward import masked_bmm

    g = torch.Generator().manual_seed(1)
    hk, group, rows, cols, d = 2, 3, 5, 7, 4
    mask = torch.rand(rows, cols, generator=g) > 0.4
    a = torch.rand(hk, group * rows, cols, generator=g, dtype=torch.float64)
    a.view(hk, group, rows, cols).masked_fill_(~mask, 0.0)
    b = torch.randn(hk, cols, d, generator=g, dtype=torch.float64)
    torch.testing.assert_close(masked_bmm(a, b, mask, group), torch.bmm(a, b), atol=0, rtol=0)
    b[1, 2, 3] = float("inf")
    got = masked_bmm(a, b, mask, group).view(hk, group, rows, d)
    seen = mask[:, 2]
    want_inf = seen.view(1, 1, rows).expand(1, group, rows)
    assert torch.equal(torch.isinf(got[1, :, :, 3]), want_inf[0])
    assert torch.isfinite(got[0]).all() and torch.isfinite(got[1, :, :, :3]).all()


# ----------------------------------------------------------------------------- compile disk cache


class _FakeFn:
    """What cute.compile returns, as far as the cache uses it."""

    def __init__(self, payload: bytes):
        self.payload = payload

    def export_to_c(self, folder, name, function_prefix):
        pathlib.Path(folder, f"{name}.o").write_bytes(self.payload)
        pathlib.Path(folder, f"{name}.h").write_text(f"// {function_prefix}\n")


class _FakeCute:
    def __init__(self):
        self.compiled = 0

    def compile(self, built, *args, options=""):
        self.compiled += 1
        return _FakeFn(b"\x7fELF kernel " + str(built).encode())


@pytest.fixture
def fake_cache(tmp_path, monkeypatch):
    """compile_cache with a fake compiler and loader; FFA_CACHE_DIR under tmp_path (not created)."""
    from ffa_kernels.cute import compile_cache

    cute = _FakeCute()
    loaded = []

    def load(path, name):
        loaded.append(pathlib.Path(path))
        return ("loaded", pathlib.Path(path).read_bytes())

    root = tmp_path / "outer" / "ffa"
    monkeypatch.setenv("FFA_CACHE_DIR", str(root))
    monkeypatch.setattr(compile_cache, "cutlass_modules", lambda: (None, cute))
    monkeypatch.setattr(compile_cache, "source_hash", lambda: "srchash")
    monkeypatch.setattr(compile_cache, "load_module", load, raising=False)
    compile_cache.forget()

    def get(key=("k", 1)):
        compile_cache.forget(key)
        return compile_cache.compiled_kernel(key, "ffa_test_", lambda: "kernel", lambda: [], "test kernel")

    yield types.SimpleNamespace(
        cc=compile_cache, cute=cute, loaded=loaded, root=root, kdir=root / "srchash", get=get
    )
    compile_cache.forget()


def _mode(p):
    return stat.S_IMODE(os.stat(p).st_mode)


def test_cache_dirs_are_created_0700_and_files_carry_their_sha256(fake_cache):
    fn = fake_cache.get()
    assert isinstance(fn, _FakeFn) and fake_cache.cute.compiled == 1
    for d in (fake_cache.root.parent, fake_cache.root, fake_cache.kdir):
        assert _mode(d) == 0o700, (d, oct(_mode(d)))
    names = sorted(p.name for p in fake_cache.kdir.iterdir())
    (obj,) = [p for p in fake_cache.kdir.iterdir() if p.suffix == ".o"]
    assert names == sorted([obj.name, obj.name + ".sha256", obj.stem + ".h", obj.stem + ".h.sha256"])
    recorded = (fake_cache.kdir / (obj.name + ".sha256")).read_text().split()
    assert recorded == [hashlib.sha256(obj.read_bytes()).hexdigest(), obj.name]


def test_a_verified_file_is_loaded_without_compiling(fake_cache):
    fake_cache.get()
    fn = fake_cache.get()
    assert fake_cache.cute.compiled == 1 and fn[0] == "loaded" and fake_cache.loaded[0].suffix == ".o"


@pytest.mark.parametrize("damage", ["tamper", "truncate", "no-digest", "empty-digest"])
def test_a_file_whose_sha256_differs_is_compiled_again(fake_cache, caplog, damage):
    fake_cache.get()
    (obj,) = [p for p in fake_cache.kdir.iterdir() if p.suffix == ".o"]
    digest = fake_cache.cc.digest_path(obj)
    if damage == "tamper":
        obj.write_bytes(obj.read_bytes().replace(b"kernel", b"evil!!"))
    elif damage == "truncate":
        obj.write_bytes(obj.read_bytes()[:4])
    elif damage == "no-digest":
        digest.unlink()
    else:
        digest.write_text("")
    with caplog.at_level(logging.WARNING, logger=fake_cache.cc.__name__):
        fn = fake_cache.get()
    assert isinstance(fn, _FakeFn) and fake_cache.cute.compiled == 2 and not fake_cache.loaded
    assert f"not loading cached kernel {obj}" in caplog.text
    assert fake_cache.cc.verify_file(obj) is None  # the entry was written again


@pytest.mark.parametrize("which", ["root", "kdir"])
@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777])
def test_a_group_or_world_writable_cache_dir_is_not_used(fake_cache, caplog, which, mode):
    fake_cache.get()  # a valid entry now exists
    d = fake_cache.root if which == "root" else fake_cache.kdir
    os.chmod(d, mode)
    before = sorted(p.name for p in fake_cache.kdir.iterdir())
    with caplog.at_level(logging.WARNING, logger=fake_cache.cc.__name__):
        fn = fake_cache.get(("another", 2))
        fn2 = fake_cache.get()
    assert isinstance(fn, _FakeFn) and isinstance(fn2, _FakeFn)  # compiled in memory, not loaded
    assert fake_cache.cute.compiled == 3 and not fake_cache.loaded
    assert sorted(p.name for p in fake_cache.kdir.iterdir()) == before  # nothing written there
    assert (
        f"not using the kernel disk cache {d}: it is group- or world-writable (mode {mode:#o})" in caplog.text
    )
    assert caplog.text.count("not using the kernel disk cache") == 1  # warned once


def test_a_cache_dir_owned_by_someone_else_is_not_used(fake_cache, caplog, monkeypatch):
    fake_cache.get()
    me = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: me + 1)
    with caplog.at_level(logging.WARNING, logger=fake_cache.cc.__name__):
        fn = fake_cache.get()
    assert isinstance(fn, _FakeFn) and not fake_cache.loaded
    assert f"is owned by uid {me}, not by this user (uid {me + 1})" in caplog.text


def test_a_cache_path_that_is_a_file_is_not_used(fake_cache, caplog):
    fake_cache.root.parent.mkdir(parents=True)
    fake_cache.root.write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger=fake_cache.cc.__name__):
        fn = fake_cache.get()
    assert isinstance(fn, _FakeFn) and "not using the kernel disk cache" in caplog.text


def test_write_atomic_leaves_no_temporary_file(tmp_path, monkeypatch):
    from ffa_kernels.cute import compile_cache

    target = tmp_path / "f.bin"
    compile_cache.write_atomic(target, b"one")
    compile_cache.write_atomic(target, b"two")
    assert target.read_bytes() == b"two" and [p.name for p in tmp_path.iterdir()] == ["f.bin"]

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        compile_cache.write_atomic(target, b"three")
    assert target.read_bytes() == b"two" and [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_real_kernel_round_trip_through_the_verified_cache(tmp_path, monkeypatch, caplog):
    """One real sm_90a compile on the CPU: exported with digests into 0700 folders, loaded back
    without compiling, and compiled again once the object file is altered."""
    pytest.importorskip("cutlass")
    from ffa_kernels.cute import compile_cache, interface
    from ffa_kernels.cute.config import default_config

    monkeypatch.setenv("FFA_CACHE_DIR", str(tmp_path / "cache"))
    cfg = default_config(64)
    key = interface.compile_key(torch.bfloat16, cfg, False)
    compile_cache.forget(key)
    with caplog.at_level(logging.INFO, logger=compile_cache.__name__):
        interface.get_kernel(torch.bfloat16, cfg, False)
        kdir = tmp_path / "cache" / compile_cache.source_hash()
        assert _mode(tmp_path / "cache") == 0o700 and _mode(kdir) == 0o700
        (obj,) = kdir.glob("*.o")
        assert compile_cache.verify_file(obj) is None
        compile_cache.forget(key)
        caplog.clear()
        interface.get_kernel(torch.bfloat16, cfg, False)
        assert "compiled" not in caplog.text  # loaded from disk
        data = bytearray(obj.read_bytes())
        data[len(data) // 2] ^= 0xFF
        obj.write_bytes(bytes(data))
        compile_cache.forget(key)
        interface.get_kernel(torch.bfloat16, cfg, False)
        assert "differs from the recorded" in caplog.text and "compiled sm90 forward" in caplog.text
    compile_cache.forget(key)
