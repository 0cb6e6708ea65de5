"""The signalling protocol's constants: signal slots, handshake step bits, packed per-peer words.

Pure Python (no triton): the host path, the kernels and the CPU fakes share these definitions.
What the slots mean and who raises them: ``packages/magi-comm/docs/native.md`` ("Signals").
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
    "MSG_PULLS_REFUSED",
    "MSG_PULLS_UNACCEPTED",
    "NUM_SIGNALS",
    "PEER_WORDS",
    "PROGRESS",
    "PULL_ACCEPT",
    "READY",
    "READY_END",
    "SIGNAL_PROGRESS",
    "WAIT_READY_END",
    "Handshake",
    "arm_known",
    "check_copy_roles",
    "pack_done",
    "pack_peer",
    "progress_value",
    "refuse_known_arms",
    "unpack_peer",
]

# Rows of a rank's int64 signal array (NUM_SIGNALS, W); slot (kind, c) holds what peer c raised.
READY, ACK, ARM, PROGRESS, DONE = 0, 1, 2, 3, 4
NUM_SIGNALS = 5

PULL_ACCEPT = 1  # a receiver's accept word: leave my rows in your input, I read them there

# The errors of a pair whose ranks disagree on pulling (backends created differently on the two
# ranks; docs/native.md, "The arm known"): the kernels stop with them (compiled: a trap) rather
# than let a receiver read stale rows. Seen at the one-launch source (the destination's accept
# word says it does not pull) and at a staged receiver (a source published a pull map for it).
MSG_PULLS_REFUSED = "magi_comm native: a one-launch reduce's destination does not accept pulls"
MSG_PULLS_UNACCEPTED = (
    "magi_comm native: a source left its rows for pulling to a receiver that does not accept pulls"
)

# Handshake steps a kernel launch performs itself (bits of its ``sync`` argument).
ARM_AND_WAIT = 1  # start: program 0 arms the sources, every program awaits the destinations' arms
READY_END = 2  # end: the last program signals READY to the destinations
WAIT_READY_END = 4  # end: the last program then awaits the sources' READY
SIGNAL_PROGRESS = 8  # send kernel: raise the destinations' PROGRESS slots chunk by chunk
AWAIT_ROWS = 16  # receive copy / fused reduction: wait for each source's rows before reading them

PEER_WORDS = 8  # packed per-peer words a kernel takes (MAX_PEERS)
MAX_REPORTING_PROGRAMS = 1024  # copying programs of a send launch that reports its progress
_TAG = 1 << 62
_KNOWN = 1 << 63  # the sign bit of the int64 word: the kernels test ``word < 0``
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


def pack_peer(arm_wait: int = 0, ready_wait: int = 0, arm_now: bool = False, known: bool = False) -> int:
    """One peer's word for a handshake launch: the ``ARM`` count to wait for (it is a
    destination when > 0; also the pair's epoch), the ``READY`` count to wait for (a source
    when > 0), and whether this launch arms it. ``known`` (a destination of a one-launch
    reduce, docs/native.md "The arm known"): its arm is not awaited, and nothing checks it
    later. As a signed int64 (``known`` is the sign bit)."""
    if not (0 <= arm_wait < 1 << _ARM_BITS and 0 <= ready_wait < 1 << 31):
        raise ValueError(f"signal counts out of range: arm_wait={arm_wait}, ready_wait={ready_wait}")
    if known and not arm_wait:
        raise ValueError(f"known=True needs a destination (arm_wait > 0), got arm_wait={arm_wait}")
    word = _TAG | arm_wait << 32 | ready_wait << 1 | int(bool(arm_now))
    return word - _KNOWN if known else word


def arm_known(word: int) -> bool:
    """Whether a :func:`pack_peer` word says the destination's arm is known."""
    return word < 0


def check_copy_roles(*, peers, handshake, progress, waits, publish, direct, unpulled) -> None:
    """The roles a copy launch may combine (its constructor's arguments of the same names; the
    real launch and the CPU fake's share this rule): progress, waits and a publish table need a
    handshake; a launch either writes into peer outputs (``direct``: a cast) or publishes (a
    reduce); ``unpulled`` ``(pulls, map_width, sources)`` is for a staged reduce's receive copy
    alone, with a map width >= 1 and a nonzero source mask over ``len(peers)`` peers. Raises
    ValueError naming what conflicts."""
    needing = [n for n, v in (("progress", progress), ("waits", waits), ("publish", publish)) if v]
    if needing and handshake is None:
        raise ValueError(
            f"{', '.join(needing)} need a handshake (the signal slots, the rank); got handshake=None"
        )
    if publish and direct:
        raise ValueError(
            "direct (a cast into peer outputs) and publish (a reduce) exclude each other; got both"
        )
    if unpulled:
        given = {"peers": any(peers), "waits": waits, "publish": publish, "direct": direct}
        if any(v for v in given.values()):
            raise ValueError(
                "unpulled is for a receive copy that follows the transfer, without peers, waits, "
                f"publish or direct; got {', '.join(k for k, v in given.items() if v)}"
            )
        W = len(peers)
        if unpulled[1] < 1 or not 0 < unpulled[2] < 1 << W:
            raise ValueError(f"unpulled needs map_width >= 1 and sources in [1, 2**{W}), got {unpulled}")


def refuse_known_arms(words) -> None:
    """A copy launch's words carry no known arm: what makes an arm known (the peer's DONE,
    awaited) covers our pull-map row and input only, not the peer's regions a copy launch
    writes. Raises ValueError naming the first such word."""
    for c, w in enumerate(words):
        if arm_known(w):
            raise ValueError(
                f"words[{c}]: a known arm (pack_peer(known=True)) is for a one-launch reduce only, "
                f"got {w:#x} in a copy launch"
            )


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
