"""The ``native`` backend: NVSHMEM symmetric buffers + a Triton true-cast copy kernel (one node).

Importing this module only registers the backend; nvshmem4py, cuda.core and triton are imported
when the first :class:`NativeBackend` is created (``pip install magi-comm[native]``).

Design (details of the layout in :mod:`magi_comm.backends._native_layout`)
-------------------------------------------------------------------------
* **Runtime.** One NVSHMEM runtime per process, bootstrapped from the torch.distributed group
  with a unique id (rank 0 creates it, ``broadcast_object_list`` hands it out); NVSHMEM PE =
  group rank. The first group that creates a native backend owns the runtime; other groups
  are refused with :class:`BackendUnavailableError` (NVSHMEM allocations are collective over
  all PEs, a sub- or other group could not allocate).
* **Buffers.** Per group one shared state (refcounted by every NativeBackend of that group,
  "one instance per process group"): a symmetric ``uint8`` receive buffer of
  ``NativeConfig.buffer_bytes`` (``$MAGI_COMM_NATIVE_BUFFER_MB``), its NVLink peer views
  (``nvshmem.core.get_peer_tensor``), a symmetric int64 signal array ``(2, W)`` and a dedicated
  CUDA stream. Local receive scratch for group_reduce is a plain torch tensor that grows on
  demand. Nothing is allocated per call.
* **Send.** One launch of the copy kernel per round and field: every input row range is loaded
  once and stored to each destination's receive region (peer stores over NVLink) and, for rows
  a rank sends itself, straight into the sink. No copy per destination.
* **Completion by signals.** Per ordered pair (s, d) both ends count calls and transfers (a
  round that moves rows s -> d) in the same order, without talking; every signal adds 1 to a
  slot of the receiving rank's signal array, so only the waiter needs the count. At the start
  of a call d *arms* every source s it expects rows from: it adds 1 to ``arm[d]`` on s (for a
  group_cast with ``nvshmemx_putmem_signal_nbi_on_stream``, which first writes d's map header,
  see direct mode, unless s still holds the same map from an earlier call). Before its first
  send kernel of the call, s waits for ``arm[d]`` to reach d's call count: d's earlier use of
  its region and of its output is over (stream order on d). After each send kernel, s adds 1
  to ``ready[s]`` on d; d waits for the transfer count on its stream, copies the region into
  the sink and, when the pair has another round in this call, adds 1 to ``ack[d]`` on s, which
  s waits for before that round. All of it is stream-ordered: no host synchronization, no
  barrier per call. Every rank arms before it waits, and every wait depends only on work
  another rank enqueued earlier in the same or an earlier call, so the protocol cannot
  deadlock.
* **Handshake in the kernels.** A call of one round and one tensor (the common case: the
  buffer holds every pair) does those steps inside its kernels instead of NVSHMEM's on-stream
  signal and wait operations (each a kernel launch): a one-program launch arms the sources and
  waits for the destinations' arms (a destination that is behind then holds one SM slot, not
  every program of the send kernel); the last program of the send kernel signals them ready
  and then waits for the sources' rows; the receive copy or fused reduction follows in stream
  order. A cast into a symmetric output is two launches. Same slots, same counts, so ranks
  may mix both paths on one pair (:mod:`magi_comm.backends._native_protocol`;
  ``NativeConfig.device_handshake``). Deadlock-free for the same reason, provided every kernel
  on the GPU beside the copy finishes on its own (waiting programs hold SM slots).
* **Receive copy beside the transfer.** In such a call the receive copy of a cast into a plain
  output (and, with ``NativeConfig.overlap_reduce``, the fused reduction) runs on a second
  stream beside the send kernel: senders report, chunk by chunk, how many leading rows of the
  receiver's region are in place (a ``PROGRESS`` slot per pair), and each receiving program
  waits for the rows it reads, or for the source's ready signal (pairs too small to report,
  senders on the host path). Its programs are bounded (``max_programs``), so the send kernel
  always finds SMs; the group stream waits for the side stream before the call ends, hence
  before the next call's arms.
* **Direct mode (group_cast into a symmetric output).** When a cast's output lies in a tensor
  from :meth:`NativeBackend.empty_output` (symmetric heap, 16-byte aligned, at most
  ``map_entries`` splits per peer), the receiver's arm carries a map, put into row d of the
  sender's symmetric map area: ``[1 + allocation index, byte offset of each pair split in that
  allocation]``. The send kernel reads the header and writes those rows straight into the
  receiver's output (the allocation's NVLink-mapped base from a table every rank fills at
  allocation time, the split's offset, the row inside the split): no region, no receive copy.
  A receiver that is not in direct mode puts header 0 and the rows go through its region; the
  sender's host path is the same either way, so ranks may choose differently in one call.
* **Capacity.** A pair that moves more rows than a region holds is moved in rounds through the
  same buffer (logged once per layout). The buffer grows (collectively, with a log line) only
  when a single row does not fit: row size and dtype are the same on every rank, so all
  ranks take that decision at the same call. :meth:`NativeBackend.reserve` grows it
  explicitly (collective).
* **GroupReduce.** ``sum`` / ``avg`` whose pairs fit one region: the fused reduction kernel
  reads every term where it lies (own rows in the input, peer rows in the regions); the
  others are transported like a cast into a receive scratch laid out like the a2av backend's,
  then reduced by :mod:`magi_comm._reduce`. Both: float32 accumulation, existing output
  first, sources ascending: bitwise deterministic and bitwise equal to a2av.
* **Pull (group_reduce from a symmetric input).** A receiver of the fused reduction accepts
  pulls (a word put with its arm); a sender whose input lies 16-byte aligned in a symmetric
  output publishes its pair splits' offsets to such a receiver instead of sending the rows,
  the receiver's fused reduction reads them from the sender's input over NVLink and raises
  ``DONE``, and the sender waits for that before its call ends
  (:mod:`magi_comm.backends._native_protocol`). Ranks choose per call, independently.
* **Internode seam.** :func:`_peer_path` decides per peer how rows get there. Today every peer
  must be NVLink-mapped (``nvshmem_ptr`` != NULL); otherwise construction fails with a clear
  message. An NVSHMEM put path would, for such a peer, stage the round's rows for it in a
  local symmetric send area (the copy kernel with that area as the peer column) and issue
  ``nvshmem.bindings.putmem_signal_nbi_on_stream(region, stage, nbytes, ready_slot, n,
  SIGNAL_SET, pe, stream)`` per contiguous run instead of a separate ready signal; the
  receive step and the ack signal stay as they are (signal ops work over any transport).

Lifecycle: :meth:`NativeBackend.close` (collective) releases the group state; the last one frees
the symmetric buffers collectively. Usable as a context manager. :func:`shutdown` finalizes the
NVSHMEM runtime (optional, collective, before ``destroy_process_group``).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .._plan import CastPlan, ReducePlan
from .._reduce import reduce_received
from ..work import GroupCollectiveWork
from . import BackendUnavailableError, register_backend
from ._native_layout import (
    MAX_PEERS,
    SINK_CONCAT,
    SINK_NONE,
    SINK_SCATTER,
    TaskTable,
    arrival_order,
    build_pull_terms,
    build_reduce_terms,
    build_schedule,
    bytes_needed,
    field_offsets,
    grown_capacity,
    publish_table,
    recv_waits,
    reduce_waits,
    region_rows,
    send_progress,
    to_blocks,
    word_size,
)
from ._native_protocol import (
    ACK,
    ARM,
    ARM_AND_WAIT,
    AWAIT_ROWS,
    MAX_REPORTING_PROGRAMS,
    NUM_SIGNALS,
    PULL_ACCEPT,
    READY,
    READY_END,
    SIGNAL_PROGRESS,
    WAIT_READY_END,
    Handshake,
    pack_done,
    pack_peer,
)

__all__ = [
    "ENV_BUFFER_MB",
    "ENV_DEVICE_HANDSHAKE",
    "ENV_FUSED_REDUCE",
    "ENV_MAX_PROGRAMS",
    "ENV_OVERLAP_CHUNK_KB",
    "ENV_STREAM_PRIORITY",
    "NativeBackend",
    "NativeConfig",
    "shutdown",
]

logger = logging.getLogger(__name__)

ENV_BUFFER_MB = "MAGI_COMM_NATIVE_BUFFER_MB"
ENV_FUSED_REDUCE = "MAGI_COMM_NATIVE_FUSED_REDUCE"
ENV_STREAM_PRIORITY = "MAGI_COMM_NATIVE_STREAM_PRIORITY"
ENV_MAX_PROGRAMS = "MAGI_COMM_NATIVE_MAX_PROGRAMS"
ENV_DEVICE_HANDSHAKE = "MAGI_COMM_NATIVE_DEVICE_HANDSHAKE"
ENV_OVERLAP_CHUNK_KB = "MAGI_COMM_NATIVE_OVERLAP_CHUNK_KB"
_MIB = 1 << 20
_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_ALIGN_OUT = 256  # bytes; symmetric outputs are padded to this
_MAPS_PER_PLAN = 4  # direct-mode maps kept per plan (distinct sinks cast into with it)
_MAX_CHUNKS = 4096  # progress chunks of one send launch
_CONSUMER_PROGRAMS = 128  # grid of a waiting receive step when max_programs is 0 (unbounded)
OVERLAP_MIN_CHUNKS = 4  # chunks a pair moves before its progress is reported


@dataclass(frozen=True)
class NativeConfig:
    """Sizes of the native backend.

    Attributes:
        buffer_bytes: symmetric receive buffer per rank (bytes, same on all ranks). A call
            whose pair moves more than ``buffer_bytes / (W - 1)`` bytes runs in rounds.
        block_bytes: bytes copied by one kernel program (power of two, >= 16).
        num_warps: warps per kernel program.
        growth_factor: buffer growth factor when a single row does not fit.
        fused_reduce: reduce ``sum`` / ``avg`` with the fused kernel straight from the
            receive regions when every pair fits one region (``$MAGI_COMM_NATIVE_FUSED_REDUCE=0``
            turns it off: rows then go through the receive scratch and the shared torch
            reduction, like the staged path used for ``lse`` and for calls in rounds).
        map_entries: most splits a receiver in direct mode takes from one peer in one
            group_cast (its map of split offsets must fit the peer's map row); a call with more
            goes through the receive regions.
        max_outputs: most symmetric outputs (:meth:`NativeBackend.empty_output`) alive at once.
        stream_priority: CUDA priority of the group stream the transfers run on (lower is more
            urgent; ``$MAGI_COMM_NATIVE_STREAM_PRIORITY``). The default, -1, lets the copy
            kernel's programs take SMs as soon as programs of a kernel running beside it (the
            attention kernel of the stage being overlapped) retire; at 0 the block scheduler
            runs the earlier kernel's remaining programs first, so a cast issued beside a long
            kernel waits for that kernel's last wave.
        max_programs: most programs (CTAs) of one copy-kernel launch; they stride over the
            blocks (``$MAGI_COMM_NATIVE_MAX_PROGRAMS``; 0: one program per block). With one
            program per block a copy takes every SM that a kernel running beside it frees
            until the copy is done, so an attention stage overlapped with a cast runs about
            as long as the two back to back. With the default, 128, the two overlap (measured
            in docs/perf.md, "overlap" in the magi-dist section); the likely mechanism, not
            measured: the capped grid packs the copy onto the few SMs that free up first
            (several programs fit one SM).
        device_handshake: calls of one round and one tensor signal and wait inside the
            kernels (:mod:`magi_comm.backends._native_protocol`) instead of through
            NVSHMEM's on-stream signal and wait operations, each a kernel launch of its own
            (``$MAGI_COMM_NATIVE_DEVICE_HANDSHAKE=0`` turns it off). A cast into a symmetric
            output is then two launches per call (five on the host path).
        overlap_chunk_bytes: with the kernel handshake, the receive copy of a cast into a
            plain output runs beside the send kernel, on a second stream, and takes the peers'
            rows as they arrive: the send kernel reports its progress after every chunk of
            this many bytes of blocks, and the receiving programs wait for the rows they read
            (``$MAGI_COMM_NATIVE_OVERLAP_CHUNK_KB``; 0: the receive copy follows the whole
            transfer, in stream order). Only pairs that move at least ``OVERLAP_MIN_CHUNKS``
            chunks report progress (each report costs every sending program a system-scope
            fence; below that the overlap measured slower, docs/perf.md); the receiver waits
            for the other pairs' rows through their ready signal.
        overlap_reduce: the fused reduction runs beside the send kernel the same way (off: on
            2x H200 it measured slower than the reduction after the transfer, docs/perf.md:
            its programs, bounded in number because they wait, reduce at a lower rate).
    """

    buffer_bytes: int = 256 * _MIB
    block_bytes: int = 16384
    num_warps: int = 8
    growth_factor: float = 2.0
    fused_reduce: bool = True
    map_entries: int = 8192
    max_outputs: int = 64
    stream_priority: int = -1
    max_programs: int = 128
    device_handshake: bool = True
    overlap_chunk_bytes: int = 8 * _MIB
    overlap_reduce: bool = False

    def __post_init__(self) -> None:
        if self.max_programs < 0:
            raise ValueError(f"max_programs must be >= 0 (0: one program per block), got {self.max_programs}")
        if self.overlap_chunk_bytes < 0:
            raise ValueError(
                f"overlap_chunk_bytes must be >= 0 (0: no overlap), got {self.overlap_chunk_bytes}"
            )

    @staticmethod
    def from_env() -> NativeConfig:
        off = ("0", "false", "no", "off")
        kw = {
            field: os.environ.get(env, "1").strip().lower() not in off
            for field, env in (("fused_reduce", ENV_FUSED_REDUCE), ("device_handshake", ENV_DEVICE_HANDSHAKE))
        }
        scale = {"overlap_chunk_bytes": 1024}
        for field, env in (
            ("stream_priority", ENV_STREAM_PRIORITY),
            ("max_programs", ENV_MAX_PROGRAMS),
            ("overlap_chunk_bytes", ENV_OVERLAP_CHUNK_KB),
        ):
            value = os.environ.get(env, "").strip()
            if value:
                try:
                    kw[field] = int(value) * scale.get(field, 1)
                except ValueError:
                    raise ValueError(f"${env} must be an integer, got {value!r}") from None
        mb = os.environ.get(ENV_BUFFER_MB)
        if mb:
            try:
                kw["buffer_bytes"] = int(float(mb) * _MIB)
            except ValueError:
                raise ValueError(f"${ENV_BUFFER_MB} must be a number of MiB, got {mb!r}") from None
            if kw["buffer_bytes"] <= 0:
                raise ValueError(f"${ENV_BUFFER_MB} must be positive, got {mb!r}")
        try:
            return NativeConfig(**kw)
        except ValueError as e:  # name the variable the bad value came from
            env = ENV_MAX_PROGRAMS if "max_programs" in str(e) else ENV_OVERLAP_CHUNK_KB
            raise ValueError(f"${env}: {e}") from None

    def aligned_buffer_bytes(self) -> int:
        return max(_MIB, (self.buffer_bytes + _MIB - 1) // _MIB * _MIB)


def _unavailable(reason: str) -> BackendUnavailableError:
    return BackendUnavailableError(
        f"magi_comm backend 'native' is unavailable: {reason}. It needs CUDA GPUs of one node and "
        f"the [native] extra (nvshmem4py-cu13) and triton (part of CUDA builds of torch); use backend='a2av' (the default) or unset "
        f"MAGI_COMM_BACKEND."
    )


# --------------------------------------------------------------------------------------------
# NVSHMEM runtime (one per process)


def _device(index: int) -> torch.device:
    return torch.device("cuda", index)


def _load_kernels():
    try:
        from . import _native_kernels
    except ImportError as e:
        raise _unavailable(f"triton cannot be imported ({e})") from e
    return _native_kernels


class _RuntimeStore:
    """Holds the process's runtime (a seam: the CPU tests swap in a per-thread store)."""

    rt: _Runtime | None = None


_runtime_store = _RuntimeStore()


class _Runtime:
    """The process's NVSHMEM runtime, bootstrapped once from a torch.distributed group."""

    _lock = threading.Lock()

    def __init__(self, members: tuple[int, ...], rank: int, world: int, device: int, nvc, nvb) -> None:
        self.members = members
        self.rank = rank
        self.world = world
        self.device = device
        self.nvc = nvc
        self.nvb = nvb
        self.states: dict[tuple[int, ...], _GroupState] = {}

    @classmethod
    def acquire(cls, group, rank: int, world: int, config: NativeConfig) -> _Runtime:
        members = tuple(dist.get_process_group_ranks(group))
        with cls._lock:
            rt = getattr(_runtime_store, "rt", None)
            if rt is not None:
                if rt.members != members:
                    raise _unavailable(
                        f"this process's NVSHMEM runtime belongs to the group of global ranks "
                        f"{list(rt.members)}; a native backend for the group {list(members)} would need "
                        f"collective NVSHMEM allocations over other ranks (one runtime per process)"
                    )
                return rt
            try:
                import nvshmem.bindings as nvb
                import nvshmem.core as nvc
                from cuda.core import Device
            except ImportError as e:
                raise _unavailable(f"nvshmem4py / cuda.core cannot be imported ({e})") from e
            device = torch.cuda.current_device()
            # The symmetric heap must hold the buffer and its growth; NVSHMEM reads this at init.
            os.environ.setdefault(
                "NVSHMEM_SYMMETRIC_SIZE", str(max(1 << 30, 4 * config.aligned_buffer_bytes()))
            )
            dev = Device(device)
            dev.set_current()
            uid = nvc.get_unique_id(empty=rank != 0)
            box = [uid if rank == 0 else None]
            dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
            nvc.init(device=dev, uid=box[0], rank=rank, nranks=world, initializer_method="uid")
            if nvc.my_pe() != rank or nvc.n_pes() != world:
                raise RuntimeError(
                    f"magi_comm native: NVSHMEM PE {nvc.my_pe()}/{nvc.n_pes()} != group rank {rank}/{world}"
                )
            logger.info("magi_comm native: NVSHMEM %s initialized, PE %d/%d", nvc.get_version(), rank, world)
            rt = cls(members, rank, world, device, nvc, nvb)
            _runtime_store.rt = rt
            return rt


def shutdown() -> None:
    """Finalize the NVSHMEM runtime (collective). All native backends must be closed first."""
    with _Runtime._lock:
        rt = getattr(_runtime_store, "rt", None)
        if rt is None:
            return
        if rt.states:
            raise RuntimeError(
                "magi_comm native: shutdown() with native backends still open; close them first"
            )
        rt.nvc.finalize()
        _runtime_store.rt = None


def _peer_path(nvc, buf: torch.Tensor, rank: int, pe: int) -> torch.Tensor:
    """How rows reach peer ``pe``: today an NVLink-mapped view of its buffer (the seam for puts)."""
    if pe == rank:
        return buf
    try:
        return nvc.get_peer_tensor(buf, pe)
    except Exception as e:  # nvshmem_ptr returned NULL: the peer is not load/store reachable
        raise _unavailable(
            f"PE {pe} is not reachable by NVLink load/store from PE {rank} ({e}); the internode "
            f"NVSHMEM put path is not implemented yet (see magi_comm.backends.native docstring)"
        ) from e


class _GroupState:
    """Symmetric buffers, signals, stream and transfer counters shared by one group's backends."""

    def __init__(self, rt: _Runtime, config: NativeConfig) -> None:
        self.rt = rt
        self.rank, self.world = rt.rank, rt.world
        self.config = config
        self.refcount = 0
        self.device = _device(rt.device)
        self.stream = torch.cuda.Stream(self.device, priority=config.stream_priority)
        W = self.world
        # Per-pair counters; both ends of a pair count alike without talking (see the docstring).
        # Signals add 1, so only the waiting end needs the counts.
        self.sent = [0] * W  # transfers this rank made to each peer
        self.recvd = [0] * W  # transfers this rank consumed from each peer (READY counts)
        self.arms_seen = [0] * W  # calls in which this rank waited for each destination's arm
        self.arms_made = [0] * W  # calls in which this rank armed each source (the pair's epoch)
        self.acks_seen = [0] * W  # between-round acknowledgements awaited from each destination
        self.map_sent = [-1] * W  # token of the map this rank last put to each source (0: header 0)
        self.accept_sent = [-1] * W  # accept word this rank last put to each source (reduce: pull)
        self.map_tokens = 0
        self.scratch: dict[str, torch.Tensor] = {}
        # target of the copy kernel's system-scope release (see _native_kernels)
        self.fence = torch.zeros(16, dtype=torch.int32, device=self.device)
        self.fence_addr = self.fence.data_ptr()
        nvc = rt.nvc
        self.sig = nvc.tensor((NUM_SIGNALS * W,), dtype=torch.int64)
        self.sig.zero_()
        # The kernels' handshake: every peer's signal array, and a counter of finished programs
        # (a slot of the fence tensor the plain copies do not touch).
        sig_peers = [_peer_path(nvc, self.sig, self.rank, pe).data_ptr() for pe in range(W)]
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
        self.side = torch.cuda.Stream(self.device, priority=config.stream_priority)
        self.armed_event = torch.cuda.Event()
        self.consumed_event = torch.cuda.Event()
        # Direct mode: row d of the map area is where destination d puts its map for our sends;
        # outputs[a] is symmetric output a, output_bases[a, c] its address as peer c's memory.
        self.map_width = 1 + config.map_entries
        self.maps = nvc.tensor((W * self.map_width,), dtype=torch.int64)
        self.maps.zero_()
        # what an arm puts for "rows through my region": header 0 of a cast, accept word 0
        self.zero_word = torch.zeros(1, dtype=torch.int64, device=self.device)
        # Pull (group_reduce from a symmetric input): word d of ``accepts`` is destination d's
        # accept word for our sends, row s of ``pull_maps`` where source s's rows for us lie.
        self.accepts = nvc.tensor((W,), dtype=torch.int64)
        self.accepts.zero_()
        self.pull_maps = nvc.tensor((W * self.map_width,), dtype=torch.int64)
        self.pull_maps.zero_()
        pull_peers = [_peer_path(nvc, self.pull_maps, self.rank, pe).data_ptr() for pe in range(W)]
        self.pull_peers = torch.tensor(pull_peers, dtype=torch.int64).to(self.device)
        self.accept_word = torch.tensor([PULL_ACCEPT], dtype=torch.int64).to(self.device)
        # per destination, what the last reduce send decided: 2 * epoch + (its rows were left)
        self.pull_decided = torch.zeros(W, dtype=torch.int64, device=self.device)
        self.outputs: list[torch.Tensor | None] = [None] * config.max_outputs
        self.output_spans: dict[int, tuple[int, int]] = {}  # live output index -> (start, end) address
        self.output_gen = [0] * config.max_outputs  # allocations made in each slot so far
        self.output_bases = torch.zeros((config.max_outputs, W), dtype=torch.int64, device=self.device)
        self.capacity = 0
        self.buf: torch.Tensor | None = None
        self.peers: list[torch.Tensor] = []
        self.peer_addr: list[int] = []
        self._allocate(config.aligned_buffer_bytes())

    # -- symmetric memory -------------------------------------------------------------------

    def _barrier(self) -> None:
        """Collective, host-blocking; only at setup, growth and teardown."""
        torch.cuda.synchronize(self.device)
        self.rt.nvb.barrier_all_on_stream(self.stream.cuda_stream)
        self.stream.synchronize()

    def _allocate(self, nbytes: int) -> None:
        nvc = self.rt.nvc
        self.buf = nvc.tensor((nbytes,), dtype=torch.uint8)
        self.capacity = nbytes
        self.peers = [_peer_path(nvc, self.buf, self.rank, pe) for pe in range(self.world)]
        self.peer_addr = [t.data_ptr() for t in self.peers]
        self._barrier()  # zeroed signals and the new buffer are visible everywhere before use

    def _free_buffer(self) -> None:
        self._barrier()  # every rank finished every transfer into every buffer
        self.peers, self.peer_addr = [], []
        buf, self.buf = self.buf, None
        if buf is not None:
            self.rt.nvc.free_tensor(buf)
        self.capacity = 0

    def grow(self, needed: int) -> None:
        """Collective: replace the receive buffer by one of at least ``needed`` bytes."""
        new = grown_capacity(self.capacity, needed, factor=self.config.growth_factor)
        logger.warning(
            "magi_comm native: growing the symmetric receive buffer from %.1f MiB to %.1f MiB "
            "(needed %d bytes); set $%s to avoid this",
            self.capacity / _MIB,
            new / _MIB,
            needed,
            ENV_BUFFER_MB,
        )
        self._free_buffer()
        self._allocate(new)

    def close(self) -> None:
        for a in sorted(self.output_spans):
            self.free_output(a)
        self._free_buffer()
        for name in ("sig", "maps", "accepts", "pull_maps"):
            t = getattr(self, name)
            setattr(self, name, None)
            if t is not None:
                self.rt.nvc.free_tensor(t)
        self.scratch.clear()

    # -- symmetric outputs (direct mode) -------------------------------------------------------

    def free_slot(self) -> int:
        """The slot the next symmetric output takes (the lowest free one), -1 if none."""
        return next((a for a, t in enumerate(self.outputs) if t is None), -1)

    def allocate_output(
        self, nbytes: int, a: int, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """Collective: a ``shape`` / ``dtype`` tensor at the start of a new symmetric allocation of
        ``nbytes`` (the same on every rank, at least the tensor's size) in free slot ``a``."""
        nvc = self.rt.nvc
        base = nvc.tensor((max(_ALIGN_OUT, -(-nbytes // _ALIGN_OUT) * _ALIGN_OUT),), dtype=torch.uint8)
        bases = [_peer_path(nvc, base, self.rank, pe).data_ptr() for pe in range(self.world)]
        self.output_bases[a] = torch.tensor(bases, dtype=torch.int64)
        self.outputs[a] = base
        self.output_gen[a] += 1
        self.output_spans[a] = (base.data_ptr(), base.data_ptr() + base.numel())
        numel = torch.Size(shape).numel()
        return base[: numel * torch.empty(0, dtype=dtype).element_size()].view(dtype).view(shape)

    def output_index(self, t: torch.Tensor) -> int | None:
        """Index of the symmetric output that holds all of ``t``'s bytes, or None."""
        if not self.output_spans:
            return None
        lo = t.data_ptr()
        hi = lo + t.numel() * t.element_size()
        for a, (start, end) in self.output_spans.items():
            if start <= lo and hi <= end:
                return a
        return None

    def free_output(self, a: int) -> None:
        """Collective: free symmetric output ``a`` once every rank is done with every transfer."""
        self._barrier()
        base, self.outputs[a] = self.outputs[a], None
        del self.output_spans[a]
        self.output_bases[a] = torch.zeros(self.world, dtype=torch.int64)  # a host copy: in order
        self.rt.nvc.free_tensor(base)

    # -- signals (stream-ordered on self.stream) --------------------------------------------

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
        nvb.putmem_signal_nbi_on_stream(
            dest,
            addr,
            nbytes,
            self._slot(ARM, self.rank),
            1,
            int(nvc.SignalOp.SIGNAL_ADD),
            pe,
            self.stream.cuda_stream,
        )

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
        nbytes = rows * _row_bytes(like)
        buf = self.scratch.get(name)
        if buf is None or buf.numel() < nbytes:
            cap = grown_capacity(0 if buf is None else buf.numel(), max(nbytes, 1))
            if buf is not None:
                logger.info("magi_comm native: receive scratch %r grows to %.1f MiB", name, cap / _MIB)
            buf = torch.empty(cap, dtype=torch.uint8, device=self.device)
            self.scratch[name] = buf
        return buf[:nbytes].view(like.dtype).view(rows, *row_shape)


# --------------------------------------------------------------------------------------------


class _EventWork:
    """A transport handle: waiting orders the caller's current stream after the event."""

    __slots__ = ("device", "event")

    def __init__(self, event: torch.cuda.Event, device: int) -> None:
        self.event = event
        self.device = device

    def wait(self, timeout=None) -> bool:
        torch.cuda.current_stream(self.device).wait_event(self.event)
        return True


@dataclass
class _Field:
    """One tensor moved by a call: ``src`` rows (contiguous) land in ``sink`` rows (contiguous),
    ``row_bytes`` (:func:`_row_bytes` of ``src``, computed once per call) bytes each."""

    src: torch.Tensor
    sink: torch.Tensor
    row_bytes: int


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host table -> device without blocking the host on the stream (pinned, non_blocking)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _recent(plan, name: str, key, build):
    """``build()``, cached on ``plan`` under ``name`` for the last ``_MAPS_PER_PLAN`` keys (maps
    and publish tables of the last few symmetric tensors a plan was used with)."""
    cache = plan._on_device.setdefault(name, {})
    value = cache.pop(key, None)
    if value is None:
        value = build()
    cache[key] = value  # most recent last
    while len(cache) > _MAPS_PER_PLAN:
        del cache[next(iter(cache))]
    return value


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte spans of two contiguous tensors intersect."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _row_bytes(t: torch.Tensor) -> int:
    return torch.Size(t.shape[1:]).numel() * t.element_size()


class NativeBackend:
    """GroupCast / GroupReduce over NVSHMEM symmetric buffers on one node (see module docstring).

    Args:
        group, rank, world_size: the process group and this process's rank in it.
        config: sizes; default :meth:`NativeConfig.from_env`.
    """

    name = "native"

    def __init__(self, group, rank: int, world_size: int, config: NativeConfig | None = None) -> None:
        if not torch.cuda.is_available():
            raise _unavailable("CUDA is not available in this process")
        if world_size > MAX_PEERS:
            raise _unavailable(f"world size {world_size} > {MAX_PEERS} (one NVLink node)")
        self._kernels = _load_kernels()
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.config = config or NativeConfig.from_env()
        rt = _Runtime.acquire(group, rank, world_size, self.config)
        with _Runtime._lock:
            state = rt.states.get(rt.members)
            if state is None:
                state = _GroupState(rt, self.config)
                rt.states[rt.members] = state
            state.refcount += 1
        self._rt = rt
        self._state: _GroupState | None = state

    # ---- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Collective: release this handle; the group's last handle frees the symmetric buffers."""
        state, self._state = self._state, None
        if state is None:
            return
        with _Runtime._lock:
            state.refcount -= 1
            last = state.refcount == 0
            if last:
                self._rt.states.pop(self._rt.members, None)
        if last:
            state.close()
        self.group = None

    def __enter__(self) -> NativeBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def empty_output(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """Collective: an uninitialized tensor of ``shape`` / ``dtype`` in the NVSHMEM symmetric
        heap, on this rank's GPU. A group_cast into it (or into a contiguous, 16-byte aligned
        row range of it) runs in direct mode: peers write the rows straight into it, without
        the receive copy; a group_reduce from it leaves the rows there for receivers of the
        fused reduction (pull). Shapes may differ per rank (the allocation takes the largest). Free
        it with :meth:`free_output` (collective) or let :meth:`close` free it."""
        st = self._require()
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"empty_output: dtype must be a torch.dtype, got {dtype!r}")
        shape = tuple(int(x) for x in shape)
        if any(x < 0 for x in shape):
            raise ValueError(f"empty_output: shape must not have negative sizes, got {shape}")
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        # One host collective: the largest size, and a check that every rank takes the same
        # slot with the same map geometry (the header names the slot, the kernel's row stride
        # is the map width).
        slot = st.free_slot()
        top = self._max_over_ranks([nbytes, slot, -slot, st.map_width, -st.map_width])
        if top[1] != -top[2] or top[3] != -top[4]:
            raise RuntimeError(
                "empty_output: ranks disagree on the output slot or on NativeConfig.map_entries "
                "(every rank must allocate and free its outputs in the same order, with one config)"
            )
        if slot < 0:
            raise RuntimeError(
                f"magi_comm native: {len(st.outputs)} symmetric outputs are alive "
                f"(NativeConfig.max_outputs); free some with free_output first"
            )
        return st.allocate_output(top[0], slot, shape, dtype)

    def free_output(self, tensor: torch.Tensor) -> None:
        """Collective: free a tensor from :meth:`empty_output` (every rank passes its own, of
        the same allocation)."""
        st = self._require()
        a = st.output_index(tensor)
        if a is not None and tensor.data_ptr() != st.output_spans[a][0]:
            a = None
        a = -1 if a is None else a
        top = self._max_over_ranks([a, -a])  # every rank reaches the check, none hangs
        if a < 0:
            raise ValueError("free_output: tensor is not a tensor returned by empty_output (or was freed)")
        if top[0] != -top[1]:
            raise RuntimeError("free_output: ranks passed tensors of different allocations")
        st.free_output(a)

    def _max_over_ranks(self, values: list[int]) -> list[int]:
        """Element-wise maximum of ``values`` over the group (host-blocking)."""
        t = torch.tensor(values, dtype=torch.int64, device=self._require().device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def reserve(self, nbytes: int) -> None:
        """Collective: make the symmetric receive buffer at least ``nbytes`` bytes."""
        st = self._require()
        if nbytes > st.capacity:
            st.grow(nbytes)

    @property
    def capacity(self) -> int:
        return self._require().capacity

    def _require(self) -> _GroupState:
        if self._state is None:
            raise RuntimeError("magi_comm native backend is closed")
        return self._state

    # ---- helpers ---------------------------------------------------------------------------

    def _check_device(self, *tensors) -> None:
        dev = self._require().device
        for t in tensors:
            if t is not None and t.device != dev:
                raise ValueError(f"magi_comm native backend: tensors must be on {dev}, got one on {t.device}")

    def _schedule(self, plan, R: int, sink: str):
        key = ("native-schedule", R, sink)
        sched = plan._on_device.get(key)
        if sched is None:
            sched = build_schedule(plan, R, sink)
            plan._on_device[key] = sched
            if sched.num_rounds > 1:
                logger.info(
                    "magi_comm native: rank %d moves this layout in %d rounds of %d rows per peer; a "
                    "larger $%s avoids the rounds",
                    self.rank,
                    sched.num_rounds,
                    R,
                    ENV_BUFFER_MB,
                )
        return sched

    def _rows_per_region(self, rbs: tuple[int, ...]) -> int:
        """Rows per region for fields of ``rbs`` bytes per row; grows the buffer (collectively)
        when not even one row fits. Row sizes are the same on every rank, so is the decision."""
        st = self._require()
        R = region_rows(st.capacity, self.world_size, rbs)
        if R < 1:
            st.grow(bytes_needed(self.world_size, rbs))
            R = region_rows(st.capacity, self.world_size, rbs)
        return R

    def _layout(self, plan, sink_kind: str, rbs: tuple[int, ...], ws: tuple[int, ...]):
        """Everything a transport of this plan needs except the tensors' addresses, cached on the
        plan: (schedule, per field: (region offset, per round: (send launch, receive launch))).

        Depends on the receive buffer (its size and address: part of the key), so a grown
        buffer gets a fresh entry."""
        st = self._require()
        key = ("native-layout", sink_kind, rbs, ws, st.capacity, st.buf.data_ptr())
        layout = plan._on_device.get(key)
        if layout is None:
            W, rank = self.world_size, self.rank
            R = self._rows_per_region(rbs)
            if st.capacity != key[4]:  # grew: the key names the old buffer
                return self._layout(plan, sink_kind, rbs, ws)
            sched = self._schedule(plan, R, sink_kind)
            per_field = []
            make, nw, cap = self._kernels.CopyLaunch, self.config.num_warps, self.config.max_programs
            # a cast's sends read the peers' maps: they may write straight into peer outputs
            direct = (st.maps.data_ptr(), st.output_bases.data_ptr(), st.map_width)
            direct = direct if sink_kind == SINK_SCATTER else None
            # a reduce's first send (of the first field) publishes the pull-map headers
            publish = (
                st.pull_peers.data_ptr(),
                st.accepts.data_ptr(),
                st.map_width,
                st.pull_decided.data_ptr(),
            )
            publish = None if sink_kind == SINK_SCATTER else publish
            # block tables go to the device on the group stream, ahead of the kernels reading them
            with torch.cuda.stream(st.stream):
                for f, (rb, w, off) in enumerate(zip(rbs, ws, field_offsets(W, R, rbs))):
                    block_words = max(1, self.config.block_bytes // w)
                    peers = [None if pe == rank else st.peer_addr[pe] + off for pe in range(W)]
                    dt = _WORD_DTYPES[w]
                    vec = 16 // w if rb % 16 == 0 else 1
                    launches = []
                    # one round: the receive step may run beside the transfer (overlap)
                    overlap = len(sched.rounds) == 1 and len(rbs) == 1 and self._overlap_on(sink_kind)
                    overlap = overlap and 0 < cap <= MAX_REPORTING_PROGRAMS
                    for k, r in enumerate(sched.rounds):
                        send = to_blocks(r.send, rb // w, block_words)
                        recv = to_blocks(r.recv, rb // w, block_words)
                        progress = waits = None
                        if overlap:
                            progress, waits = self._overlap_tables(plan, send, recv, sched.region_rows, rb, w)
                        launches.append(
                            (
                                make(
                                    send.to(st.device, _to_device),
                                    peers,
                                    dt,
                                    vec=vec,
                                    num_warps=nw,
                                    fence=st.fence_addr,
                                    direct=direct,
                                    max_programs=cap,
                                    handshake=st.handshake,
                                    progress=progress,
                                    publish=publish if k == 0 and f == 0 else None,
                                ),
                                make(
                                    recv.to(st.device, _to_device),
                                    [None] * W,
                                    dt,
                                    vec=vec,
                                    num_warps=nw,
                                    # waiting programs must not fill the GPU (the send kernel needs SMs)
                                    max_programs=(cap or _CONSUMER_PROGRAMS) if waits else cap,
                                    handshake=st.handshake if waits else None,
                                    waits=waits,
                                ),
                            )
                        )
                    per_field.append((off, launches))
            layout = plan._on_device[key] = (sched, per_field)
        return layout

    def _transport(
        self, plan, sink_kind: str, fields: list[_Field], consume=None, maps=None, pub: int = 0
    ) -> None:
        """Move every field's rows to their sinks (enqueued on the group stream).

        ``consume`` (fused reduction, ``SINK_NONE``, at most one round) replaces the receive
        copies: it runs once every peer's rows are in the local regions (or at once when there
        is no round), before the acknowledgements release the regions.
        ``maps`` (group_cast, direct mode): per source, ``(address, nbytes, token)`` of this
        rank's map for it; peers then write straight into the sink and no receive copy runs. A
        cast without maps puts header 0 (rows through the regions).
        ``pub`` (group_reduce): address of the publish table the first send launch writes to the
        destinations' pull maps (:func:`~magi_comm.backends._native_layout.publish_table`).
        """
        st = self._require()
        fields = [f for f in fields if f.row_bytes > 0]
        if not fields:
            if consume is not None:
                consume(st.stream, None)
            return
        rbs = tuple(f.row_bytes for f in fields)
        ws = tuple(word_size(rb, f.src, f.sink) for f, rb in zip(fields, rbs))
        sched, per_field = self._layout(plan, sink_kind, rbs, ws)
        if consume is not None and sched.num_rounds > 1:
            raise AssertionError("fused consumption needs a single round")
        base = st.buf.data_ptr()
        prepared = [
            (f.src.data_ptr(), f.sink.data_ptr(), base + off, runs)
            for f, (off, runs) in zip(fields, per_field)
        ]
        rounds = sched.rounds
        if len(rounds) == 1 and len(prepared) == 1 and self.config.device_handshake:
            self._one_round_in_kernels(rounds[0], prepared[0], sink_kind, consume, maps, pub)
            return
        stream = st.stream
        if rounds:  # arm every source first: a rank never waits before its own arms are out
            for s in rounds[0].recv_peers:
                st.arms_made[s] += 1
                st.arm(s, self._arm_header(s, sink_kind, maps))
        for k, rnd in enumerate(rounds):
            for d in rnd.send_peers:
                if k == 0:  # d's earlier use of its region and output is over
                    st.arms_seen[d] += 1
                    st.wait(ARM, d, st.arms_seen[d])
                else:  # d consumed our previous round
                    st.acks_seen[d] += 1
                    st.wait(ACK, d, st.acks_seen[d])
            for src, sink, _local, runs in prepared:
                send = runs[k][0]
                if send.publish is None:
                    send(src, sink, stream)
                    continue
                # the publishing launch records its decisions under each destination's epoch
                epochs = tuple(
                    pack_peer(st.arms_seen[c] if c in rnd.send_peers else 0) for c in range(self.world_size)
                )
                send(src, sink, stream, words=epochs, pub=pub)
            for d in rnd.send_peers:
                st.sent[d] += 1
                st.signal(READY, d)
            for s in rnd.recv_peers:
                st.wait(READY, s, st.recvd[s] + 1)
            if consume is not None:
                consume(stream, None)
            elif maps is None:
                for _src, sink, local, runs in prepared:
                    runs[k][1](local, sink, stream)
            later = rounds[k + 1].recv_peers if k + 1 < len(rounds) else ()
            for s in rnd.recv_peers:
                st.recvd[s] += 1
                if s in later:
                    st.signal(ACK, s)
        if consume is not None and not rounds:
            consume(stream, None)

    def _arm_header(self, s: int, sink_kind: str, maps) -> tuple[int, int, int] | None:
        """What arming source ``s`` puts first: ``(address, nbytes, dest)``, this rank's map for
        it in row ``rank`` of its map area (a cast: its output map in direct mode, header 0
        otherwise) or its accept word (a reduce: ``PULL_ACCEPT`` when the call takes the fused
        reduction, which reads rows in place, else 0), or None when ``s`` still holds that
        value (only this rank writes there)."""
        st = self._require()
        if sink_kind != SINK_SCATTER:
            word = PULL_ACCEPT if sink_kind == SINK_NONE else 0
            if st.accept_sent[s] == word:
                return None
            st.accept_sent[s] = word
            at = (st.accept_word if word == PULL_ACCEPT else st.zero_word).data_ptr()
            return (at, 8, st.accepts.data_ptr() + 8 * self.rank)
        header = maps[s] if maps is not None else (st.zero_word.data_ptr(), 8, 0)
        if st.map_sent[s] == header[2]:
            return None
        st.map_sent[s] = header[2]
        return (header[0], header[1], st.maps.data_ptr() + 8 * self.rank * st.map_width)

    def _overlap_on(self, sink_kind: str) -> bool:
        cfg = self.config
        kinds = (SINK_SCATTER, SINK_NONE) if cfg.overlap_reduce else (SINK_SCATTER,)
        return cfg.device_handshake and cfg.overlap_chunk_bytes > 0 and sink_kind in kinds

    def _overlap_tables(self, plan, send, recv, R: int, rb: int, w: int):
        """``(progress, waits)`` of a round's send and receive launches (see
        :class:`CopyLaunch`): progress for the pairs that move at least
        ``OVERLAP_MIN_CHUNKS`` chunks (None if none), waits when some source's pair does
        (else None: the receive step follows the transfer)."""
        st = self._require()
        W, rank = self.world_size, self.rank
        big = self.config.overlap_chunk_bytes * OVERLAP_MIN_CHUNKS
        sends_big = [c != rank and plan.send_counts[c] * rb >= big for c in range(W)]
        recvs_big = [s != rank and plan.recv_counts[s] * rb >= big for s in range(W)]
        progress = waits = None
        if any(sends_big):
            chunk = max(1, self.config.overlap_chunk_bytes // (send.block_words * w))
            chunk = max(chunk, -(-send.num_blocks // _MAX_CHUNKS))
            rows = send_progress(send, rank, W, R, rb // w, chunk)
            rows[:, [c for c in range(W) if not sends_big[c]]] = -1
            progress = (_to_device(rows, st.device), st.progress_cnt.data_ptr(), chunk)
        if any(recvs_big):
            waits = tuple(_to_device(t, st.device) for t in recv_waits(recv, rank, W, R, rb // w))
        return progress, waits

    def _one_round_in_kernels(self, rnd, field, sink_kind: str, consume, maps, pub: int) -> None:
        """A call of one round and one field with the handshake inside the kernels: a
        one-program launch arms the sources and waits for the destinations' arms; the send
        kernel signals the destinations ready. The receive copy or the fused reduction (a
        cast into a symmetric output has none) either follows in stream order, after the send
        kernel's last program waited for the sources' rows, or, with overlap, runs beside the
        send kernel on the side stream and waits for the rows as they arrive (the send kernel
        reports its progress). Same counts as the host path."""
        st = self._require()
        W = self.world_size
        arm_wait, ready_wait, arm_now = [0] * W, [0] * W, [False] * W
        for s in rnd.recv_peers:
            header = self._arm_header(s, sink_kind, maps)
            if header is None:
                arm_now[s] = True
            else:  # the map must land before the arm: a put-with-signal ahead of the kernel
                st.arm(s, header)
            st.arms_made[s] += 1
            st.recvd[s] += 1
            ready_wait[s] = st.recvd[s]
        for d in rnd.send_peers:
            st.arms_seen[d] += 1
            arm_wait[d] = st.arms_seen[d]
            st.sent[d] += 1
        words = tuple(pack_peer(*w) for w in zip(arm_wait, ready_wait, arm_now))
        if st.arm_launch is None:
            with torch.cuda.stream(st.stream):  # the empty table's copy, ahead of the launch
                empty = to_blocks(TaskTable.empty(W), 1, 1).to(st.device, _to_device)
                st.arm_launch = self._kernels.CopyLaunch(
                    empty,
                    [None] * W,
                    torch.int64,
                    max_programs=self.config.max_programs,
                    handshake=st.handshake,
                )
        # One program arms and waits for the arms, so that a destination that is behind holds
        # one SM slot, not every program of the send kernel (an attention kernel running beside
        # the transfer keeps the others).
        st.arm_launch(0, 0, st.stream, sync=ARM_AND_WAIT, words=words)
        src, sink, local, runs = field
        send, recv = runs[0]
        receives = consume is not None or maps is None
        progress = send.progress is not None
        if not (receives and recv.waits is not None and rnd.recv_peers):
            sync = READY_END | WAIT_READY_END | (SIGNAL_PROGRESS if progress else 0)
            send(src, sink, st.stream, sync=sync, words=words, pub=pub)
            if consume is not None:
                consume(st.stream, None)
            elif maps is None:
                recv(local, sink, st.stream)
            return
        # Overlap: the receive step starts with the send kernel (after the arms: the sink and
        # the caller's earlier work are ordered through st.stream) and reads each source's rows
        # once they are reported in place; st.stream waits for it before the call ends.
        sources = tuple(
            pack_peer(st.arms_made[s], ready_wait[s]) if ready_wait[s] else pack_peer() for s in range(W)
        )
        st.armed_event.record(st.stream)
        st.side.wait_event(st.armed_event)
        send(
            src, sink, st.stream, sync=READY_END | (SIGNAL_PROGRESS if progress else 0), words=words, pub=pub
        )
        if consume is not None:
            consume(st.side, sources)
        else:
            recv(local, sink, st.side, sync=AWAIT_ROWS, words=sources)
        st.consumed_event.record(st.side)
        st.stream.wait_event(st.consumed_event)

    def _direct_maps(self, plan: CastPlan, sink: torch.Tensor, rb: int):
        """Direct mode of a group_cast into ``sink`` (rows of ``rb`` bytes): ``(table, maps)``
        where ``maps`` gives per source the ``(address, nbytes, token)`` of this rank's map for
        it inside the device ``table`` (the token names the map's content, so an unchanged map
        is not put again); None when ``sink`` is not in a symmetric output, not 16-byte
        aligned, or a source sends more than ``map_entries`` splits.

        Cached on the plan for the last few sinks. The key names the allocation by slot and
        generation (a freed slot's next allocation may contain the same address at another
        offset) and the sink's address and row size."""
        st = self._require()
        a = st.output_index(sink)
        if a is None or rb == 0 or sink.data_ptr() % 16:
            return None
        key = (a, st.output_gen[a], sink.data_ptr(), rb)
        maps = _recent(
            plan,
            "native-maps",
            key,
            lambda: self._build_maps(plan, a, sink.data_ptr() - st.output_spans[a][0], rb),
        )
        return maps or None

    def _build_maps(self, plan: CastPlan, a: int, offset: int, rb: int):
        """The maps of :meth:`_direct_maps` for a sink ``offset`` bytes into output ``a``, or
        False when a source sends more splits than a map row holds."""
        st = self._require()
        sources = [s for s in range(self.world_size) if s != self.rank and plan.recv_counts[s] > 0]
        if any(len(plan.recv_split_ids[s]) >= st.map_width for s in sources):
            return False
        starts = [0]
        for n in plan.output_split_sizes:
            starts.append(starts[-1] + n * rb)
        rows = [[1 + a] + [offset + starts[j] for j in plan.recv_split_ids[s]] for s in sources]
        with torch.cuda.stream(st.stream):  # ahead of the puts reading it
            table = _to_device(torch.tensor([x for row in rows for x in row], dtype=torch.int64), st.device)
        maps, pos = {}, table.data_ptr()
        for s, row in zip(sources, rows):
            st.map_tokens += 1
            maps[s] = (pos, 8 * len(row), st.map_tokens)
            pos += 8 * len(row)
        return table, maps

    def _terms(self, plan, R: int, device, E: int):
        """The fused reduction's tables on ``device`` for rows of ``E`` elements: term rows,
        self flags, term counts (:func:`build_reduce_terms`), the rows each tile waits for
        (:func:`reduce_waits`), the order its tiles take (:func:`arrival_order`) and where
        each peer term lies in its source's input (:func:`build_pull_terms`)."""
        tile = self._kernels.reduce_tile_rows(E, True)
        key = ("native-terms", str(device), R, tile)
        terms = plan._on_device.get(key)
        if terms is None:
            host = build_reduce_terms(plan, R)
            need = reduce_waits(*host, self.rank, self.world_size, R, tile)
            order = arrival_order(need, plan.recv_counts)
            pull = build_pull_terms(plan, *host, R)
            with torch.cuda.stream(self._require().stream):  # ahead of the kernel reading them
                terms = tuple(_to_device(t, device) for t in (*host, need, order, pull))
            plan._on_device[key] = terms
        return terms

    def _publish_table(self, plan, src: torch.Tensor, rb: int, fused: bool, out: torch.Tensor | None = None):
        """``(address, pulled)`` of the publish table a reduce of ``src`` (rows of ``rb``
        bytes) into ``out`` sends with: its pair splits' offsets when ``fused`` and ``src``
        lies 16-byte aligned in a symmetric output and does not overlap ``out`` (our own
        reduction writes ``out`` while receivers may still read ``src``): receivers that
        accept may read the rows there (``pulled``); else header 0 for every destination.
        Cached on the plan: the header-0 table, and the pull maps of the last few inputs,
        keyed like the direct-mode maps."""
        st = self._require()
        apart = out is None or not _overlap(src, out)
        a = st.output_index(src) if fused and apart and rb % 16 == 0 and src.data_ptr() % 16 == 0 else None

        def build(pull):
            with torch.cuda.stream(st.stream):  # ahead of the send kernel reading it
                return _to_device(publish_table(plan, st.map_width, pull), st.device)

        if a is None:
            table = plan._on_device.get("native-publish-0")
            if table is None:
                table = plan._on_device["native-publish-0"] = build(None)
            return table.data_ptr(), False
        key = (a, st.output_gen[a], src.data_ptr(), rb)
        table = _recent(
            plan, "native-publish", key, lambda: build((a, src.data_ptr() - st.output_spans[a][0], rb))
        )
        return table.data_ptr(), True

    def _done_words(self, plan) -> tuple[int, ...]:
        """The fused reduction's end-step words of this call (after the transport counted it):
        per peer, the pair's epoch as a destination and as a source (0: no rows that way)."""
        st = self._require()
        return tuple(
            pack_done(
                st.arms_seen[c] if c != self.rank and plan.send_counts[c] else 0,
                st.arms_made[c] if c != self.rank and plan.recv_counts[c] else 0,
            )
            for c in range(self.world_size)
        )

    def _fused_reduce_ok(self, plan, input: torch.Tensor, rb: int, reduce_op: str) -> int:
        """Rows per region when the fused reduction applies to this call (``input`` has rows of
        ``rb`` bytes), else 0."""
        if not self.config.fused_reduce or reduce_op == "lse":
            return 0
        if rb == 0 or input.dim() < 1:
            return 0
        R = self._rows_per_region((rb,))
        return R if self._schedule(plan, R, SINK_NONE).num_rounds <= 1 else 0

    def _run(self, tensors, body, output, async_op: bool, torch_ops: bool = True) -> GroupCollectiveWork:
        """Run ``body`` on the group stream, after the caller's stream; the handle's wait orders
        the caller's stream after it. ``torch_ops``: the body runs torch ops (they need the group
        stream as the current one; the kernel launches and signals name it explicitly)."""
        st = self._require()
        cur = torch.cuda.current_stream(st.device.index)
        st.stream.wait_stream(cur)
        if torch_ops:
            with torch.cuda.stream(st.stream), torch.no_grad():
                keep = body()
        else:
            keep = body()
        event = torch.cuda.Event()
        event.record(st.stream)
        for t in tensors:
            if t is not None:
                t.record_stream(st.stream)
        handle = GroupCollectiveWork(output, [_EventWork(event, st.device.index)], None, keepalive=keep)
        if not async_op:
            handle.wait()
        return handle

    # ---- collectives -----------------------------------------------------------------------

    def group_cast(
        self, input: torch.Tensor, output: torch.Tensor, plan: CastPlan, async_op: bool
    ) -> GroupCollectiveWork:
        """Cast ``input`` ``(N_in, *row)`` rows into ``output`` ``(N_out, *row)`` (any dtype)."""
        self._check_device(input, output)

        def body():
            src = input.contiguous()
            sink = (
                output
                if output.is_contiguous()
                else torch.empty_like(output, memory_format=torch.contiguous_format)
            )
            rb = _row_bytes(src)
            direct = self._direct_maps(plan, sink, rb)
            maps = direct[1] if direct else None
            self._transport(plan, SINK_SCATTER, [_Field(src, sink, rb)], maps=maps)
            if sink is not output:
                output.copy_(sink)
            return (src, sink, direct)  # the map table stays alive until the puts read it

        plain = input.is_contiguous() and output.is_contiguous()  # then no torch op runs in body
        return self._run((input, output), body, output, async_op, torch_ops=not plain)

    def group_reduce(
        self,
        input: torch.Tensor,
        output: torch.Tensor,
        plan: ReducePlan,
        async_op: bool,
        reduce_op: str,
        input_lse: torch.Tensor | None,
        output_lse: torch.Tensor | None,
        acc_reduce: bool,
    ) -> GroupCollectiveWork:
        """Reduce ``input`` ``(N_in, *row)`` rows into ``output`` ``(N_out, *row)`` (float dtypes);
        for ``"lse"`` also ``input_lse`` ``(N_in, heads)`` into ``output_lse`` ``(N_out, heads)``."""
        self._check_device(input, output, input_lse, output_lse)
        st = self._require()

        rb = _row_bytes(input)
        R = self._fused_reduce_ok(plan, input, rb, reduce_op)

        def fused():
            # Terms are read where they lie: own rows in the input, peer rows in the regions or,
            # for a source that lets this rank pull, in that source's input.
            src = input.contiguous()
            out = output if output.is_contiguous() else output.contiguous()
            E = torch.Size(out.shape[1:]).numel()
            term_row, term_self, nterms, need, order, term_pull = self._terms(plan, R, out.device, E)
            pub, pulled = self._publish_table(plan, src, rb, fused=True, out=out)

            def consume(stream, words):
                waits = None
                if words is not None:  # beside the transfer: wait for the peers' rows
                    waits = (
                        need,
                        order,
                        st.sig.data_ptr(),
                        words,
                        self.config.max_programs or _CONSUMER_PROGRAMS,
                    )
                end = (
                    st.handshake,
                    st.reduce_counter,
                    st.pull_decided.data_ptr(),
                    self._done_words(plan),
                    pulled,
                )
                self._kernels.launch_reduce(
                    out.view(out.shape[0], E),
                    src.view(src.shape[0], E),
                    st.buf,
                    term_row,
                    term_self,
                    nterms,
                    acc_reduce=acc_reduce,
                    average=reduce_op == "avg",
                    stream=stream,
                    waits=waits,
                    pull=(term_pull, st.pull_maps.data_ptr(), st.output_bases.data_ptr(), st.map_width),
                    end=end,
                )

            self._transport(plan, SINK_NONE, [_Field(src, src, rb)], consume=consume, pub=pub)
            if out is not output:
                output.copy_(out)
            return (src, out)

        def staged():
            # Rows land in a receive scratch laid out like a2av's; the shared torch reduction follows.
            src = input.contiguous()
            recv = st.scratch_rows("data", plan.num_recv_rows, output)
            fields = [_Field(src, recv, rb)]
            src_lse = recv_lse = None
            if reduce_op == "lse":
                src_lse = input_lse.contiguous()
                recv_lse = st.scratch_rows("lse", plan.num_recv_rows, input_lse)
                fields.append(_Field(src_lse, recv_lse, _row_bytes(src_lse)))
            self._transport(plan, SINK_CONCAT, fields, pub=self._publish_table(plan, src, rb, fused=False)[0])
            idx = plan.indices_on(output.device)
            reduce_received(output, output_lse, recv, recv_lse, idx, reduce_op, acc_reduce)
            return (src, src_lse)

        body = fused if R else staged
        plain = bool(R) and input.is_contiguous() and output.is_contiguous()
        return self._run((input, output, input_lse, output_lse), body, output, async_op, torch_ops=not plain)


register_backend("native", NativeBackend)
