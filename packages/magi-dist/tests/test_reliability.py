"""Reliability of magi_dist on one rank (issue 23), and the runtime cache (issue 22).

These run in the test process on a 1-rank gloo group; the multi-rank cases (keys that differ
between ranks, caches that differ, two groups) are in integration_tests/test_reliability.py.
"""

import ast
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import magi_dist as md
import magi_dist.attn
import magi_dist.runtime
from ffa_kernels import flex_flash_attn_func
from magi_solver import DispatchConfig, DistAttnConfig, OverlapConfig

CU = [0, 40, 96]
SRC = Path(md.__file__).parent


@pytest.fixture(scope="module")
def group():
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            md.clear_cache()
            dist.destroy_process_group()


def _key(cu=CU, group=None, chunk=16, **kw):
    config = DistAttnConfig(
        dispatch_config=DispatchConfig(chunk_size=chunk),
        overlap_config=OverlapConfig(mode="dynamic", degree=None, min_chunk_size=8),
    )
    return md.magi_attn_varlen_key(cu, cu, 4, 2, 8, group, causal=True, dist_attn_config=config, **kw)


def _qkv(n=96, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(n, h, 8, generator=g, dtype=dtype) for h in (4, 2, 2))


# ----------------------------------------------------------------------------- issue 22: the cache


def test_key_module_does_not_import_the_runtime():
    """No import circle: key.py knows nothing of runtimes; runtime.py holds the cache."""
    tree = ast.parse((SRC / "key.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    assert not any(m.startswith("magi_dist") for m in imported), imported
    assert md.get_runtime is magi_dist.runtime.get_runtime
    assert md.clear_cache is magi_dist.runtime.clear_cache


def test_runtime_cache_size_limit(group, monkeypatch):
    monkeypatch.setenv("MAGI_DIST_RUNTIME_CACHE_SIZE", "2")
    md.clear_cache()
    keys = [_key([0, 40, n]) for n in (96, 97, 98)]
    rts = [md.get_runtime(k) for k in keys[:2]]
    assert md.get_runtime(keys[0]) is rts[0]  # a hit, and now the most recently used
    md.get_runtime(keys[2])  # evicts the least recently used: keys[1]
    assert md.get_runtime(keys[0]) is rts[0]
    assert md.get_runtime(keys[1]) is not rts[1]  # planned again
    assert len(magi_dist.runtime._RUNTIMES) == 2


@pytest.mark.parametrize("value", ["0", "-3", "many", "1.5"])
def test_runtime_cache_size_must_be_a_positive_int(group, monkeypatch, value):
    monkeypatch.setenv("MAGI_DIST_RUNTIME_CACHE_SIZE", value)
    with pytest.raises(ValueError, match=rf"MAGI_DIST_RUNTIME_CACHE_SIZE.*{value!r}"):
        md.get_runtime(_key([0, 40, 99]))


def test_clear_cache_drops_every_runtime(group):
    rt = md.get_runtime(_key())
    md.clear_cache()
    assert md.get_runtime(_key()) is not rt


def test_get_position_ids_one_rank(group):
    key = _key([0, 40, 90])  # 90 tokens on a 16-token chunk grid: 6 padding rows
    pos = md.get_position_ids(key)
    assert pos.dtype == torch.int64 and torch.equal(pos, torch.arange(96))
    x = torch.arange(90.0)[:, None]
    assert torch.equal(md.dispatch(x, key, pad_value=-1.0)[:, 0], torch.cat([x[:, 0], -torch.ones(6)]))


# ----------------------------------------------------------------------------- issue 23


def test_runtime_cache_key_holds_the_group(group):
    g1, g2 = dist.new_group([0]), dist.new_group([0])
    k1, k2 = _key(group=g1), _key(group=g2)
    assert k1 != k2 and _key(group=g1) == k1
    assert md.get_runtime(k1).group is g1
    assert md.get_runtime(k2).group is g2


def test_inference_mode_runs_and_the_next_normal_call_works(group):
    md.clear_cache()
    key = _key()
    q, k, v = _qkv()
    qr = torch.tensor([[0, 40], [40, 96]], dtype=torch.int32)
    tm = torch.tensor([1, 1], dtype=torch.int32)
    with torch.inference_mode():
        out, _ = md.calc_attn(q, k, v, key)
    ref, _ = flex_flash_attn_func(q, k, v, qr, qr.clone(), tm)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    qg = q.clone().requires_grad_()
    out2, _ = md.calc_attn(qg, k, v, key)  # the same cached runtime, now with autograd
    out2.sum().backward()
    torch.testing.assert_close(out2.detach(), ref, atol=1e-12, rtol=0)
    assert qg.grad is not None


def test_double_backward_is_refused(group):
    key = _key()
    q, k, v = (x.requires_grad_() for x in _qkv())
    out, _ = md.calc_attn(q, k, v, key)
    (gq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        torch.autograd.grad(gq.sum(), q)


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_reaches_every_backward_stage(group, monkeypatch, deterministic):
    """calc_attn(deterministic=...) asks every stage's backward for that mode, and the
    gradients equal the default mode's (the reference backend is deterministic either way)."""
    seen = []
    real = magi_dist.attn.ffa_backward_stage

    def spy(*args, **kwargs):
        seen.append(kwargs.get("deterministic"))
        return real(*args, **kwargs)

    monkeypatch.setattr(magi_dist.attn, "ffa_backward_stage", spy)
    key = _key()
    grads = []
    for det in (deterministic, False):
        q, k, v = (x.requires_grad_() for x in _qkv())
        out, _ = md.calc_attn(q, k, v, key, deterministic=det)
        grads.append(torch.autograd.grad(out.square().sum(), (q, k, v)))
    assert seen and set(seen[: len(seen) // 2]) == {deterministic}
    assert all(torch.equal(a, b) for a, b in zip(*grads))


BAD_ARGS = [
    (dict(softcap=True), TypeError, r"softcap must be a real number, got bool"),
    (dict(softcap=-1.0), ValueError, r"softcap must be >= 0"),
    (dict(softmax_scale="0.5"), TypeError, r"softmax_scale must be a real number, got str"),
    (dict(softmax_scale=float("nan")), ValueError, r"softmax_scale must be finite, got nan"),
    (dict(sink=torch.zeros(2, 4, dtype=torch.float16)), TypeError, r"sink must be float32"),
    (dict(sink=torch.zeros(2, 4, dtype=torch.bfloat16)), TypeError, r"sink must be float32"),
    (dict(sink=torch.zeros(2, 4, dtype=torch.int64)), TypeError, r"sink must be float32"),
    (dict(sink=torch.zeros(2, 3)), ValueError, r"sink"),
    (dict(sink=[0.0]), TypeError, r"sink must be a torch.Tensor"),
    (dict(return_max_logits="yes"), TypeError, r"return_max_logits must be a bool"),
    (dict(q=torch.zeros(96, 4, 8, dtype=torch.int64)), TypeError, r"q dtype"),
    (dict(deterministic="yes"), TypeError, r"deterministic: expected a bool, got str"),
]


@pytest.mark.parametrize(("overrides", "exc", "pattern"), BAD_ARGS, ids=[c[2][:30] for c in BAD_ARGS])
def test_bad_arguments_fail_before_any_collective(group, monkeypatch, overrides, exc, pattern):
    def no_collective(*args, **kwargs):
        raise AssertionError("a collective was reached before the arguments were checked")

    key = _key([0, 40, 101])  # a key never used before: its first use exchanges fingerprints
    for name in ("group_cast", "group_reduce"):
        monkeypatch.setattr(magi_dist.attn, name, no_collective)
    for name in ("all_gather", "all_reduce", "all_gather_into_tensor", "broadcast"):
        monkeypatch.setattr(dist, name, no_collective)
    q, k, v = _qkv(112)
    kwargs = dict(q=q, k=k, v=v, **{n: x for n, x in overrides.items() if n not in ("q", "k", "v")})
    kwargs.update({n: x for n, x in overrides.items() if n in ("q", "k", "v")})
    with pytest.raises(exc, match=pattern):
        md.calc_attn(kwargs.pop("q"), kwargs.pop("k"), kwargs.pop("v"), key, **kwargs)
