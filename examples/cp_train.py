"""Train a small transformer on packed documents with context parallelism (varlen causal).

    torchrun --nproc-per-node 4 examples/cp_train.py           # any backend torchrun sets up
    python examples/cp_train.py --spawn 4                      # CPU: starts 4 gloo ranks itself
    python examples/cp_train.py --spawn 4 --result out.json    # also writes rank 0's history
    torchrun --standalone --nproc-per-node 2 examples/cp_train.py \
        --dtype bfloat16 --steps 8 --seqlen 8192 --chunk 512 --check   # 2 GPUs: NCCL, bf16, checked

Every rank holds the same model; the packed token axis is dispatched over the cp group, each rank
runs the model on its chunks (attention through magi_dist.calc_attn, everything else is
per-token), the loss is the mean over all tokens and parameter gradients are summed over the
group. Rank 0 also trains an identical copy on the whole sequence in one process
(flex_flash_attn_func) and prints both loss curves, the largest gradient difference of each step
and, at the end, how far the final weights are apart.

``--dtype bfloat16`` keeps float32 weights and runs the model under ``torch.autocast`` in
bfloat16 (on Hopper GPUs the attention then runs on the CuTe kernels). ``--deterministic`` passes
``deterministic=True`` to both attentions. ``--check`` makes the run a test: the loss curve and
the final weights must match the single process within `Tolerance` (per dtype; ``--loss-tol`` /
``--weight-tol`` override), every rank must end with bitwise the same weights and, with
``--deterministic``, a second cp run must give bitwise the same weights on every rank; every
rank exits 1 otherwise.

The training code is importable (integration_tests/test_cp_training.py runs it on CPU gloo
ranks): `TrainConfig`, `Trainer` (a model, its optimizer and the batch; attention by cp over a
group or over the whole sequence in one process), `train`, `compare`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import magi_dist as md
from ffa_kernels import flex_flash_attn_func
from magi_solver import DispatchConfig, DistAttnConfig, OverlapConfig, masks
from magi_solver.cli import report

# --spawn: seconds before the started ranks count as hung (run_ranks kills them)
SPAWN_TIMEOUT_S = 900.0


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
        # q, k, v are in the compute dtype already (autocast's, under autocast): the attention
        # runs on them as they are, outside autocast, the same way in both runs
        with torch.autocast(x.device.type, enabled=False):
            o = attn(q, k.contiguous(), v.contiguous())
        return self.wo(o.reshape(t, -1))


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


# ----------------------------------------------------------------------------- training


@dataclass(frozen=True)
class TrainConfig:
    """One training run; the cp run and the single-process run of a comparison share it."""

    steps: int = 20
    seqlen: int = 2000
    chunk: int = 128
    degree: int = 2
    lr: float = 3e-3
    dtype: str = "float32"  # weights and compute; "bfloat16": float32 weights, bf16 autocast
    optimizer: str = "adamw"  # "adamw" | "sgd"
    deterministic: bool = False
    layers: int = 2
    dim: int = 32
    hq: int = 4
    hk: int = 2
    vocab: int = 64
    seed: int = 0  # the weights
    data_seed: int = 1  # the documents


DTYPES = ("float32", "float64", "bfloat16")


class Trainer:
    """A `TinyLM`, its optimizer and one packed batch (trained on every step).

    With ``cp=True`` (every rank of ``group``, None: the default group) the tokens are
    dispatched over the group and attention runs through ``magi_dist.calc_attn``; the loss is
    the group's mean and the gradients are summed over the group (one all-reduce per step). With
    ``cp=False`` one process runs the whole sequence through ``flex_flash_attn_func``.
    """

    def __init__(self, cfg: TrainConfig, device: torch.device, cp: bool, group=None):
        if cfg.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {DTYPES}, got {cfg.dtype!r}")
        self.cfg, self.device, self.cp, self.group = cfg, device, cp, group
        self.param_dtype = torch.float64 if cfg.dtype == "float64" else torch.float32
        self.amp = torch.bfloat16 if cfg.dtype == "bfloat16" else None
        cu, tokens, labels = make_batch(cfg.seqlen, cfg.vocab, seed=cfg.data_seed)
        positions = doc_positions(cu)
        torch.manual_seed(cfg.seed)
        model = TinyLM(cfg.vocab, cfg.dim, cfg.layers, cfg.hq, cfg.hk, max_pos=int(positions.max()) + 1)
        self.model = model.to(device=device, dtype=self.param_dtype)
        if cfg.optimizer == "adamw":
            self.opt: torch.optim.Optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr)
        elif cfg.optimizer == "sgd":
            self.opt = torch.optim.SGD(self.model.parameters(), lr=cfg.lr, momentum=0.9)
        else:
            raise ValueError(f"optimizer: expected 'adamw' or 'sgd', got {cfg.optimizer!r}")
        self.n_tokens = int((labels != -100).sum())
        self.cu = cu
        tokens, labels, positions = (x.to(device) for x in (tokens, labels, positions))
        d = cfg.dim // cfg.hq
        if cp:
            config = DistAttnConfig(
                dispatch_config=DispatchConfig(chunk_size=cfg.chunk),
                overlap_config=OverlapConfig(degree=cfg.degree),
            )
            self.key = md.magi_attn_varlen_key(
                cu, cu, cfg.hq, cfg.hk, d, group, causal=True, dist_attn_config=config
            )
            self.tokens = md.dispatch(tokens, self.key)
            self.labels = md.dispatch(labels, self.key, pad_value=-100)
            self.positions = md.dispatch(positions, self.key)
        else:
            self.key = None
            self.tokens, self.labels, self.positions = tokens, labels, positions
            mask = masks.varlen(cu, causal=True)
            self.ranges = tuple(torch.tensor(x, dtype=torch.int32, device=device) for x in mask.to_lists())

    def attn(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        det = self.cfg.deterministic
        if self.cp:
            return md.calc_attn(q, k, v, self.key, deterministic=det)[0]
        return flex_flash_attn_func(q, k, v, *self.ranges, deterministic=det)[0]

    def forward_backward(self) -> float:
        """Loss of the whole batch (the mean over its labelled tokens) and, in ``p.grad``, its
        gradients (summed over the group in cp)."""
        self.opt.zero_grad(set_to_none=True)
        amp = torch.autocast(self.device.type, dtype=self.amp) if self.amp else nullcontext()
        with amp:
            logits = self.model(self.tokens, self.positions, self.attn)
        logits = logits.to(self.param_dtype)
        loss = F.cross_entropy(logits, self.labels, ignore_index=-100, reduction="sum") / self.n_tokens
        loss.backward()
        if not self.cp:
            return float(loss.detach())
        params = list(self.model.parameters())
        # each rank holds its tokens' share of every gradient and of the loss: one all-reduce
        flat = torch.cat([*(p.grad.reshape(-1) for p in params), loss.detach().reshape(1)])
        dist.all_reduce(flat, group=self.group)
        at = 0
        for p in params:
            p.grad.copy_(flat[at : at + p.numel()].view_as(p.grad))
            at += p.numel()
        return float(flat[-1])

    def step(self) -> float:
        loss = self.forward_backward()
        self.opt.step()
        return loss

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().to("cpu", copy=True) for n, p in self.model.named_parameters()}

    def grads(self) -> dict[str, torch.Tensor]:
        return {n: p.grad.detach().to("cpu", copy=True) for n, p in self.model.named_parameters()}


def train(cfg: TrainConfig, cp: bool, device: torch.device | None = None, group=None) -> dict:
    """Train ``cfg.steps`` steps; ``{"losses": [...], "init": weights, "weights": final weights}``
    (weights on the CPU). In cp, every rank of ``group`` calls it."""
    trainer = Trainer(cfg, device or torch.device("cpu"), cp, group)
    init = trainer.weights()
    losses = [trainer.step() for _ in range(cfg.steps)]
    return {"losses": losses, "init": init, "weights": trainer.weights()}


def compare(run: dict, ref: dict) -> dict[str, float]:
    """How far the results of `train` ``run`` and ``ref`` are apart:

    * ``loss``: max over steps of ``|loss - ref loss| / |ref loss|``;
    * ``weight_abs``: max over every weight of ``|w - ref w|``;
    * ``weight_rel``: ``||w - ref w|| / ||ref w - w0||`` over all weights (2-norms): the
      difference against how far training moved the weights, scale-free across dtypes.
    """
    loss = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(run["losses"], ref["losses"]))
    flat = lambda ws: torch.cat([w.double().reshape(-1) for _, w in sorted(ws.items())])  # noqa: E731
    w, r, w0 = flat(run["weights"]), flat(ref["weights"]), flat(ref["init"])
    return {
        "loss": loss,
        "weight_abs": float((w - r).abs().max()),
        "weight_rel": float((w - r).norm() / (r - w0).norm().clamp_min(1e-300)),
    }


@dataclass(frozen=True)
class Tolerance:
    """cp against one process, per dtype (see `compare`). float64 and float32: the reference
    kernels on both sides, only the order of the float sums differs (the cp merge of stage
    partials by log-sum-exp, the dK/dV sums over ranks, the gradient all-reduce); the bounds are
    about 100x to 500x the differences measured on CPU (6 AdamW steps, 600 tokens,
    cp 2: float64 3e-16 and 2e-14, float32 1.2e-7 and 7.5e-6). bfloat16: the kernels round
    q/k/v, the output and the gradients to bf16 at other points in the two runs (staged cp partials
    merged in float32 vs one kernel call), which Adam's normalised steps carry into the weights;
    the bounds are for a few steps of the default model, chosen before a GPU measurement."""

    loss: float
    weight_rel: float

    @staticmethod
    def of(dtype: str) -> Tolerance:
        return {
            "float64": Tolerance(loss=1e-13, weight_rel=1e-11),
            "float32": Tolerance(loss=1e-5, weight_rel=1e-3),
            "bfloat16": Tolerance(loss=2e-2, weight_rel=0.1),
        }[dtype]


# ----------------------------------------------------------------------------- the script


def _same_on_every_rank(weights: dict[str, torch.Tensor], device: torch.device) -> bool:
    flat = torch.cat([w.reshape(-1).double() for _, w in sorted(weights.items())]).to(device)
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    same = torch.tensor([int(torch.equal(flat, ref))], device=device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item())


def run(rank: int, world: int, args: argparse.Namespace) -> dict:
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    cfg = config_from_args(args)
    model = Trainer(cfg, device, cp=True)
    ref = Trainer(cfg, device, cp=False) if rank == 0 else None
    init = model.weights()
    if rank == 0:
        print(report(md.get_runtime(model.key).plan, compare_algs=False), flush=True)
        print()
        print(f"step | loss (cp={world}) | loss (1 process) | max |grad diff|")

    history = []
    for step in range(cfg.steps):
        row = {"step": step, "loss": model.forward_backward()}
        if ref is not None:
            row["ref_loss"] = ref.forward_backward()
            grads, ref_grads = model.grads(), ref.grads()
            row["grad_diff"] = max(float((grads[n] - ref_grads[n]).abs().max()) for n in grads)
            ref.opt.step()
            print(
                f"{step:4d} | {row['loss']:.6f} | {row['ref_loss']:.6f} | {row['grad_diff']:.2e}", flush=True
            )
        model.opt.step()
        history.append(row)
    result: dict = {"history": history, "dtype": cfg.dtype}
    weights = model.weights()
    ok = True
    if ref is not None:
        diff = compare(
            {"losses": [r["loss"] for r in history], "weights": weights},
            {"losses": [r["ref_loss"] for r in history], "weights": ref.weights(), "init": init},
        )
        result["final"] = diff
        print(
            f"final weights: max |w - w_ref| = {diff['weight_abs']:.2e}, "
            f"||w - w_ref|| / ||w_ref - w0|| = {diff['weight_rel']:.2e}; "
            f"max relative loss difference {diff['loss']:.2e}",
            flush=True,
        )
    if args.check:
        tol = Tolerance.of(cfg.dtype)
        tol = Tolerance(args.loss_tol or tol.loss, args.weight_tol or tol.weight_rel)
        failures = []
        if ref is not None and not (diff["loss"] <= tol.loss and diff["weight_rel"] <= tol.weight_rel):
            failures.append(f"cp vs one process: {diff} beyond {tol}")
        if not _same_on_every_rank(weights, device):
            failures.append("the ranks' final weights differ")
        if cfg.deterministic:
            again = train(cfg, cp=True, device=device)["weights"]
            if not all(torch.equal(weights[n], again[n]) for n in weights):
                failures.append(f"rank {rank}: a second deterministic run gave other weights")
        bad = torch.tensor([len(failures)], device=device)
        dist.all_reduce(bad)
        for f in failures:
            print(f"CHECK FAILED: {f}", flush=True)
        ok = int(bad.item()) == 0
        if rank == 0:
            print(f"check: {'passed' if ok else 'FAILED'} (tolerance {tol})", flush=True)
    result["ok"] = ok
    return result


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in fields})


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--spawn", type=int, default=0, help="start this many CPU gloo ranks (instead of torchrun)"
    )
    d = TrainConfig()
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--seqlen", type=int, default=d.seqlen)
    ap.add_argument("--chunk", type=int, default=d.chunk)
    ap.add_argument("--degree", type=int, default=d.degree)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--dtype", default=d.dtype, choices=DTYPES)
    ap.add_argument("--optimizer", default=d.optimizer, choices=["adamw", "sgd"])
    ap.add_argument("--layers", type=int, default=d.layers)
    ap.add_argument("--dim", type=int, default=d.dim)
    ap.add_argument("--hq", type=int, default=d.hq)
    ap.add_argument("--hk", type=int, default=d.hk)
    ap.add_argument("--deterministic", action="store_true", help="calc_attn / FFA deterministic=True")
    ap.add_argument(
        "--check",
        action="store_true",
        help="exit 1 unless cp matches the single process within the tolerance, the ranks' weights "
        "are equal and (--deterministic) a second cp run is bitwise equal",
    )
    ap.add_argument("--loss-tol", type=float, default=0.0, help="--check's loss tolerance (0: per dtype)")
    ap.add_argument("--weight-tol", type=float, default=0.0, help="--check's weight tolerance (0: per dtype)")
    ap.add_argument("--result", default=None, help="write rank 0's per-step history to this JSON file")
    return ap.parse_args(argv)


def _write_result(result: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f)


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.spawn:
        from magi_dist.testing import run_ranks

        # CPU gloo ranks started here (a rank that fails or hangs fails the run, with its stack)
        result = run_ranks(args.spawn, run, args, timeout=SPAWN_TIMEOUT_S)[0]
        _write_result(result, args.result)
        if args.check and not result["ok"]:
            sys.exit(1)
        return result
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if args.deterministic:  # the rest of the model (embedding backward, ...) too
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
    dist.init_process_group(backend)
    try:
        result = run(dist.get_rank(), dist.get_world_size(), args)
        if dist.get_rank() == 0:
            _write_result(result, args.result)
    finally:
        dist.destroy_process_group()
    if args.check and not result["ok"]:
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()
