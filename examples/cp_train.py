"""Train a small transformer on packed documents with context parallelism (varlen causal).

    torchrun --nproc-per-node 4 examples/cp_train.py           # any backend torchrun sets up
    python examples/cp_train.py --spawn 4                      # CPU: starts 4 gloo ranks itself
    python examples/cp_train.py --spawn 4 --result out.json    # also writes rank 0's history

Every rank holds the same model; the packed token axis is dispatched over the cp group, each rank
runs the model on its chunks (attention through magi_dist.calc_attn, everything else is
per-token), the loss is the mean over all tokens and parameter gradients are summed over the
group. Rank 0 also trains an identical copy on the whole sequence in one process
(flex_flash_attn_func) and prints both loss curves and the largest gradient difference.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import random
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import magi_dist as md
from ffa_kernels import flex_flash_attn_func
from magi_solver import DispatchConfig, DistAttnConfig, OverlapConfig, masks
from magi_solver.cli import report


class Attention(nn.Module):
    def __init__(self, dim: int, hq: int, hk: int):
        super().__init__()
        self.hq, self.hk, self.d = hq, hk, dim // hq
        self.wq = nn.Linear(dim, hq * self.d, bias=False)
        self.wkv = nn.Linear(dim, 2 * hk * self.d, bias=False)
        self.wo = nn.Linear(hq * self.d, dim, bias=False)

    def forward(self, x: torch.Tensor, attn) -> torch.Tensor:
        t = x.shape[0]
        q = self.wq(x).view(t, self.hq, self.d)
        k, v = self.wkv(x).view(t, 2, self.hk, self.d).unbind(1)
        return self.wo(attn(q, k.contiguous(), v.contiguous()).reshape(t, -1))


class Block(nn.Module):
    def __init__(self, dim: int, hq: int, hk: int):
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn = Attention(dim, hq, hk)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, attn):
        x = x + self.attn(self.n1(x), attn)
        return x + self.mlp(self.n2(x))


class TinyLM(nn.Module):
    """Token + within-document position embeddings, a few blocks, a tied LM head."""

    def __init__(self, vocab=64, dim=32, layers=2, hq=4, hk=2, max_pos=512):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_pos, dim)
        self.blocks = nn.ModuleList(Block(dim, hq, hk) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        nn.init.normal_(self.tok.weight, std=0.1)  # tied head: keep the first logits small
        nn.init.normal_(self.pos.weight, std=0.1)

    def forward(self, tokens, positions, attn):
        x = self.tok(tokens) + self.pos(positions)
        for b in self.blocks:
            x = b(x, attn)
        return self.norm(x) @ self.tok.weight.T


def make_batch(total: int, vocab: int, seed: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Packed documents (long-tailed lengths); each is an arithmetic sequence mod vocab, so the
    next token is learnable from context. Returns cu_seqlens, tokens and labels (-100 at ends)."""
    rng = random.Random(seed)
    cu = [0]
    while cu[-1] < total:
        cu.append(min(total, cu[-1] + max(4, int(rng.lognormvariate(3.5, 0.8)))))
    tokens, labels = [], []
    for s, e in zip(cu, cu[1:]):
        start, step = rng.randrange(vocab), rng.randrange(1, 5)
        seq = [(start + i * step) % vocab for i in range(e - s)]
        tokens += seq
        labels += [*seq[1:], -100]
    return cu, torch.tensor(tokens), torch.tensor(labels)


def doc_positions(cu: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(e - s) for s, e in zip(cu, cu[1:])])


def run(rank: int, world: int, args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    model = TinyLM().to(device=device, dtype=dtype)
    ref = copy.deepcopy(model) if rank == 0 else None
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=args.lr) if ref is not None else None

    cu, tokens, labels = make_batch(args.seqlen, 64, seed=1)
    tokens, labels, positions = tokens.to(device), labels.to(device), doc_positions(cu).to(device)
    config = DistAttnConfig(
        dispatch_config=DispatchConfig(chunk_size=args.chunk),
        overlap_config=OverlapConfig(degree=args.degree),
    )
    hq, hk = model.blocks[0].attn.hq, model.blocks[0].attn.hk
    d = model.blocks[0].attn.d
    key = md.magi_attn_varlen_key(cu, cu, hq, hk, d, None, causal=True, dist_attn_config=config)
    if rank == 0:
        print(report(md.get_runtime(key).plan, compare_algs=False), flush=True)
        print()
        print(f"step | loss (cp={world}) | loss (1 process) | max |grad diff|")

    local_tokens = md.dispatch(tokens, key)
    local_labels = md.dispatch(labels, key, pad_value=-100)
    local_pos = md.dispatch(positions, key)
    n_tokens = int((labels != -100).sum())
    mask = masks.varlen(cu, causal=True)
    qr, kr, ts = (torch.tensor(x, dtype=torch.int32, device=device) for x in mask.to_lists())

    def cp_attn(q, k, v):
        return md.calc_attn(q, k, v, key)[0]

    def full_attn(q, k, v):
        return flex_flash_attn_func(q, k, v, qr, kr, ts)[0]

    history = []
    for step in range(args.steps):
        opt.zero_grad()
        logits = model(local_tokens, local_pos, cp_attn)
        loss = F.cross_entropy(logits, local_labels, ignore_index=-100, reduction="sum") / n_tokens
        loss.backward()
        for p in model.parameters():  # each rank holds its tokens' share of every gradient
            dist.all_reduce(p.grad)
        total = loss.detach().clone()
        dist.all_reduce(total)
        row = {"step": step, "loss": float(total)}
        if ref is not None:
            ref_opt.zero_grad()
            ref_loss = F.cross_entropy(ref(tokens, positions, full_attn), labels, ignore_index=-100)
            ref_loss.backward()
            diff = max(
                float((p.grad - r.grad).abs().max()) for p, r in zip(model.parameters(), ref.parameters())
            )
            row.update(ref_loss=float(ref_loss.detach()), grad_diff=diff)
            ref_opt.step()
            print(f"{step:4d} | {row['loss']:.6f} | {row['ref_loss']:.6f} | {diff:.2e}", flush=True)
        opt.step()
        history.append(row)
    return {"history": history}


def _spawned(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    try:
        result = run(rank, world, args)
        if rank == 0:
            torch.save(result, out)
        dist.barrier()  # leave together (see magi_dist.testing)
    finally:
        from magi_comm import close_default_collectives

        md.clear_cache()
        close_default_collectives()
        dist.destroy_process_group()


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--spawn", type=int, default=0, help="start this many CPU gloo ranks (instead of torchrun)"
    )
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seqlen", type=int, default=2000)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--degree", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--result", default=None, help="write rank 0's per-step history to this JSON file")
    return ap.parse_args(argv)


def _write_result(result: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f)


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.spawn:
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.pt")
            mp.spawn(_spawned, args=(args.spawn, os.path.join(tmp, "store"), args, out), nprocs=args.spawn)
            result = torch.load(out)
        _write_result(result, args.result)
        return result
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    try:
        result = run(dist.get_rank(), dist.get_world_size(), args)
        if dist.get_rank() == 0:
            _write_result(result, args.result)
        return result
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
