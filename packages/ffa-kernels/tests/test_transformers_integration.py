"""ffa_kernels.integrations.transformers: ``attn_implementation="ffa"`` against ``"sdpa"``.

Tiny randomly initialised models built from their configs (no download), float32 on the CPU:
packed documents (from position_ids restarts, from cu_seq_lens_q / cu_seq_lens_k), a padding
mask, sliding windows (Mistral: every layer; Qwen2: a sliding and a full layer) and greedy
generation with a KV cache give the logits and parameter gradients of the same model under
``sdpa`` with the equivalent mask; the errors name their argument. ``import ffa_kernels`` does not
import transformers.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ffa_kernels.integrations import transformers as ffa_tf  # noqa: E402

VOCAB = 97
# float32 on the CPU: the reference backend and SDPA's math differ only in the order of sums.
# Measured: max |ffa - sdpa| <= 4.3e-7 * max |sdpa| for the logits and every parameter's gradient
# (a few float32 ulps; the gradients' scales range from 0.4 to 95). Bound: REL times that scale.
REL = 5e-6
TOL = {"atol": 1e-6, "rtol": 1e-5}  # attention outputs and scores of order 1


@pytest.fixture(scope="module", autouse=True)
def _registered():
    ffa_tf.register()


def _small(**kw) -> dict:
    return dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        **kw,
    )


def _model(cls, config, seed=0):
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32)
    model.train()  # gradients; attention_dropout is 0
    return model


def _packed(lengths: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return ids, pos, doc


def _dense_mask(doc: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """bool (1, 1, T, T): same document, causal, and within the window when given."""
    t = torch.arange(doc.numel())
    keep = (doc[:, None] == doc[None, :]) & (t[:, None] >= t[None, :])
    if window is not None:
        keep &= t[:, None] - t[None, :] < window
    return keep[None, None]


def _run(model, impl: str, **inputs):
    """Logits and parameter gradients of a fixed loss (weights every logit differently)."""
    model.set_attn_implementation(impl)
    model.zero_grad(set_to_none=True)
    logits = model(**inputs, use_cache=False).logits
    w = torch.linspace(-1, 1, logits.numel()).view_as(logits)
    (logits * w).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _close(name: str, x: torch.Tensor, ref: torch.Tensor) -> None:
    """max |x - ref| <= REL * max |ref| (and the same shape)."""
    assert x.shape == ref.shape, (name, x.shape, ref.shape)
    err, scale = float((x - ref).abs().max()), float(ref.abs().max())
    assert err <= REL * scale, f"{name}: max |diff| {err:.3e} > {REL} * max |ref| = {REL * scale:.3e}"


def _assert_same(got, ref, rows=None):
    logits, grads = got
    ref_logits, ref_grads = ref
    if rows is not None:
        logits, ref_logits = logits[rows], ref_logits[rows]
    _close("logits", logits, ref_logits)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        _close(name, grads[name], ref_grads[name])


# ----------------------------------------------------------------------------- equal to sdpa


def test_llama_packed_position_ids_match_sdpa_block_causal_mask():
    """Documents from position_ids restarts (two rows packed differently): logits and gradients
    of every parameter equal sdpa's with the block-diagonal causal 4D mask."""
    model = _model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**_small()))
    ids0, pos0, doc0 = _packed([5, 17, 3, 11], seed=1)
    ids1, pos1, doc1 = _packed([20, 16], seed=2)
    ids, pos = torch.cat([ids0, ids1]), torch.cat([pos0, pos1])
    got = _run(model, "ffa", input_ids=ids, position_ids=pos)
    dense = torch.cat([_dense_mask(doc0), _dense_mask(doc1)])
    ref = _run(model, "sdpa", input_ids=ids, position_ids=pos, attention_mask=dense)
    _assert_same(got, ref)
    # and the per-document runs: the same logits, document by document
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        for s, e in ((0, 5), (5, 22), (22, 25), (25, 36)):
            alone = model(input_ids=ids0[:, s:e], use_cache=False).logits
            _close(f"document [{s}, {e})", got[0][0, s:e], alone[0])


def test_llama_cu_seq_lens_match_sdpa():
    """cu_seq_lens_q / cu_seq_lens_k define the documents (they take precedence over position_ids,
    which here run straight through the row)."""
    model = _model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**_small()), seed=3)
    lengths = [7, 12, 1, 20]
    ids, _, doc = _packed(lengths, seed=4)
    pos = torch.arange(ids.shape[1])[None]
    cu = torch.tensor([0, 7, 19, 20, 40], dtype=torch.int32)
    got = _run(
        model,
        "ffa",
        input_ids=ids,
        position_ids=pos,
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=20,
        max_length_k=20,
    )
    ref = _run(model, "sdpa", input_ids=ids, position_ids=pos, attention_mask=_dense_mask(doc))
    _assert_same(got, ref)


def test_mistral_sliding_window_matches_sdpa_window_mask():
    """config.sliding_window = 4 with documents longer than it: a causal band within each
    document, equal to sdpa with the block-diagonal causal window mask."""
    config = transformers.MistralConfig(**_small(sliding_window=4))
    model = _model(transformers.MistralForCausalLM, config, seed=5)
    ids, pos, doc = _packed([9, 3, 14, 6], seed=6)
    got = _run(model, "ffa", input_ids=ids, position_ids=pos)
    ref = _run(model, "sdpa", input_ids=ids, position_ids=pos, attention_mask=_dense_mask(doc, window=4))
    _assert_same(got, ref)


def test_qwen2_sliding_and_full_layers_match_sdpa():
    """A sliding layer (window 5) and a full layer: the window comes per layer from the config;
    sdpa's masks are the ones transformers builds itself from the packed position_ids."""
    config = transformers.Qwen2Config(
        **_small(
            sliding_window=5, use_sliding_window=True, layer_types=["sliding_attention", "full_attention"]
        )
    )
    model = _model(transformers.Qwen2ForCausalLM, config, seed=7)
    ids, pos, _ = _packed([13, 4, 19], seed=8)
    got = _run(model, "ffa", input_ids=ids, position_ids=pos)
    ref = _run(model, "sdpa", input_ids=ids, position_ids=pos)
    _assert_same(got, ref)
    # the window matters here: without it (all full layers) the logits differ
    model.config.layer_types = ["full_attention", "full_attention"]
    for layer in model.model.layers:
        layer.self_attn.sliding_window = None
    model.set_attn_implementation("ffa")
    full = model(input_ids=ids, position_ids=pos, use_cache=False).logits.detach()
    assert (full - got[0]).abs().max() > 1e-3


def test_llama_left_and_right_padding_match_sdpa():
    """A 2D padding mask (one row left-padded, one right-padded): the tokens' logits and all
    gradients equal sdpa's with the same mask (padding rows are not compared; their output is 0
    under ffa)."""
    model = _model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**_small()), seed=9)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(10))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, :5] = 0  # left padding
    mask[1, 12:] = 0  # right padding
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    tokens = mask.bool()

    def run(impl):
        model.set_attn_implementation(impl)
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False).logits
        w = torch.linspace(-1, 1, logits.numel()).view_as(logits) * tokens[..., None]
        (logits * w).sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    _assert_same(run("ffa"), run("sdpa"), rows=tokens)


def test_generate_with_kv_cache_matches_sdpa():
    """Greedy generation (prefill, then one query against the cache): the same tokens and the
    same final scores as sdpa."""
    model = _model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**_small()), seed=11).eval()
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(12))
    outs = {}
    for impl in ("ffa", "sdpa"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            outs[impl] = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=6,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
    assert torch.equal(outs["ffa"].sequences, outs["sdpa"].sequences)
    for a, b in zip(outs["ffa"].scores, outs["sdpa"].scores):
        torch.testing.assert_close(a, b, **TOL)


def _sdpa(q, k, v, keep, scale=None):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale)
    return out.transpose(1, 2)


def test_function_bidirectional_window_softcap_and_sink():
    """The function alone: a non-causal module (|q - k| < w within each document), and softcap with
    s_aux sink logits against a dense computation."""
    g = torch.Generator().manual_seed(13)
    q, k, v = (
        torch.randn(1, 4, 12, 8, generator=g),
        torch.randn(1, 2, 12, 8, generator=g),
        torch.randn(1, 2, 12, 8, generator=g),
    )
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4]])
    doc = torch.tensor([0] * 7 + [1] * 5)
    module = torch.nn.Module()
    module.is_causal = False
    out, weights = ffa_tf.ffa_attention_forward(module, q, k, v, None, sliding_window=3, position_ids=pos)
    assert weights is None and out.shape == (1, 12, 4, 8)
    t = torch.arange(12)
    keep = (doc[:, None] == doc[None, :]) & ((t[:, None] - t[None, :]).abs() < 3)
    torch.testing.assert_close(out, _sdpa(q, k, v, keep), **TOL)

    sink = torch.randn(4, generator=g)
    out, _ = ffa_tf.ffa_attention_forward(
        torch.nn.Module(), q, k, v, None, softcap=2.0, s_aux=sink, scaling=0.5
    )
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    logits = 2.0 * torch.tanh(0.5 * q @ kk.transpose(-1, -2) / 2.0)
    logits = logits.masked_fill(t[:, None] < t[None, :], float("-inf"))
    logits = torch.cat([logits, sink.view(1, 4, 1, 1).expand(1, 4, 12, 1)], dim=-1)
    ref = (logits.softmax(-1)[..., :-1] @ vv).transpose(1, 2)
    torch.testing.assert_close(out, ref, **TOL)


def test_mask_is_built_once_per_batch():
    """Every layer of a forward reuses one FlexMask (cached by the identity of position_ids)."""
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    a = ffa_tf.document_mask(1, 5, 5, position_ids=pos)
    assert ffa_tf.document_mask(1, 5, 5, position_ids=pos) is a
    assert a.slices == [(0, 3, 0, 3, 1), (3, 5, 3, 5, 1)]
    assert ffa_tf.document_mask(1, 5, 5, position_ids=pos, sliding_window=2) is not a
    pos[0, 3:] = torch.tensor([3, 4])  # an in-place write: rebuilt
    assert ffa_tf.document_mask(1, 5, 5, position_ids=pos).slices == [(0, 5, 0, 5, 1)]


# ----------------------------------------------------------------------------- errors


def _qkv(b=1, s=6):
    return torch.randn(b, 4, s, 8), torch.randn(b, 2, s, 8), torch.randn(b, 2, s, 8)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"dropout": 0.1}, ValueError, r"dropout: .*dropout=0\.1"),
        (
            {"attention_mask": torch.ones(1, 1, 6, 6, dtype=torch.bool)},
            ValueError,
            r"attention_mask: .*\(1, 1, 6, 6\)",
        ),
        (
            {"attention_mask": torch.tensor([[1, 1, 0, 1, 1, 1]])},
            ValueError,
            r"attention_mask: row 0 has padding between",
        ),
        ({"attention_mask": torch.zeros(1, 6)}, TypeError, r"attention_mask: .*float32"),
        ({"cu_seq_lens_q": torch.tensor([0, 6])}, ValueError, r"cu_seq_lens_q, cu_seq_lens_k: give both"),
        (
            {"cu_seq_lens_q": torch.tensor([0, 4]), "cu_seq_lens_k": torch.tensor([0, 4])},
            ValueError,
            r"cu_seq_lens_q: .*from 0 to 6.*\[0, 4\]",
        ),
        (
            {"cu_seq_lens_q": torch.tensor([0, 2, 6]), "cu_seq_lens_k": torch.tensor([0, 6])},
            ValueError,
            r"same number of documents, got 2 and 1",
        ),
        ({"sliding_window": 0}, ValueError, r"sliding_window: .*got 0"),
        ({"sliding_window": True}, TypeError, r"sliding_window: .*True"),
        (
            {"position_ids": torch.zeros(3, 1, 6, dtype=torch.long)},
            ValueError,
            r"position_ids: .*\(3, 1, 6\)",
        ),
        ({"s_aux": torch.zeros(3)}, ValueError, r"s_aux: .*\(4,\), got \(3,\)"),
    ],
)
def test_errors_name_the_argument(kwargs, error, match):
    q, k, v = _qkv()
    mask = kwargs.pop("attention_mask", None)
    with pytest.raises(error, match=match):
        ffa_tf.ffa_attention_forward(torch.nn.Module(), q, k, v, mask, **kwargs)


def test_error_cases_with_a_cache_and_in_a_model():
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    with pytest.raises(ValueError, match=r"position_ids: a document starts inside row 0 \(at token 2\)"):
        ffa_tf.ffa_attention_forward(torch.nn.Module(), q, k, v, None, position_ids=torch.tensor([[4, 5, 0]]))
    module = torch.nn.Module()
    module.is_causal = False
    with pytest.raises(
        ValueError, match=r"sliding_window: a non-causal window needs as many queries as keys"
    ):
        ffa_tf.ffa_attention_forward(module, q, k, v, None, sliding_window=2)
    with pytest.raises(TypeError, match=r"query: expected a torch.Tensor"):
        ffa_tf.ffa_attention_forward(module, None, k, v, None)
    # a model in training with attention dropout
    config = transformers.LlamaConfig(**_small(attention_dropout=0.1))
    model = _model(transformers.LlamaForCausalLM, config)
    model.set_attn_implementation("ffa")
    with pytest.raises(ValueError, match=r"dropout: .*dropout=0\.1"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long), use_cache=False)
    model.eval()  # no dropout in eval: runs
    model(input_ids=torch.zeros(1, 4, dtype=torch.long), use_cache=False)


def test_register_adds_attention_and_mask_functions():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    assert ffa_tf.register() == "ffa"
    assert AttentionInterface._global_mapping["ffa"] is ffa_tf.ffa_attention_forward
    assert AttentionMaskInterface._global_mapping["ffa"] is flash_attention_mask
    with pytest.raises(TypeError, match="name: expected a non-empty str"):
        ffa_tf.register("")


def test_import_ffa_kernels_does_not_import_transformers():
    """In a fresh process: importing ffa_kernels and the integration module leaves transformers
    unimported; with transformers unavailable the function still runs and `register` raises an
    ImportError naming the extra."""
    code = (
        "import sys, torch, ffa_kernels, ffa_kernels.integrations.transformers as t\n"
        "assert 'transformers' not in sys.modules, 'imported transformers'\n"
        "sys.modules['transformers'] = None  # as if not installed\n"
        "q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)\n"
        "out, _ = t.ffa_attention_forward(torch.nn.Module(), q, k, k, None)\n"
        "assert out.shape == (1, 5, 4, 8)\n"
        "try:\n"
        "    t.register()\n"
        "except ImportError as e:\n"
        "    assert 'ffa-kernels[transformers]' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('register() without transformers')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
