"""The native backend's settings: :class:`NativeConfig` and the environment variables it reads.

What each setting trades: ``packages/magi-comm/docs/native.md``; the variables are listed in
magi-comm's README.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from .. import BackendUnavailableError

__all__ = [
    "ENV_BUFFER_MB",
    "ENV_DEVICE_HANDSHAKE",
    "ENV_FUSED_REDUCE",
    "ENV_KNOWN_ARMS",
    "ENV_MAX_PROGRAMS",
    "ENV_ONE_LAUNCH_PULL",
    "ENV_OVERLAP_CHUNK_KB",
    "ENV_REDUCE_ROWS",
    "ENV_REDUCE_WARPS",
    "ENV_STREAM_PRIORITY",
    "ENV_WAIT_TIMEOUT",
    "MIB",
    "OVERLAP_MIN_CHUNKS",
    "NativeConfig",
    "unavailable",
    "wait_timeout_s",
]

ENV_BUFFER_MB = "MAGI_COMM_NATIVE_BUFFER_MB"
ENV_FUSED_REDUCE = "MAGI_COMM_NATIVE_FUSED_REDUCE"
ENV_STREAM_PRIORITY = "MAGI_COMM_NATIVE_STREAM_PRIORITY"
ENV_MAX_PROGRAMS = "MAGI_COMM_NATIVE_MAX_PROGRAMS"
ENV_DEVICE_HANDSHAKE = "MAGI_COMM_NATIVE_DEVICE_HANDSHAKE"
ENV_OVERLAP_CHUNK_KB = "MAGI_COMM_NATIVE_OVERLAP_CHUNK_KB"
ENV_WAIT_TIMEOUT = "MAGI_COMM_NATIVE_WAIT_TIMEOUT_S"
ENV_REDUCE_ROWS = "MAGI_COMM_NATIVE_REDUCE_ROWS"
ENV_REDUCE_WARPS = "MAGI_COMM_NATIVE_REDUCE_WARPS"
ENV_COPY_ENGINE = "MAGI_COMM_NATIVE_COPY_ENGINE"
ENV_REDUCE_PROGRAMS = "MAGI_COMM_NATIVE_REDUCE_PROGRAMS"
ENV_ONE_LAUNCH_PULL = "MAGI_COMM_NATIVE_ONE_LAUNCH_PULL"
ENV_KNOWN_ARMS = "MAGI_COMM_NATIVE_KNOWN_ARMS"
DEFAULT_WAIT_TIMEOUT_S = 600.0  # NCCL's default process-group timeout
MIB = 1 << 20
OVERLAP_MIN_CHUNKS = 4  # chunks a pair moves before its progress is reported
# NativeConfig's integer fields set from the environment (overlap_chunk_bytes in KiB)
# switches: a set variable turns the field off with 0 / false / no / off, on with anything else;
# an unset (or empty) one leaves the field's default
_BOOL_ENVS = {
    "fused_reduce": ENV_FUSED_REDUCE,
    "device_handshake": ENV_DEVICE_HANDSHAKE,
    "copy_engine": ENV_COPY_ENGINE,
    "one_launch_pull": ENV_ONE_LAUNCH_PULL,
    "known_arms": ENV_KNOWN_ARMS,
}
_INT_ENVS = {
    "stream_priority": ENV_STREAM_PRIORITY,
    "max_programs": ENV_MAX_PROGRAMS,
    "overlap_chunk_bytes": ENV_OVERLAP_CHUNK_KB,
    "reduce_tile_rows": ENV_REDUCE_ROWS,
    "reduce_warps": ENV_REDUCE_WARPS,
    "reduce_programs": ENV_REDUCE_PROGRAMS,
}
CONSUMER_PROGRAMS = 128  # grid of a waiting receive step when max_programs is 0 (unbounded)


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
            kernels (docs/native.md, "Handshake in the kernels") instead of through
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
        reduce_tile_rows / reduce_warps: rows per tile and warps per program of the fused
            reduction when it runs after the transfer (``$MAGI_COMM_NATIVE_REDUCE_ROWS`` /
            ``_WARPS``; 0: the kernel's defaults, tuned on one GPU for local reads, see
            ``kernels.reduce_tile_rows``; powers of two). A reduction that pulls its terms from
            the peers' inputs reads over NVLink, where other shapes might keep more bytes in
            flight; on 2x H100 none of 7 other shapes beat the defaults at 16 and 64 MiB
            (``tools/bench_comm.py --sweep-reduce``, docs/perf.md): a knob for other machines. A reduction beside the transfer keeps the
            defaults (its wait tables are cut by them).
        copy_engine: a fused reduce's send moves its rows into the peers' regions by the copy
            engines (one ``cudaMemcpyAsync`` per task and destination, then a launch without
            rows that publishes the pull headers and signals) instead of by the copy kernel's
            programs, so the SMs stay with a kernel running beside the transfer: beside a
            backward kernel, a copy-engine copy of 256 MB cost it 0.2-0.4 ms where the fused
            reduce's send and reduction cost it 0.7-1.2 ms (docs/perf.md, "The backward
            beside its reduce"). Its inputs are never pulled, and it reports no progress (the
            reduction follows the transfer, so ``overlap_reduce`` does not apply), and it needs
            ``fused_reduce`` (the staged reduce and the casts keep the copy kernel).
            ``$MAGI_COMM_NATIVE_COPY_ENGINE=1``; off by default.
        reduce_programs: most programs of the fused reduction after the transfer (they stride
            over its tiles; ``$MAGI_COMM_NATIVE_REDUCE_PROGRAMS``; 0, the default: one per
            tile). A knob for a reduction that runs beside a kernel (the backward beside its
            dK/dV reduce): a capped grid takes fewer of its SMs, for a longer reduction.
        one_launch_pull: on 2 ranks, a fused group_reduce whose rows for the peer are left for
            pulling runs as one launch of the fused reduction, which arms, awaits the peer's
            arm, publishes its pull header, signals ready and awaits the peer's ready itself
            (docs/native.md, "One launch on 2 ranks"): 72% -> 77% of the raw copy at 64 MiB,
            59% -> 65% at 16 MiB on 2x H100 (docs/perf.md). ``$MAGI_COMM_NATIVE_ONE_LAUNCH_PULL=0``
            turns it off. It needs ``fused_reduce`` alike on both ranks, in every backend of the
            group (compared when the group is set up).
        known_arms: a one-launch reduce whose previous call to the peer was a pulled one launch
            too publishes without awaiting the peer's arm (docs/native.md, "The arm known"):
            +2.4-4.6% GB/s at 16 MiB, +0.9-1.1% at 64 MiB on 2x H100 (docs/perf.md). A program
            that creates its backends differently on the two ranks (one rank's call staged
            while the other takes one launch) still ends in an error on both, before the staged
            rank copies a row (its receive copy checks that no source left rows to pull).
            ``$MAGI_COMM_NATIVE_KNOWN_ARMS=0`` turns it off.
    """

    buffer_bytes: int = 256 * MIB
    block_bytes: int = 16384
    num_warps: int = 8
    growth_factor: float = 2.0
    fused_reduce: bool = True
    map_entries: int = 8192
    max_outputs: int = 64
    stream_priority: int = -1
    max_programs: int = 128
    device_handshake: bool = True
    overlap_chunk_bytes: int = 8 * MIB
    overlap_reduce: bool = False
    reduce_tile_rows: int = 0
    reduce_warps: int = 0
    copy_engine: bool = False
    reduce_programs: int = 0
    one_launch_pull: bool = True
    known_arms: bool = True

    def __post_init__(self) -> None:
        for name in ("reduce_tile_rows", "reduce_warps"):
            value = getattr(self, name)
            if value < 0 or value & (value - 1):
                raise ValueError(f"{name} must be 0 (the default) or a power of two, got {value}")
        if self.reduce_programs < 0:
            raise ValueError(f"reduce_programs must be >= 0 (0: one per tile), got {self.reduce_programs}")
        if self.max_programs < 0:
            raise ValueError(f"max_programs must be >= 0 (0: one program per block), got {self.max_programs}")
        if self.overlap_chunk_bytes < 0:
            raise ValueError(
                f"overlap_chunk_bytes must be >= 0 (0: no overlap), got {self.overlap_chunk_bytes}"
            )

    @staticmethod
    def from_env() -> NativeConfig:
        """The defaults, overridden by the ``MAGI_COMM_NATIVE_*`` variables that are set; a bad
        value raises ValueError naming its variable."""
        kw: dict[str, Any] = {}  # NativeConfig's keyword arguments (the defaults where unset)
        for field, env in _BOOL_ENVS.items():
            value = os.environ.get(env, "").strip().lower()
            if value:
                kw[field] = value not in ("0", "false", "no", "off")
        scale = {"overlap_chunk_bytes": 1024}
        for field, env in _INT_ENVS.items():
            value = os.environ.get(env, "").strip()
            if value:
                try:
                    kw[field] = int(value) * scale.get(field, 1)
                except ValueError:
                    raise ValueError(f"${env} must be an integer, got {value!r}") from None
        mb = os.environ.get(ENV_BUFFER_MB)
        if mb:
            try:
                kw["buffer_bytes"] = int(float(mb) * MIB)
            except ValueError:
                raise ValueError(f"${ENV_BUFFER_MB} must be a number of MiB, got {mb!r}") from None
            if kw["buffer_bytes"] <= 0:
                raise ValueError(f"${ENV_BUFFER_MB} must be positive, got {mb!r}")
        try:
            return NativeConfig(**kw)
        except ValueError as e:  # name the variable the bad value came from (messages start with the field)
            env = next(env for field, env in _INT_ENVS.items() if str(e).startswith(field))
            raise ValueError(f"${env}: {e}") from None

    def aligned_buffer_bytes(self) -> int:
        """``buffer_bytes`` rounded up to whole MiB (at least one)."""
        return max(MIB, (self.buffer_bytes + MIB - 1) // MIB * MIB)


def wait_timeout_s() -> float:
    """Seconds a kernel waits for a peer's signal before it gives up (``$MAGI_COMM_NATIVE_WAIT_TIMEOUT_S``,
    default 600): a peer that died then ends the wait with an error (the kernel traps) instead
    of a hang. Read once, when the kernels are imported (they are compiled with it)."""
    value = os.environ.get(ENV_WAIT_TIMEOUT, "").strip()
    if not value:
        return DEFAULT_WAIT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"${ENV_WAIT_TIMEOUT} must be a number of seconds, got {value!r}") from None
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"${ENV_WAIT_TIMEOUT} must be a positive finite number of seconds, got {value!r}")
    return seconds


def unavailable(reason: str) -> BackendUnavailableError:
    """The error for a native backend that cannot run here, with ``reason`` and the way out."""
    return BackendUnavailableError(
        f"magi_comm backend 'native' is unavailable: {reason}. It needs CUDA GPUs of one node and "
        f"the [native] extra (nvshmem4py-cu13) and triton (part of CUDA builds of torch); use backend='a2av' (the default) or unset "
        f"MAGI_COMM_BACKEND."
    )
