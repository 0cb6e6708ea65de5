"""The backward's partial ``[dK, dV]`` buffers: where they live and for how long.

Each remote stage of ``attn._backward`` writes a float32 ``[dK, dV]`` buffer for the K/V rows it
received, then group-reduces it to the rows' owners. With a backend that has symmetric outputs
(``GroupCollective.symmetric_outputs``: magi_comm's ``native``) the buffer is taken from a
symmetric output, so that receivers of the fused reduction read the rows where they lie (pull,
``packages/magi-comm/docs/native.md``) instead of the sender copying them into their receive
regions. With any other backend (a2av) it is ``torch.zeros``, as before.

Lifetime, and why it is safe:

* **Same allocations on every rank.** ``empty_output`` / ``free_output`` are collectives whose
  slot must agree on every rank. The buffers are held in a pool per ``GroupCollective`` (not per
  ``DistAttnRuntime``: the runtime cache is per rank and may differ between ranks, see
  ``runtime.py``, so a pool tied to it would allocate on one rank and not on another), slot ``i``
  serving the ``i``-th group-reduce of a backward call. Whether a slot is (re)allocated, and its
  size, depend only on the most rows any rank's buffer ``i`` has in this call
  (``DistAttnRuntime.partial_rows``, the same on every rank), the row size and dtype (the same
  on every rank: the group-reduce needs that anyway), the pool's state (the same on every rank
  by induction: every rank makes the same backward calls in the same order, or the group's
  collectives would not match) and ``$MAGI_DIST_SYMMETRIC_PARTIALS_MB`` (must be set alike on
  every rank, like the other ``MAGI_*`` settings). A rank without remote rows in a stage
  allocates the same slot as its peers. Nothing here depends on this rank's own rows.
* **Reuse across calls.** The pull protocol (native.md, "Pull", step 4) has a sender whose input
  was read in place wait, in its own fused reduction's end step on the group stream, for every
  receiver's ``DONE``; the reduce's ``work.wait()`` orders the caller's stream after that. So
  once the backward's reduces are waited, work enqueued later on the caller's stream (the next
  call's ``zero_``, the next stage kernel) runs after every peer finished reading. The host may
  return from ``wait()`` while a peer still pulls (wait only orders streams), so ordering is
  what matters: the last user's stream records an event the next call's stream waits for
  (backwards of two calls may run on different streams).
* **Growth and freeing.** A slot that is too small is freed (``free_output``: a barrier after a
  device synchronization, so every transfer of every rank is over) and allocated again, larger,
  before any collective of the call, in slot order, on every rank alike. The pool is never
  freed piecemeal otherwise: the native backend frees the outputs when the group's last handle
  closes (``close_default_collectives``), or :func:`free_partials` (collective) releases them.
* **Bounded.** The pool holds at most ``$MAGI_DIST_SYMMETRIC_PARTIALS_MB`` (default 0: off, see
  DEFAULT_SYMMETRIC_MB; the degree-0 buffer holds the local rows too: at cp 2, 64k tokens, Hk 8,
  D 128 those alone are 256 MiB, the whole buffer 440-512 MiB on the largest rank, so 256 serves
  only smaller calls) of
  the symmetric heap, whose size NVSHMEM fixes at init (``NVSHMEM_SYMMETRIC_SIZE``, by default
  max(1 GiB, 4 x the native receive buffer of 256 MiB, and an eighth of the GPU's memory with
  NVSHMEM's on-demand VMM heap)); a buffer that does not fit is a plain
  tensor for that call (its rows are sent, as with ``torch.zeros``), decided alike everywhere.
* **No aliasing.** The degree-0 buffer holds the local rows' gradients too; they are copied (or
  summed with the owners' sums) into fresh tensors rather than returned as views of the pooled
  buffer, before :meth:`Partials.done` lets the next call reuse it (``attn._backward``).
"""

from __future__ import annotations

import os
import threading
import weakref

import torch
import torch.distributed as dist

from magi_comm import GroupCollective, get_group_collective
from magi_dist.runtime import DistAttnRuntime

__all__ = ["DEFAULT_SYMMETRIC_MB", "ENV_SYMMETRIC_MB", "Partials", "free_partials", "symmetric_budget"]

ENV_SYMMETRIC_MB = "MAGI_DIST_SYMMETRIC_PARTIALS_MB"
# Off until a run on 2 GPUs has checked the path against real NVSHMEM (tools/gpu_multi.sh; the fake
# world and the Triton interpreter check it on the CPU): set 256 (MiB) to turn it on.
DEFAULT_SYMMETRIC_MB = 0.0
_MIB = 1 << 20
_GRAIN = 1 << 16  # bytes; slot sizes are rounded up to this
_HEADROOM = 1.25  # a slot that grows takes this much more than it was, so that growth is rare


def symmetric_budget() -> int:
    """Bytes of symmetric memory the pool may hold (``$MAGI_DIST_SYMMETRIC_PARTIALS_MB``; 0: no
    symmetric partial buffers)."""
    raw = os.environ.get(ENV_SYMMETRIC_MB, "").strip()
    if not raw:
        return int(DEFAULT_SYMMETRIC_MB * _MIB)
    try:
        mb = float(raw)
    except ValueError:
        mb = -1.0
    if not mb >= 0:  # also NaN
        raise ValueError(f"${ENV_SYMMETRIC_MB}: expected a number of MiB >= 0, got {raw!r}")
    return int(mb * _MIB)


def _round_up(nbytes: int) -> int:
    return -(-nbytes // _GRAIN) * _GRAIN


class _Pool:
    """One collective's symmetric partial buffers: slot ``i`` (a flat uint8 symmetric output, or
    None) serves the ``i``-th group-reduce of a backward call. Holds no reference to its
    collective (the registry's keys are weak)."""

    def __init__(self) -> None:
        self.slots: list[torch.Tensor | None] = []
        self.event: torch.cuda.Event | None = None  # the last call's stream is done with the slots

    def held(self) -> int:
        return sum(t.numel() for t in self.slots if t is not None)

    def take(self, gc: GroupCollective, need: tuple[int, ...], budget: int) -> list[torch.Tensor | None]:
        """Per slot a symmetric buffer of at least ``need[i]`` bytes, or None (a plain tensor for
        this call). Collective where a slot grows; ``need`` and ``budget`` are the same on every
        rank, so every rank frees and allocates the same slots in the same order."""
        self.slots += [None] * (len(need) - len(self.slots))
        out: list[torch.Tensor | None] = []
        for i, nbytes in enumerate(need):
            have = self.slots[i]
            cap = 0 if have is None else have.numel()
            if nbytes <= cap:
                out.append(have)  # None when no rank has rows here and nothing was held
                continue
            room = budget - (self.held() - cap)
            if nbytes > room:
                out.append(None)  # keep what the slot holds: it serves later, smaller calls
                continue
            size = min(room, _round_up(max(nbytes, int(cap * _HEADROOM))))
            if have is not None:
                self.slots[i] = None
                gc.free_output(have)  # collective: every rank's transfers are over first
            with torch.inference_mode(False):  # a normal tensor, whatever mode the caller is in
                self.slots[i] = gc.empty_output((size,), torch.uint8)
            out.append(self.slots[i])
        return out


_POOLS: weakref.WeakKeyDictionary[GroupCollective, _Pool] = weakref.WeakKeyDictionary()
_POOLS_LOCK = threading.Lock()


def _pool(gc: GroupCollective) -> _Pool:
    with _POOLS_LOCK:
        pool = _POOLS.get(gc)
        if pool is None:
            pool = _POOLS[gc] = _Pool()
        return pool


class Partials:
    """The partial ``[dK, dV]`` buffers of one backward call (``rows`` per group-reduce, this
    rank's, of ``row_shape`` and ``dtype``). Take them with :meth:`take` before the call's first
    collective, and call :meth:`done` once every reduce from them is waited."""

    def __init__(self, row_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.row_shape = row_shape
        self.dtype = dtype
        self.device = device
        self.slots: list[torch.Tensor | None] = []
        self._pool: _Pool | None = None

    @classmethod
    def take(
        cls,
        rt: DistAttnRuntime,
        row_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        reduce_dtype: torch.dtype | None = None,
    ) -> Partials:
        """This call's buffers: symmetric ones from the pool of ``rt``'s group collective when its
        backend has symmetric outputs and the budget allows (collective then, on every rank
        alike; see the module docstring), else plain tensors. ``reduce_dtype`` (default
        ``dtype``): what the reduces send; another dtype than the buffers' means they are cast
        before they travel, so the pool, whose point is that receivers read the buffers in place,
        is not used."""
        parts = cls(row_shape, dtype, device)
        gc = get_group_collective(rt.group)
        reduce_dtype = reduce_dtype or dtype
        rb = torch.Size(row_shape).numel() * reduce_dtype.itemsize
        pooled = gc.symmetric_outputs and reduce_dtype == dtype  # a2av: plain tensors
        budget = symmetric_budget() if pooled else 0
        if budget:
            most = rt.partial_rows()  # not this rank's rows: every rank must decide alike
            pool = parts._pool = _pool(gc)
            if pool.event is not None:  # the last call's stream is done with the slots
                torch.cuda.current_stream(device).wait_event(pool.event)
            parts.slots = pool.take(gc, tuple(r * rb for r in most), budget)
        # room for the reduces' rows from any one rank in one round (the plan's most, the same
        # on every rank): the native backend's fused reduction takes only one-round calls, and
        # its staged path cost cp 4 varlen causal 64k ~0.9 ms of a 12.3 ms step (docs/perf.md).
        # After the pool's slots: the backend keeps its buffer's growth within what the
        # symmetric heap has left.
        gc.reserve_rows(rt.max_pair_rows(), rb)
        return parts

    def symmetric(self, i: int) -> bool:
        """Whether buffer ``i`` lies in a symmetric output (receivers may pull its rows)."""
        return i < len(self.slots) and self.slots[i] is not None

    def zeros(self, i: int, rows: int) -> torch.Tensor:
        """Buffer ``i``, ``(rows, *row_shape)``, zeroed (on the caller's stream)."""
        flat = self.slots[i] if i < len(self.slots) else None
        shape = (rows, *self.row_shape)
        if flat is None:
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        nbytes = torch.Size(shape).numel() * self.dtype.itemsize
        return flat[:nbytes].view(self.dtype).view(shape).zero_()

    def done(self) -> None:
        """Every reduce from the buffers is waited and their rows read: the next call may reuse
        them once its stream reaches this point."""
        if self._pool is None or self.device.type != "cuda":
            return
        if self._pool.event is None:
            self._pool.event = torch.cuda.Event()
        self._pool.event.record(torch.cuda.current_stream(self.device))


def free_partials(group=None) -> None:
    """Collective over ``group`` (None: the default group): free the symmetric partial buffers
    that ``calc_attn``'s backward keeps for the group (they are also freed when its collective
    closes: ``magi_comm.close_default_collectives``). Every rank calls it at the same point,
    between backward calls; a no-op where there are none (a2av)."""
    g = dist.group.WORLD if group is None else group
    with _POOLS_LOCK:
        found = [(gc, pool) for gc, pool in _POOLS.items() if gc.group is g]
        for gc, _ in found:
            del _POOLS[gc]
    for gc, pool in found:
        slots, pool.slots = pool.slots, []
        if gc.closed:  # its backend freed them
            continue
        for t in slots:
            if t is not None:
                gc.free_output(t)
