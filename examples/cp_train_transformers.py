"""Train a Hugging Face ``transformers`` causal LM on packed documents with context parallelism.

    python examples/cp_train_transformers.py --spawn 2                  # CPU: starts 2 gloo ranks
    python examples/cp_train_transformers.py --spawn 2 --sliding-window 16   # Mistral, window 16
    torchrun --nproc-per-node 2 examples/cp_train_transformers.py       # the same ranks under torchrun

A tiny ``LlamaForCausalLM`` (``MistralForCausalLM`` with ``--sliding-window``), built from its
config with random weights (no download), trains on one row of packed documents. Every rank holds
the same model. The input ids and position ids are dispatched over the cp group
(``magi_dist.dispatch``); on the CPU over gloo (the reference kernels), each rank runs the model on its chunks with
``attn_implementation="magi"``, an attention function (`magi_attention_forward`, registered here
with ``transformers.AttentionInterface``) that calls ``magi_dist.calc_attn`` with the key of the
batch's mask (documents, causal, the config's window), passed as the model keyword ``magi_key``.
Everything else in the model is per token (RoPE takes the dispatched position ids). The logits
are undispatched (``magi_dist.undispatch``, differentiable: its backward keeps each rank's rows),
every rank computes the same loss, and the parameter gradients are summed over the group.

Rank 0 also trains an identical copy in one process on the whole row with
``attn_implementation="ffa"`` (`ffa_kernels.integrations.transformers`: the documents from the
position ids' restarts) and prints both loss curves. ``--check`` makes the run a test: the losses
must match the single process within `TOLERANCE` (relative, per step), every rank must end with
bitwise the same weights, and the loss must go down; every rank exits 1 otherwise.

Undispatching the logits gathers ``(T, vocab)`` on every rank, which is fine for a small vocab;
with a large one compute the loss on the local logits with dispatched labels instead (as
examples/cp_train.py does).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers

import magi_dist as md
from ffa_kernels.integrations.transformers import register as register_ffa
from magi_solver import DispatchConfig, DistAttnConfig, OverlapConfig

# --spawn: seconds before the started ranks count as hung (run_ranks kills them)
SPAWN_TIMEOUT_S = 900.0

# ----------------------------------------------------------------------------- the attention


def magi_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    magi_key: md.DistAttnRuntimeKey | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``attn_implementation="magi"``: this rank's rows of context-parallel attention.

    query ``(1, Hq, S_local, D)``, key / value ``(1, Hk, S_local, D)`` (the dispatched tokens, one
    row); ``magi_key`` (a model keyword) holds the mask of the whole batch, so ``attention_mask``
    must be None and ``sliding_window`` / ``is_causal`` / ``position_ids`` are already in it (the
    model still passes them: ignored). No ``s_aux`` sinks here. Returns
    ``(out (1, S_local, Hq, D), None)``.
    """
    if magi_key is None:
        raise ValueError(
            "magi_key: attn_implementation='magi' needs the batch's key: model(..., magi_key=key)"
        )
    if query.shape[0] != 1:
        raise ValueError(f"query: expected one row of dispatched tokens, got shape {tuple(query.shape)}")
    if attention_mask is not None:
        raise ValueError(
            f"attention_mask: the mask is in magi_key, got a tensor of shape {tuple(attention_mask.shape)}"
        )
    if dropout:
        raise ValueError(f"dropout: no attention dropout under attn_implementation='magi', got {dropout}")
    if kwargs.get("s_aux") is not None:
        raise ValueError("s_aux: attention sinks are not wired into this example's 'magi' function")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (S_local, H, D)
    out, _ = md.calc_attn(
        q, k.contiguous(), v.contiguous(), magi_key, softmax_scale=scaling, softcap=float(softcap or 0.0)
    )
    return out[None], None


def register() -> None:
    """``"magi"`` (this file) and ``"ffa"`` (ffa_kernels) as transformers attention functions.
    "magi" has no mask function: the model passes no mask (the key holds it)."""
    transformers.AttentionInterface.register("magi", magi_attention_forward)
    register_ffa()


# ----------------------------------------------------------------------------- data and model


def make_batch(
    total: int, vocab: int, seed: int
) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed documents of random lengths, each an arithmetic sequence mod ``vocab`` (the next token
    is learnable from context). Returns cu_seqlens (a list) and, each ``(total,)``, the tokens, the
    labels (-100 at each document's last token) and the position ids (0 at each document's start)."""
    rng = random.Random(seed)
    cu = [0]
    while cu[-1] < total:
        cu.append(min(total, cu[-1] + rng.randint(6, 60)))
    tokens: list[int] = []
    labels: list[int] = []
    for s, e in zip(cu, cu[1:]):
        start, step = rng.randrange(vocab), rng.randrange(1, 5)
        seq = [(start + i * step) % vocab for i in range(e - s)]
        tokens += seq
        labels += [*seq[1:], -100]
    positions = torch.cat([torch.arange(e - s) for s, e in zip(cu, cu[1:])])
    return cu, torch.tensor(tokens), torch.tensor(labels), positions


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 10
    seqlen: int = 512
    chunk: int = 32
    degree: int = 1
    lr: float = 3e-3
    dtype: str = "float32"  # "float32" | "float64"
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 64
    sliding_window: int = 0  # > 0: a MistralForCausalLM with this window
    seed: int = 0
    data_seed: int = 1


# the cp run against one process, max over steps of |loss - ref| / |ref|: only the order of
# float sums differs (the cp merge of stage partials, the gradient all-reduce). Measured on 2 CPU
# gloo ranks (512 tokens, 6 AdamW steps): float32 6.1e-8; float64 0 (300 tokens, 4 steps).
TOLERANCE = {"float64": 1e-12, "float32": 1e-5}


def make_model(cfg: TrainConfig, attn: str) -> transformers.PreTrainedModel:
    common = dict(
        vocab_size=cfg.vocab,
        hidden_size=cfg.hidden,
        intermediate_size=2 * cfg.hidden,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.seqlen,
    )
    torch.manual_seed(cfg.seed)  # the same weights on every rank and in both runs
    if cfg.sliding_window:
        model = transformers.MistralForCausalLM(
            transformers.MistralConfig(**common, sliding_window=cfg.sliding_window)
        )
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    model.set_attn_implementation(attn)
    return model.to(getattr(torch, cfg.dtype)).train()


class Trainer:
    """The model, AdamW and the batch. ``cp=True`` (every rank of ``group``): dispatched tokens,
    attention "magi"; ``cp=False``: the whole row in one process, attention "ffa"."""

    def __init__(self, cfg: TrainConfig, cp: bool, group=None):
        self.cfg, self.cp, self.group = cfg, cp, group
        self.model = make_model(cfg, "magi" if cp else "ffa")
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr)
        cu, tokens, self.labels, positions = make_batch(cfg.seqlen, cfg.vocab, cfg.data_seed)
        self.key = None
        if cp:
            window = (cfg.sliding_window - 1, 0) if cfg.sliding_window else (-1, -1)
            self.key = md.magi_attn_varlen_key(
                cu,
                cu,
                cfg.heads,
                cfg.kv_heads,
                cfg.hidden // cfg.heads,
                group,
                causal=True,
                window_size=window,
                dist_attn_config=DistAttnConfig(
                    dispatch_config=DispatchConfig(chunk_size=cfg.chunk),
                    overlap_config=OverlapConfig(degree=cfg.degree),
                ),
            )
            tokens, positions = md.dispatch(tokens, self.key), md.dispatch(positions, self.key)
        self.tokens, self.positions = tokens[None], positions[None]

    def step(self) -> float:
        self.opt.zero_grad(set_to_none=True)
        kw = {"magi_key": self.key} if self.cp else {}
        logits = self.model(input_ids=self.tokens, position_ids=self.positions, use_cache=False, **kw).logits[
            0
        ]
        if self.cp:
            logits = md.undispatch(logits, self.key)  # (T, vocab) on every rank
        loss = F.cross_entropy(logits, self.labels)  # mean over the labelled tokens
        loss.backward()
        if self.cp:  # each rank holds its rows' share of every gradient
            params = [p for p in self.model.parameters() if p.grad is not None]
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat, group=self.group)
            at = 0
            for p in params:
                p.grad.copy_(flat[at : at + p.numel()].view_as(p.grad))
                at += p.numel()
        self.opt.step()
        return float(loss.detach())

    def flat_weights(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).double() for p in self.model.parameters()])


# ----------------------------------------------------------------------------- the script


def run(rank: int, world: int, cfg: TrainConfig, check: bool) -> dict:
    register()
    model = Trainer(cfg, cp=True)
    ref = Trainer(cfg, cp=False) if rank == 0 else None
    name = f"Mistral (window {cfg.sliding_window})" if cfg.sliding_window else "Llama"
    if rank == 0:
        print(f"{name}, {cfg.seqlen} packed tokens, cp={world}, {cfg.dtype}")
        print(f"step | loss (cp={world}, magi) | loss (1 process, ffa) | relative difference", flush=True)
    history = []
    for step in range(cfg.steps):
        row: dict = {"step": step, "loss": model.step()}
        if ref is not None:
            row["ref_loss"] = ref.step()
            row["rel_diff"] = abs(row["loss"] - row["ref_loss"]) / abs(row["ref_loss"])
            print(
                f"{step:4d} | {row['loss']:.8f} | {row['ref_loss']:.8f} | {row['rel_diff']:.2e}", flush=True
            )
        history.append(row)
    weights = model.flat_weights()
    same = weights.clone()
    dist.broadcast(same, src=0)
    failures = []
    if not torch.equal(weights, same):
        failures.append(f"rank {rank}: its final weights differ from rank 0's")
    if ref is not None:
        worst, tol = max(r["rel_diff"] for r in history), TOLERANCE[cfg.dtype]
        if worst > tol:
            failures.append(f"cp vs one process: max relative loss difference {worst:.2e} > {tol:.0e}")
        if not history[-1]["loss"] < history[0]["loss"]:
            failures.append(f"the loss did not go down: {history[0]['loss']} -> {history[-1]['loss']}")
    bad = torch.tensor([len(failures)])
    dist.all_reduce(bad, group=None)
    ok = int(bad.item()) == 0
    if check:
        for f in failures:
            print(f"CHECK FAILED: {f}", flush=True)
        if rank == 0:
            print(f"check: {'passed' if ok else 'FAILED'} (tolerance {TOLERANCE[cfg.dtype]:.0e})", flush=True)
    return {"history": history, "ok": ok, "dtype": cfg.dtype, "tolerance": TOLERANCE[cfg.dtype]}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--spawn", type=int, default=0, help="start this many CPU gloo ranks (instead of torchrun)"
    )
    d = TrainConfig()
    for f in dataclasses.fields(TrainConfig):
        ap.add_argument(
            "--" + f.name.replace("_", "-"), type=type(getattr(d, f.name)), default=getattr(d, f.name)
        )
    ap.add_argument(
        "--check", action="store_true", help="exit 1 unless cp matches one process (see TOLERANCE)"
    )
    ap.add_argument("--result", default=None, help="write rank 0's per-step history to this JSON file")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    if cfg.dtype not in TOLERANCE:
        raise ValueError(f"--dtype: expected one of {sorted(TOLERANCE)}, got {cfg.dtype!r}")
    if args.spawn:
        from magi_dist.testing import run_ranks

        # CPU gloo ranks started here (a rank that fails or hangs fails the run, with its stack)
        result = run_ranks(args.spawn, run, cfg, args.check, timeout=SPAWN_TIMEOUT_S)[0]
        rank = 0
    else:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        try:
            result = run(rank, dist.get_world_size(), cfg, args.check)
        finally:
            md.clear_cache()
            dist.destroy_process_group()
    if args.result and rank == 0:
        with open(args.result, "w") as f:
            json.dump(result, f)
    if args.check and not result["ok"]:
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()
