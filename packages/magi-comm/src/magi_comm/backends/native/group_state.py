"""What one group's native backends share: symmetric buffers, signals, streams, per-pair counters.

Nothing here is allocated per call. The buffers and why each exists:
``packages/magi-comm/docs/native.md`` ("Buffers", "Signals").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .config import ENV_BUFFER_MB, MIB, NativeConfig
from .layout import grown_capacity, row_bytes
from .outputs import SymmetricOutputs
from .protocol import ARM, MAX_REPORTING_PROGRAMS, NUM_SIGNALS, PULL_ACCEPT, Handshake
from .runtime import Runtime, peer_view

__all__ = ["GroupState", "PairCounters", "host_to_device"]

logger = logging.getLogger(__name__)


@dataclass
class PairCounters:
    """What this rank counted per peer; both ends of a pair count alike without talking, so a
    waiter knows which count to wait for (docs/native.md, "Signals").

    Attributes:
        sent: transfers this rank made to each peer (the peer's ``READY`` count of us).
        recvd: transfers this rank consumed from each peer (our ``READY`` count of it).
        arms_seen: calls in which this rank waited for each destination's arm.
        arms_made: calls in which this rank armed each source: the pair's epoch.
        acks_seen: between-round acknowledgements awaited from each destination.
        map_sent: token of the map this rank last put to each source (-1: none yet).
        accept_sent: accept word this rank last put to each source (-1: none yet).
        arm_known: per destination, whether its arm need not be awaited before this rank's
            next call to it publishes: the last call to it was a pulled one launch, which
            awaited its ``DONE`` (docs/native.md, "The arm known").
        map_tokens: maps built so far (each gets the next token).
    """

    sent: list[int]
    recvd: list[int]
    arms_seen: list[int]
    arms_made: list[int]
    acks_seen: list[int]
    map_sent: list[int]
    accept_sent: list[int]
    arm_known: list[bool]
    map_tokens: int = 0

    @staticmethod
    def zero(world: int) -> PairCounters:
        """Counters of a fresh group of ``world`` ranks."""
        zeros = [0] * world
        return PairCounters(
            zeros[:], zeros[:], zeros[:], zeros[:], zeros[:], [-1] * world, [-1] * world, [False] * world
        )


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host table -> device without blocking the host on the stream (pinned, non_blocking)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class GroupState:
    """Symmetric buffers, signals, streams and counters shared by one group's backends.

    Attributes (the ones the other modules read):
        stream / side: the group stream every transfer runs on, and the stream a receive step
            runs on beside the send kernel; ``armed_event`` / ``consumed_event`` order them.
        counts: :class:`PairCounters`.
        buf / capacity / peers / peer_addr: the symmetric receive buffer, its size, its
            NVLink views of every peer's buffer and their addresses.
        sig / sig_peers / handshake: this rank's int64 ``(NUM_SIGNALS, W)`` signal array, the
            device table of every peer's, and what a kernel needs to signal and wait.
        maps / map_width: the direct-mode map area ``(W, map_width)``: row ``d`` is where
            destination ``d`` puts its output map for our sends.
        accepts / pull_maps / pull_peers / pull_decided: the pull protocol's accept words,
            pull-map area ``(W, map_width)``, its peers' addresses and the last reduce send's
            decision per destination (``2 * epoch + pulled``).
        outputs: :class:`~.outputs.SymmetricOutputs`.
        fence_addr / reduce_counter / progress_cnt: local words the kernels' system-scope
            releases and finished-program counters use.
    """

    def __init__(self, rt: Runtime, config: NativeConfig) -> None:
        self.rt = rt
        self.cuda = rt.platform.cuda
        self.rank, self.world = rt.rank, rt.world
        self.config = config
        self.refcount = 0
        # on 2 ranks: every backend of the group takes the fused reduction alike on both ranks
        # (NativeBackend._agree_on_fused_reduce; ReducePath.one_launch reads it)
        self.fused_alike = False
        self.device = rt.platform.device(rt.device)
        self.stream = self.cuda.Stream(self.device, priority=config.stream_priority)
        W = self.world
        self.counts = PairCounters.zero(W)
        self.scratch: dict[str, torch.Tensor] = {}
        # target of the copy kernel's system-scope release (see kernels/copy.py)
        self.fence = torch.zeros(16, dtype=torch.int32, device=self.device)
        self.fence_addr = self.fence.data_ptr()
        nvc = rt.nvc
        self.sig = nvc.tensor((NUM_SIGNALS * W,), dtype=torch.int64)
        self.sig.zero_()
        # The kernels' handshake: every peer's signal array, and a counter of finished programs
        # (a slot of the fence tensor the plain copies do not touch).
        sig_peers = [peer_view(nvc, self.sig, self.rank, pe).data_ptr() for pe in range(W)]
        self.sig_peers = torch.tensor(sig_peers, dtype=torch.int64).to(self.device)
        self.handshake = Handshake(
            self.sig.data_ptr(), self.sig_peers.data_ptr(), self.fence_addr + 32, self.rank
        )
        # the fused reduction's finished programs (its own slot: it may run beside a copy)
        self.reduce_counter = self.fence_addr + 48
        self.arm_launch = None  # a launch without rows that only arms and waits (built on first use)
        # Overlap: the send kernel's done words (one per program), and the stream the receive
        # step runs on beside it (events reused: a wait takes the event's state when it is enqueued).
        self.progress_cnt = torch.zeros(MAX_REPORTING_PROGRAMS, dtype=torch.int32, device=self.device)
        self.side = self.cuda.Stream(self.device, priority=config.stream_priority)
        self.armed_event = self.cuda.Event()
        self.consumed_event = self.cuda.Event()
        self._init_maps(nvc, config)
        self.outputs = SymmetricOutputs(nvc, self.rank, W, self.device, config.max_outputs, self._barrier)
        self.capacity = 0
        self.buf: torch.Tensor | None = None
        self.peers: list[torch.Tensor] = []
        self.peer_addr: list[int] = []
        self._allocate(config.aligned_buffer_bytes())

    def _init_maps(self, nvc, config: NativeConfig) -> None:
        """The symmetric map areas of direct mode and pull, and the words an arm puts."""
        W = self.world
        self.map_width = 1 + config.map_entries
        self.maps = nvc.tensor((W * self.map_width,), dtype=torch.int64)
        self.maps.zero_()
        # what an arm puts for "rows through my region": header 0 of a cast, accept word 0
        self.zero_word = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.accepts = nvc.tensor((W,), dtype=torch.int64)
        self.accepts.zero_()
        self.pull_maps = nvc.tensor((W * self.map_width,), dtype=torch.int64)
        self.pull_maps.zero_()
        pull_peers = [peer_view(nvc, self.pull_maps, self.rank, pe).data_ptr() for pe in range(W)]
        self.pull_peers = torch.tensor(pull_peers, dtype=torch.int64).to(self.device)
        self.accept_word = torch.tensor([PULL_ACCEPT], dtype=torch.int64).to(self.device)
        self.pull_decided = torch.zeros(W, dtype=torch.int64, device=self.device)

    # -- symmetric memory -------------------------------------------------------------------

    def _barrier(self) -> None:
        """Collective, host-blocking; only at setup, growth and teardown."""
        self.cuda.synchronize(self.device)
        self.rt.nvb.barrier_all_on_stream(self.stream.cuda_stream)
        self.stream.synchronize()

    def _allocate(self, nbytes: int) -> None:
        nvc = self.rt.nvc
        self.buf = nvc.tensor((nbytes,), dtype=torch.uint8)
        self.capacity = nbytes
        self.peers = [peer_view(nvc, self.buf, self.rank, pe) for pe in range(self.world)]
        self.peer_addr = [t.data_ptr() for t in self.peers]
        self._barrier()  # zeroed signals and the new buffer are visible everywhere before use

    def _free_buffer(self) -> None:
        self._barrier()  # every rank finished every transfer into every buffer
        self.peers, self.peer_addr = [], []
        buf, self.buf = self.buf, None
        if buf is not None:
            self.rt.nvc.free_tensor(buf)
        self.capacity = 0

    def grow(self, needed: int, to: int | None = None) -> None:
        """Collective: replace the receive buffer by one of ``to`` bytes (at least ``needed``;
        None: :func:`~.layout.grown_capacity`'s policy)."""
        new = grown_capacity(self.capacity, needed, factor=self.config.growth_factor) if to is None else to
        assert new >= needed, (new, needed)
        logger.warning(
            "magi_comm native: growing the symmetric receive buffer from %.1f MiB to %.1f MiB "
            "(needed %d bytes); set $%s to avoid this",
            self.capacity / MIB,
            new / MIB,
            needed,
            ENV_BUFFER_MB,
        )
        self._free_buffer()
        self._allocate(new)

    def close(self) -> None:
        """Collective: free the outputs, the receive buffer and the symmetric areas."""
        self.outputs.close()
        self._free_buffer()
        for name in ("sig", "maps", "accepts", "pull_maps"):
            t = getattr(self, name)
            setattr(self, name, None)
            if t is not None:
                self.rt.nvc.free_tensor(t)
        self.scratch.clear()

    def on_stream(self, stream=None):
        """Context: torch ops enqueue on ``stream`` (default the group stream)."""
        return self.cuda.stream(self.stream if stream is None else stream)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """:func:`host_to_device` onto this group's device (call on the stream that reads it)."""
        return host_to_device(t, self.device)

    # -- signals of the host path (stream-ordered on self.stream) ------------------------------

    def _slot(self, kind: int, idx: int) -> int:
        return self.sig.data_ptr() + 8 * (kind * self.world + idx)

    def signal(self, kind: int, pe: int) -> None:
        """Add 1 to slot ``(kind, self.rank)`` on ``pe`` once prior stream work is done."""
        nvb, nvc = self.rt.nvb, self.rt.nvc
        nvb.signal_op_on_stream(
            self._slot(kind, self.rank), 1, int(nvc.SignalOp.SIGNAL_ADD), pe, self.stream.cuda_stream
        )

    def arm(self, pe: int, header: tuple[int, int, int] | None) -> None:
        """Add 1 to slot ``(ARM, self.rank)`` on ``pe`` once prior stream work is done; with
        ``header = (address, nbytes, dest)`` those local bytes first land at symmetric address
        ``dest`` (as ``pe``'s memory: row ``self.rank`` of its map area, or our word of its
        accept array; one put-with-signal: the data is there before the signal)."""
        if header is None:
            self.signal(ARM, pe)
            return
        nvb, nvc = self.rt.nvb, self.rt.nvc
        addr, nbytes, dest = header
        signal_add = int(nvc.SignalOp.SIGNAL_ADD)
        slot = self._slot(ARM, self.rank)
        nvb.putmem_signal_nbi_on_stream(dest, addr, nbytes, slot, 1, signal_add, pe, self.stream.cuda_stream)

    def wait(self, kind: int, idx: int, value: int) -> None:
        """Block the stream until local slot ``(kind, idx)`` >= ``value``."""
        nvb, nvc = self.rt.nvb, self.rt.nvc
        nvb.signal_wait_until_on_stream(
            self._slot(kind, idx), int(nvc.ComparisonType.CMP_GE), value, self.stream.cuda_stream
        )

    # -- local scratch -----------------------------------------------------------------------

    def scratch_rows(self, name: str, rows: int, like: torch.Tensor) -> torch.Tensor:
        """A ``(rows, *like.shape[1:])`` view of a reusable local buffer (call on self.stream)."""
        row_shape = tuple(like.shape[1:])
        nbytes = rows * row_bytes(like)
        buf = self.scratch.get(name)
        if buf is None or buf.numel() < nbytes:
            cap = grown_capacity(0 if buf is None else buf.numel(), max(nbytes, 1))
            if buf is not None:
                logger.info("magi_comm native: receive scratch %r grows to %.1f MiB", name, cap / MIB)
            buf = torch.empty(cap, dtype=torch.uint8, device=self.device)
            self.scratch[name] = buf
        return buf[:nbytes].view(like.dtype).view(rows, *row_shape)
