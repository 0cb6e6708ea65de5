"""``magi-plan``: plan a mask over ``cp_size`` ranks and report balance and traffic.

Examples::

    magi-plan --demo
    magi-plan --mask varlen --mask-args '{"cu_seqlens_q": [0, 3000, 8192], "causal": true}' --cp 4
    magi-plan --slices mask.json --cp 8 --degree dynamic --plot mask.png --json-out plan.json

A slices file holds ``{"q_ranges": [[s, e], ...], "k_ranges": [...], "mask_types": [...],
"total_seqlen_q": T, "total_seqlen_k": T}`` (types as codes 0..3 or strings).

A bad input (invalid JSON, a mask the builder rejects, ``--cp 0``, a config out of range, a
missing file) prints one line ``magi-plan: error: ...`` on stderr and exits with status 2, as
argparse does for a bad option; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable, Sequence

from pydantic import ValidationError

from magi_solver import masks
from magi_solver.config import DispatchConfig, DistAttnConfig, OverlapConfig
from magi_solver.dispatch import DispatchAlg, solve_dispatch
from magi_solver.plan import make_plan
from magi_solver.plan_models import DistAttnPlan
from magi_solver.types import AttnMask

BUILDERS: dict[str, Callable[..., AttnMask]] = {
    "varlen": masks.varlen,
    "full": masks.full,
    "causal": masks.causal,
    "sliding_window": masks.sliding_window,
    "from_segment_ids": masks.from_segment_ids,
    "block_causal": masks.block_causal,
    "prefix_lm": masks.prefix_lm,
    "shared_question": masks.shared_question,
}


def demo_mask(total: int = 65536, seed: int = 0) -> AttnMask:
    """Packed documents with long-tailed lengths (each at most a quarter of the total), causal."""
    rng = random.Random(seed)
    cu, pos = [0], 0
    while pos < total:
        n = min(total - pos, total // 4, max(64, int(rng.lognormvariate(7.5, 1.2))))
        pos += n
        cu.append(pos)
    return masks.varlen(cu, causal=True)


class CliError(Exception):
    """A bad input of the command line, reported as one line (``magi-plan: error: ...``)."""


def _load_json(text: str, what: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CliError(f"{what}: invalid JSON ({exc}): {_short(text)}") from exc


def _short(text: str, n: int = 80) -> str:
    text = " ".join(str(text).split())
    return repr(text if len(text) <= n else text[: n - 3] + "...")


def build_mask(args: argparse.Namespace) -> AttnMask:
    if args.demo:
        return demo_mask()
    if args.slices:
        try:
            with open(args.slices) as f:
                text = f.read()
        except OSError as exc:
            raise CliError(f"--slices: cannot read {args.slices!r}: {exc.strerror or exc}") from exc
        data = _load_json(text, f"--slices {args.slices}")
        if not isinstance(data, dict):
            raise CliError(
                f"--slices {args.slices}: expected a JSON object with q_ranges, k_ranges, mask_types, "
                f"total_seqlen_q, total_seqlen_k; got {type(data).__name__}"
            )
        return AttnMask(**data)
    if args.mask not in BUILDERS:
        raise CliError(f"--mask: unknown builder {args.mask!r}; one of {sorted(BUILDERS)}")
    kwargs = _load_json(args.mask_args, "--mask-args") if args.mask_args else {}
    if isinstance(kwargs, list):
        return BUILDERS[args.mask](*kwargs)
    if not isinstance(kwargs, dict):
        raise CliError(
            f"--mask-args: expected a JSON object (keyword args) or list (positional args), "
            f"got {type(kwargs).__name__} {_short(args.mask_args)}"
        )
    return BUILDERS[args.mask](**kwargs)


def error_line(exc: BaseException) -> str:
    """One line for ``exc``: pydantic's multi-line errors become ``field: message; ...``."""
    if isinstance(exc, ValidationError):
        parts = []
        for err in exc.errors():
            loc = ".".join(str(x) for x in err.get("loc", ()))
            msg = err.get("msg", "")
            if msg.startswith("Value error, "):
                msg = msg[len("Value error, ") :]
            elif "input" in err:
                msg += f", got {err['input']!r}"
            parts.append(f"{loc}: {msg}" if loc and not msg.startswith(loc + ":") else msg)
        text = "; ".join(parts)
    else:
        text = str(exc) or type(exc).__name__
        if isinstance(exc, TypeError):
            text = f"{type(exc).__name__}: {text}"
    return " ".join(text.split())


def report(plan: DistAttnPlan, compare_algs: bool = True) -> str:
    """Human-readable report: grid, per-rank area and traffic, and totals against ring/all-gather."""
    st = plan.stats
    m = plan.mask
    lines = [
        f"mask: {len(m)} slices, seqlen {m.total_seqlen_q}, area {m.area()} "
        f"({m.area() / max(1, m.total_seqlen_q * m.total_seqlen_k):.1%} of dense)",
        f"grid: cp {plan.cp_size}, chunk {plan.chunk_size}, {plan.num_chunks} chunks, "
        f"padded to {plan.padded_seqlen} (+{plan.pad_size}), {plan.shard_seqlen} tokens per rank",
        f"dispatch: {plan.config.dispatch_config.alg.value}, overlap degree {plan.overlap_degree} "
        f"({plan.config.overlap_config.mode.value})",
        "",
        "rank | chunks | area | area/mean | K/V rows received per stage | received | est. cost",
        "-----|--------|------|-----------|-----------------------------|----------|----------",
    ]
    mean = sum(st.area_per_rank) / plan.cp_size
    for r in plan.ranks:
        chunks = ",".join(map(str, r.host_chunks))
        if len(chunks) > 24:
            chunks = chunks[:21] + "..."
        lines.append(
            f"{r.rank:4d} | {chunks} | {r.area} | {r.area / mean if mean else 1.0:.3f} | "
            f"{st.recv_tokens_per_rank_stage[r.rank]} | {st.recv_tokens_per_rank[r.rank]} | {r.estimated_cost:.3g}"
        )
    ring = sum(st.ring_tokens_per_rank)
    total = st.total_recv_tokens
    lines += [
        "",
        f"imbalance (max/mean area): {st.imbalance:.4f}",
        f"K/V rows moved: {total} in all (max {max(st.recv_tokens_per_rank)} per rank); "
        f"ring attention {ring} ({total / ring if ring else 0:.1%} of it), all-gather "
        f"{sum(st.allgather_tokens_per_rank)}",
    ]
    if compare_algs:
        lines.append(
            "dispatch algorithms on this grid (imbalance max/mean): "
            + ", ".join(
                f"{alg.value} {solve_dispatch(plan.chunk_workloads, plan.cp_size, alg).imbalance:.4f}"
                for alg in DispatchAlg
            )
        )
    return "\n".join(lines)


def plot(plan: DistAttnPlan, path: str) -> None:
    """Draw the mask, each cell coloured by the rank that computes it (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Polygon
    except ImportError:
        raise CliError("--plot needs matplotlib: pip install 'magi-solver[plot]'") from None
    cmap = plt.get_cmap("tab20" if plan.cp_size > 10 else "tab10")
    fig, ax = plt.subplots(figsize=(7, 7))
    cs = plan.chunk_size
    bands = plan.mask.bands()
    for r in plan.ranks:
        for c in r.host_chunks:
            for b in bands:
                piece = b.clip_rows(c * cs, (c + 1) * cs)
                for qs, qe, ks, ke, t in piece.to_slices():
                    sub = type(b).from_slice(qs, qe, ks, ke, t)
                    top, bot = sub.row_span(qs), sub.row_span(qe - 1)
                    pts = [(top[0], qs), (top[1], qs), (bot[1], qe), (bot[0], qe)]
                    ax.add_patch(Polygon(pts, closed=True, color=cmap(r.rank % cmap.N), lw=0))
    ax.set_xlim(0, plan.mask.total_seqlen_k)
    ax.set_ylim(plan.padded_seqlen, 0)
    ax.set_xlabel("key token")
    ax.set_ylabel("query token")
    ax.set_title(f"mask coloured by rank (cp {plan.cp_size}, imbalance {plan.stats.imbalance:.3f})")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="magi-plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--demo", action="store_true", help="a built-in 64k-token varlen-causal mask, cp 8")
    src.add_argument("--mask", help=f"builder name: {', '.join(sorted(BUILDERS))}")
    src.add_argument("--slices", help="JSON file of slices")
    ap.add_argument("--mask-args", help="JSON object (keyword args) or list (positional args) of the builder")
    ap.add_argument("--cp", type=int, default=None, help="cp_size (default 8 for --demo, else required)")
    ap.add_argument("--chunk-size", type=int, default=None)
    ap.add_argument("--dispatch-alg", choices=[a.value for a in DispatchAlg], default="min_heap")
    ap.add_argument("--degree", default="1", help="overlap degree (0 = none) or 'dynamic'")
    ap.add_argument("--min-chunk-size", type=int, default=None)
    ap.add_argument("--plot", help="write a PNG of the mask coloured by owning rank")
    ap.add_argument("--json-out", help="write the plan as JSON")
    ap.add_argument("--debug", action="store_true", help="show the traceback of an error")
    args = ap.parse_args(argv)

    cp = args.cp if args.cp is not None else (8 if args.demo else None)
    if cp is None:
        ap.error("--cp is required")
    try:
        return _run(args, cp)
    except (CliError, ValueError, TypeError, OSError) as exc:
        # ValueError covers json errors and pydantic's ValidationError; TypeError a builder called
        # with wrong arguments; OSError an output file that cannot be written.
        if args.debug:
            raise
        ap.exit(2, f"{ap.prog}: error: {error_line(exc)}\n")


def _run(args: argparse.Namespace, cp: int) -> int:
    if cp < 1:
        raise CliError(f"--cp: must be >= 1, got {cp}")
    mask = build_mask(args)
    dispatch = {"alg": args.dispatch_alg}
    if args.chunk_size is not None:
        dispatch["chunk_size"] = args.chunk_size
    if args.degree == "dynamic":
        overlap: dict = {"mode": "dynamic", "degree": None}
    else:
        try:
            overlap = {"degree": int(args.degree)}
        except ValueError:
            raise CliError(f"--degree: expected an int >= 0 or 'dynamic', got {args.degree!r}") from None
    if args.min_chunk_size is not None:
        overlap["min_chunk_size"] = args.min_chunk_size
    config = DistAttnConfig(
        dispatch_config=DispatchConfig(**dispatch), overlap_config=OverlapConfig(**overlap)
    )
    plan = make_plan(mask, cp, config)
    print(report(plan))
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(plan.model_dump_json())
        print(f"plan written to {args.json_out}")
    if args.plot:
        plot(plan, args.plot)
        print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
