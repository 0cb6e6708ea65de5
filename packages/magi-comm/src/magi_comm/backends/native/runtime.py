"""The process's NVSHMEM runtime: bootstrapped once from a torch.distributed group, one per process.

NVSHMEM allocations are collective over all PEs, so the first group that creates a native
backend owns the runtime and another group is refused. ``packages/magi-comm/docs/native.md``
("Runtime").
"""

from __future__ import annotations

import logging
import os
import re
from typing import TYPE_CHECKING

import torch

from .config import MIB, NativeConfig, unavailable
from .platform import CudaPlatform, process_platform

if TYPE_CHECKING:
    from .group_state import GroupState

__all__ = ["Runtime", "peer_view", "shutdown"]

logger = logging.getLogger(__name__)


class Runtime:
    """The process's NVSHMEM runtime and the state of the group it serves.

    Attributes:
        platform: where the runtime came from (its ``runtime`` is this object).
        members: global ranks of the group that bootstrapped it.
        rank, world: this process's PE and the number of PEs (= group rank and size).
        device: CUDA ordinal of this process's GPU.
        nvc, nvb: ``nvshmem.core`` and ``nvshmem.bindings``.
        states: the group's shared state (at most one entry: the members), while backends use it.
        heap_bytes: the symmetric heap's size (``$NVSHMEM_SYMMETRIC_SIZE``, `parse_size`; what
            this runtime asked for when unset; 0 when unreadable): ``NativeBackend.reserve_rows``
            grows the receive buffer only within it.
    """

    def __init__(
        self,
        platform,
        members: tuple[int, ...],
        rank: int,
        world: int,
        device: int,
        nvc,
        nvb,
        heap_bytes: int,
    ) -> None:
        self.heap_bytes = heap_bytes
        self.platform = platform
        self.members = members
        self.rank = rank
        self.world = world
        self.device = device
        self.nvc = nvc
        self.nvb = nvb
        self.states: dict[tuple[int, ...], GroupState] = {}

    @classmethod
    def acquire(cls, platform, group, rank: int, world: int, config: NativeConfig) -> Runtime:
        """The platform's runtime, bootstrapped from ``group`` on first use (collective then:
        rank 0 creates the unique id, a broadcast hands it out). Raises
        :class:`~magi_comm.BackendUnavailableError` for another group or without nvshmem4py."""
        dist = platform.dist
        members = tuple(dist.get_process_group_ranks(group))
        with platform.lock:
            rt = platform.runtime
            if rt is not None:
                if rt.members != members:
                    raise unavailable(
                        f"this process's NVSHMEM runtime belongs to the group of global ranks "
                        f"{list(rt.members)}; a native backend for the group {list(members)} would need "
                        f"collective NVSHMEM allocations over other ranks (one runtime per process)"
                    )
                return rt
            device = platform.cuda.current_device()
            vmm = nvshmem_vmm_on()
            heap = default_heap_bytes(config.aligned_buffer_bytes(), platform.device_memory(device), vmm)
            try:
                nvc, nvb, Device = platform.nvshmem(heap)
            except ImportError as e:
                raise unavailable(f"nvshmem4py / cuda.core cannot be imported ({e})") from e
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
            heap = parse_size(os.environ.get("NVSHMEM_SYMMETRIC_SIZE", ""), heap)
            logger.info(
                "magi_comm native: NVSHMEM %s initialized, PE %d/%d, symmetric heap %.0f MiB "
                "(NVSHMEM_DISABLE_CUDA_VMM %s)",
                nvc.get_version(),
                rank,
                world,
                heap / MIB,
                "unset or false" if vmm else "set",
            )
            rt = platform.runtime = cls(platform, members, rank, world, device, nvc, nvb, heap)
            return rt


def default_heap_bytes(buffer_bytes: int, device_bytes: int, vmm: bool) -> int:
    """The symmetric heap asked for when ``$NVSHMEM_SYMMETRIC_SIZE`` is unset: the receive
    buffer (``buffer_bytes``) and its growth must fit, so at least 1 GiB and 4 buffers; with
    NVSHMEM's CUDA VMM heap (``vmm``; on by default in the kit's NVSHMEM on H100, where the
    measurement below was taken) also an eighth of the GPU's ``device_bytes``.

    Why the eighth: a VMM heap maps memory as allocations take it, so its size costs nothing
    until then (measured on H100: NVSHMEM's init took 2932 MiB with a 1 GiB heap and with an
    8 GiB one), and it is the budget `NativeBackend.reserve_rows` grows the receive buffer
    within (half of it). A buffer that does not fit sends a reduce in rounds on the staged path:
    at cp 4 and 128k tokens (Hk 8, D 128) the degree-0 backward's float32 partials needed a
    buffer of about 0.8 GB, past a 1 GiB heap's half, and the step ran 2-5% slower
    (docs/perf.md). Without VMM NVSHMEM maps the whole heap at init: then only the floor."""
    floor = max(1024 * MIB, 4 * buffer_bytes)
    return max(floor, device_bytes // 8) if vmm else floor


def nvshmem_vmm_on() -> bool:
    """Whether NVSHMEM will take its heap through CUDA VMM: unless
    ``$NVSHMEM_DISABLE_CUDA_VMM`` is set true (NVSHMEM's boolean spellings)."""
    raw = os.environ.get("NVSHMEM_DISABLE_CUDA_VMM", "").strip().lower()
    return raw in ("", "0", "n", "no", "f", "false", "off")


_SIZE = re.compile(r"\s*(\d+)\s*([kmgt]?)b?\s*", re.IGNORECASE)


def parse_size(raw: str, default: int) -> int:
    """Bytes of a size as NVSHMEM reads ``$NVSHMEM_SYMMETRIC_SIZE`` (a number, optionally with
    K / M / G / T, powers of 1024); ``default`` when ``raw`` is empty, 0 when it cannot be read
    (then nothing may grow into the heap: its size is unknown)."""
    if not raw.strip():
        return default
    m = _SIZE.fullmatch(raw)
    if m is None:
        return 0
    return int(m.group(1)) << (10 * " kmgt".index(m.group(2).lower() or " "))


def shutdown(platform: CudaPlatform | None = None) -> None:
    """Finalize the NVSHMEM runtime (collective). All native backends must be closed first.

    ``platform``: the one the backends were created with (default: this process's)."""
    platform = platform or process_platform()
    with platform.lock:
        rt = platform.runtime
        if rt is None:
            return
        if rt.states:
            raise RuntimeError(
                "magi_comm native: shutdown() with native backends still open; close them first"
            )
        rt.nvc.finalize()
        platform.runtime = None


def peer_view(nvc, buf: torch.Tensor, rank: int, pe: int) -> torch.Tensor:
    """How rows reach peer ``pe``: today an NVLink-mapped view of its ``buf`` (the seam where an
    internode put path would plug in, docs/native.md "Internode seam")."""
    if pe == rank:
        return buf
    try:
        return nvc.get_peer_tensor(buf, pe)
    except Exception as e:  # nvshmem_ptr returned NULL: the peer is not load/store reachable
        raise unavailable(
            f"PE {pe} is not reachable by NVLink load/store from PE {rank} ({e}); the internode "
            f"NVSHMEM put path is not implemented yet (packages/magi-comm/docs/native.md, 'Internode seam')"
        ) from e
