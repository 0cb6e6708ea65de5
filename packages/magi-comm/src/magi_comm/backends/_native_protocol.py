"""Signal slots of the ``native`` backend and the handshake a copy kernel performs itself.

Pure Python (no triton): the backend, the kernels and the CPU fakes share these definitions.

Every rank owns a symmetric int64 signal array ``(NUM_SIGNALS, W)``: slot ``(kind, c)`` counts
the signals of that kind peer ``c`` sent this rank. Every signal adds 1 (NVSHMEM's
``SIGNAL_ADD`` from the host path, a system-scope release ``atomic_add`` from a kernel), so both
paths may serve the same pair in turn; a waiter knows how many signals to expect because both
ends of a pair count the calls and rounds alike (see :mod:`magi_comm.backends.native`).

Device handshake (calls of one round and one field): instead of NVSHMEM's on-stream signal and
wait kernels around the copy, the copy kernels do the steps themselves:

* ``ARM_AND_WAIT`` (send kernel, start): program 0 adds 1 to ``ARM`` slot ``rank`` on each
  source flagged ``arm_now``; every program waits until its own ``ARM`` slot of each destination
  reaches ``arm_wait``.
* ``READY_END`` (send kernel, end): the last program to finish adds 1 to ``READY`` slot
  ``rank`` on each destination (every program's stores are released before, through a
  system-scope counter).
* ``WAIT_READY_END`` (send kernel, end): the last program then waits until the ``READY``
  slot of each source reaches ``ready_wait``; the kernels after it on the stream (a receive
  copy, a fused reduction, the caller's work) find the peers' rows in place. One program
  waits, not every program of the next kernel: waiting programs hold SM slots that an
  attention kernel running beside the transfer could use.

Progress (overlap of the receive step with the transfer): the send kernel works through its
blocks in *chunks* (every program takes its share of chunk ``j`` before any block of chunk
``j + 1``); the last program to finish chunk ``j`` raises slot ``(PROGRESS, rank)`` on each
destination to :func:`progress_value` ``(epoch, rows)``, where ``rows`` is how many leading rows
of that destination's region are complete (``SIGNAL_PROGRESS``). The receive copy / fused
reduction then runs beside the send kernel, on a second stream, and each of its programs
waits, before reading region rows of source ``s``, until that slot covers them or until
``s``'s ``READY`` count is reached (``AWAIT_ROWS``): a sender that signals no progress (host
path, another configuration) still releases the rows through ``READY``. The ``epoch`` is the
pair's call count (the ``ARM`` count: the destination's arms of that source), so a value from
an earlier call never passes, and the slot only grows (atomic max): no reset.

Pull (group_reduce from a symmetric input): a receiver whose call takes the fused reduction
*accepts pulls*: its arm first puts ``PULL_ACCEPT`` into its word of each source's accept
array (``0`` when it does not accept; put only when the word changes). A send launch of a
reduce publishes, per destination, a header into the destination's *pull map* row (program 0,
before the ready signal): where the destination accepts pulls and the sender's input lies in
the symmetric heap, ``[1 + allocation, byte offset of each pair split]`` (and the rows for
that destination are not sent: the receiver reads them from the sender's input over NVLink),
else ``0`` (the rows are in the receiver's region). The fused reduction reads each source's
header after that source's ready signal. Its last program then raises slot ``(DONE, rank)``
on every source to the pair's epoch (atomic max, like ``PROGRESS``: no count to agree on),
and a sender waits there for ``DONE`` of each destination its send left the rows to before
its call ends (the caller may overwrite its input afterwards). That decision is the send
launch's own record (``2 * epoch + pulled`` per destination), not the accept word, which the
destination may already have changed for its next call. Every rank reduces before it waits,
so this cannot deadlock.

Per call the kernel gets one packed int64 per peer (:func:`pack_peer`): the waits change with
every call, and Triton must not specialize on them (the tag bit keeps them 64-bit). The fused
reduction's end step takes a second set (:func:`pack_done`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ACK",
    "ARM",
    "ARM_AND_WAIT",
    "AWAIT_ROWS",
    "DONE",
    "MAX_REPORTING_PROGRAMS",
    "NUM_SIGNALS",
    "PEER_WORDS",
    "PROGRESS",
    "PULL_ACCEPT",
    "READY",
    "READY_END",
    "SIGNAL_PROGRESS",
    "WAIT_READY_END",
    "Handshake",
    "pack_done",
    "pack_peer",
    "progress_value",
    "unpack_peer",
]

READY, ACK, ARM, PROGRESS, DONE = 0, 1, 2, 3, 4
NUM_SIGNALS = 5

PULL_ACCEPT = 1  # a receiver's accept word: leave my rows in your input, I read them there

ARM_AND_WAIT = 1
READY_END = 2
WAIT_READY_END = 4
SIGNAL_PROGRESS = 8  # send kernel: raise the destinations' PROGRESS slots chunk by chunk
AWAIT_ROWS = 16  # receive copy / fused reduction: wait for each source's rows before reading them

PEER_WORDS = 8  # packed per-peer words a kernel takes (MAX_PEERS)
MAX_REPORTING_PROGRAMS = 1024  # copying programs of a send launch that reports its progress
_TAG = 1 << 62
_ARM_BITS = 30  # arm_wait < 2**30, ready_wait < 2**31: a billion calls per pair


@dataclass(frozen=True)
class Handshake:
    """Where a kernel performs the handshake: fixed for a group's lifetime.

    Attributes:
        sig: address of this rank's int64 ``(NUM_SIGNALS, W)`` signal array.
        sig_peers: address of an int64 ``(W,)`` device table: peer ``c``'s signal array as
            this rank's NVLink-mapped address (its own for ``c == rank``).
        counter: address of a local int32, zero between launches (finished programs).
        rank: this rank (the slot index it signals into on peers).
    """

    sig: int
    sig_peers: int
    counter: int
    rank: int


def pack_peer(arm_wait: int = 0, ready_wait: int = 0, arm_now: bool = False) -> int:
    """One peer's word for a handshake launch: the ``ARM`` count to wait for (it is a
    destination when > 0), the ``READY`` count to wait for (a source when > 0), and whether
    this launch arms it."""
    if not (0 <= arm_wait < 1 << _ARM_BITS and 0 <= ready_wait < 1 << 31):
        raise ValueError(f"signal counts out of range: arm_wait={arm_wait}, ready_wait={ready_wait}")
    return _TAG | arm_wait << 32 | ready_wait << 1 | int(bool(arm_now))


def unpack_peer(word: int) -> tuple[int, int, bool]:
    """Inverse of :func:`pack_peer`: ``(arm_wait, ready_wait, arm_now)``."""
    return (word >> 32) & ((1 << _ARM_BITS) - 1), (word >> 1) & ((1 << 31) - 1), bool(word & 1)


def pack_done(dst_epoch: int = 0, src_epoch: int = 0) -> int:
    """One peer's word for the fused reduction's end step: the pair's epoch as a destination
    of this rank (> 0: wait for its ``DONE`` if it pulled this rank's rows) and as a source
    (> 0: raise its ``DONE`` slot if this rank pulled its rows). Same layout as
    :func:`pack_peer` (``arm_wait``, ``ready_wait``)."""
    return pack_peer(dst_epoch, src_epoch)


def progress_value(epoch: int, rows: int) -> int:
    """A ``PROGRESS`` slot value: call ``epoch`` of the pair has its first ``rows`` region rows
    in place (ordered by epoch first, so the slot only ever grows)."""
    if not (0 <= epoch < 1 << _ARM_BITS and 0 <= rows < 1 << 32):
        raise ValueError(f"progress out of range: epoch={epoch}, rows={rows}")
    return epoch << 32 | rows


IDLE_WORD = pack_peer()  # a peer the launch neither waits for nor signals
