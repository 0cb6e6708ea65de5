"""Random masks for tests and experiments (pure python; seed a ``random.Random``)."""

from __future__ import annotations

import random

from magi_solver.band import Band
from magi_solver.types import AttnMask


def random_mask(
    rng: random.Random, seqlen_q: int, seqlen_k: int | None = None, max_slices: int = 8, max_tries: int = 64
) -> AttnMask:
    """A mask of up to ``max_slices`` random slices of all four types, disjoint in cells (slices may
    share q rows and k columns), with ``sq != sk`` in general and possibly empty rows."""
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    want = rng.randint(1, max_slices)
    q, k, t, bands = [], [], [], []
    for _ in range(max_tries):
        if len(q) == want or seqlen_q == 0 or seqlen_k == 0:
            break
        qs = rng.randrange(seqlen_q)
        qe = rng.randint(qs + 1, seqlen_q)
        ks = rng.randrange(seqlen_k)
        ke = rng.randint(ks + 1, seqlen_k)
        typ = rng.randrange(4)
        b = Band.from_slice(qs, qe, ks, ke, typ)
        if any(not b.intersect(o).is_empty() for o in bands):
            continue
        bands.append(b)
        q.append((qs, qe))
        k.append((ks, ke))
        t.append(typ)
    return AttnMask(q, k, t, seqlen_q, seqlen_k)
