"""Tile / pipeline configuration of the sm90 kernels (pure Python, no cutlass import)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, ClassVar

# The kernels' int32 flag word holds, from this bit up, how many q heads run side by side in the
# CTA order (schedule.py); the bits below are the forward's feature flags.
HEAD_GROUP_SHIFT = 8

# The backward loads a q block's lse2 / delta with one bulk copy, whose source must be 16-byte
# aligned: it starts at the block's first row rounded down to 4 and takes this many more values.
STAT_PAD = 4

# (q/k head dim, v/out head dim) pairs the forward kernel compiles for; (192, 128) is
# DeepSeek-style MLA (v's head dim never exceeds q's: O reuses Q's shared memory)
FWD_HEAD_DIMS = ((64, 64), (128, 128), (256, 256), (192, 128))

# dynamic shared memory one CTA may use on sm90 (227 KiB)
SM90_SMEM_BYTES = 227 * 1024
# static shared memory of the compiled backward (cuobjdump -res-usage: SHARED 1024), which
# counts against the same 227 KiB
BWD_STATIC_SMEM_BYTES = 1024


class _KernelConfig:
    """What every kernel config derives from its fields: thread count and compile-key part."""

    num_mma_wg: int
    # set by @dataclass on every subclass (makes ``self`` a dataclass instance for the checker)
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    @property
    def num_threads(self) -> int:
        """A producer warpgroup plus the consumer warpgroups."""
        return 128 * (self.num_mma_wg + 1)

    def key(self) -> tuple:
        """Every field, in order (the compile key part of this config)."""
        return dataclasses.astuple(self)


_ELEM_BYTES = 2  # q / k / v / dout elements: bfloat16 or float16


def _align_1024(n: int) -> int:
    """``n`` rounded up to 1024 bytes, the alignment of every shared-memory tile (swizzle)."""
    return -(-n // 1024) * 1024


@dataclass(frozen=True)
class FwdConfig(_KernelConfig):
    """Static shape of one compiled forward kernel.

    Everything here is part of the JIT compile key; nothing here depends on the call's
    sequence lengths, head counts or range contents (those are runtime values). ``head_dim``
    is q's and k's head dim (Q, K, S = Q K^T), ``head_dim_v`` v's and out's (V, O = P V).
    """

    head_dim: int = 128
    tile_m: int = 128  # q rows per CTA (64 per consumer warpgroup)
    tile_n: int = 128  # k rows per K/V pipeline stage
    num_stages: int = 2  # K and V shared-memory stages (each)
    num_mma_wg: int = 2  # consumer warpgroups issuing WGMMA
    mma_regs: int = 240  # setmaxnreg for consumer warpgroups
    producer_regs: int = 24  # setmaxnreg for the TMA producer warpgroup
    intra_wg_overlap: bool = True  # overlap QK^T of block j with PV of block j-1
    pingpong: bool = True  # named-barrier ping-pong between the consumer warpgroups (with overlap)
    rescale_threshold: float = 8.0  # lazy rescaling: keep a stale row max up to 2**thr (log2 units)
    # v's (and out's) head dim; 0: the same as head_dim (set to it in __post_init__). Last, so
    # that positional fields keep their places; left out of key() when equal to head_dim.
    head_dim_v: int = 0

    def __post_init__(self) -> None:
        if self.head_dim_v == 0:
            object.__setattr__(self, "head_dim_v", self.head_dim)  # frozen: the one normalisation
        assert (self.head_dim, self.head_dim_v) in FWD_HEAD_DIMS, (
            f"(head_dim, head_dim_v) must be one of {FWD_HEAD_DIMS}, got {(self.head_dim, self.head_dim_v)}"
        )
        assert self.num_mma_wg in (2, 3), "2 or 3 consumer warpgroups (the ping-pong ring has 3 barriers)"
        assert self.tile_m == 64 * self.num_mma_wg
        assert self.tile_n % 16 == 0 and self.tile_n <= 256
        assert self.num_stages >= 2
        assert self.smem_bytes() <= SM90_SMEM_BYTES, (
            f"Q + {self.num_stages} stages of K and V need {self.smem_bytes()} bytes of shared memory, "
            f"more than {SM90_SMEM_BYTES}"
        )

    def smem_bytes(self) -> int:
        """Shared memory of the kernel's storage: the pipelines' barriers, then Q, the K stages and
        the V stages, each 1024-byte aligned (O reuses Q's buffer: head_dim_v <= head_dim)."""
        used = 8 * (2 + 4 * self.num_stages)  # mbarriers: Q (full, empty), K and V (2 per stage)
        for rows, cols, copies in (
            (self.tile_m, self.head_dim, 1),
            (self.tile_n, self.head_dim, self.num_stages),
            (self.tile_n, self.head_dim_v, self.num_stages),
        ):
            used = _align_1024(used) + rows * cols * copies * _ELEM_BYTES
        return used

    def key(self) -> tuple:
        """Every field, in order; head_dim_v only where it differs from head_dim (the keys of
        the configs that predate it stay as they were)."""
        fields = dataclasses.astuple(self)
        return fields if self.head_dim_v != self.head_dim else fields[:-1]


@functools.cache
def default_config(head_dim: int, head_dim_v: int | None = None) -> FwdConfig:
    """FA3-style choice: 128x128 tiles, 2 consumer warpgroups; hdim 64 takes 192 q rows in 3
    consumer warpgroups (its GEMMs are half as long, so a third warpgroup's softmax hides more of
    them; 3 x 128 threads at 160 registers and the producer at 32 fill the register file);
    hdim 256 takes 80 keys per stage (Q 64 KiB + 2 stages of K and V at 40 KiB each fit the
    227 KiB of shared memory; the O accumulator alone holds 128 registers per thread).
    MLA's 192 / 128 (``head_dim_v``: v's head dim, None: head_dim) keeps 128x128 tiles, as FA3
    does: Q 48 KiB + 2 stages of K (48 KiB) and V (32 KiB) = 208 KiB of shared memory (209 with
    the barriers' aligned block; 144 keys would need 227.5), and the registers of D 128 (S and
    O accumulators at 64 each per thread; ptxas reports no spills)."""
    if head_dim_v is not None and head_dim_v != head_dim:
        return FwdConfig(head_dim=head_dim, head_dim_v=head_dim_v, tile_m=128, tile_n=128, num_stages=2)
    if head_dim == 64:
        return FwdConfig(
            head_dim=64, tile_m=192, tile_n=128, num_stages=2, num_mma_wg=3, mma_regs=160, producer_regs=32
        )
    if head_dim == 256:
        return FwdConfig(head_dim=256, tile_m=128, tile_n=80, num_stages=2)
    # 128 (any other head dim fails FwdConfig's check rather than getting D 128's kernel)
    return FwdConfig(head_dim=head_dim, tile_m=128, tile_n=128, num_stages=2)


BWD_MAX_TILE_M = 128  # the tallest q block of a backward config (2 warpgroups x 64)


@dataclass(frozen=True)
class BwdConfig(_KernelConfig):
    """Static shape of one compiled backward kernel (part of its compile key).

    A CTA owns ``tile_n`` keys of one K/V head (``tile_n / num_mma_wg`` per consumer warpgroup)
    and walks ``tile_m``-row q blocks; with tile_m = 64 (one wgmma M) the dQ GEMM splits the
    head dim over the warpgroups; with 128 (D 64) the rows; with 80 (D 128: FA3's tile for
    masks without causal structure, 25% more rows per shared-memory read of the S^T / dP^T
    GEMMs) it runs transposed, dQ^T = K^T dS^T, the head dim split over the warpgroups as M.
    """

    head_dim: int = 128
    tile_m: int = 64  # q rows per block
    tile_n: int = 128  # keys per CTA
    num_stages: int = 2  # Q and dO shared-memory stages (each)
    num_mma_wg: int = 2  # consumer warpgroups issuing WGMMA
    mma_regs: int = 240  # setmaxnreg for consumer warpgroups
    producer_regs: int = 24  # setmaxnreg for the producer warpgroup (TMA producer, dQ writer)

    def __post_init__(self) -> None:
        assert self.head_dim in (64, 128), "head_dim must be 64 or 128"
        assert self.tile_m <= BWD_MAX_TILE_M  # the statistics' padding (bwd_interface.stat_stride)
        assert self.num_mma_wg == 2, "the dQ GEMM splits the head dim over 2 consumer warpgroups"
        assert self.tile_n == 64 * self.num_mma_wg
        # dQ split over the warpgroups by columns / rows, or computed transposed (80)
        assert self.tile_m in (64, 64 * self.num_mma_wg) or (self.tile_m == 80 and self.head_dim == 128)
        # the dS tile is double-buffered by block parity, read off the Q stage index
        assert self.num_stages % 2 == 0
        # setmaxnreg moves registers between the warpgroups of a CTA launched with 65536 / 384
        # = 168 per thread: an increase beyond what the decrease freed would wait forever
        assert self.producer_regs + self.num_mma_wg * self.mma_regs <= 168 * (self.num_mma_wg + 1)
        assert self.smem_bytes() <= SM90_SMEM_BYTES - BWD_STATIC_SMEM_BYTES, (
            f"the backward's tiles need {self.smem_bytes()} bytes of shared memory, more than "
            f"{SM90_SMEM_BYTES - BWD_STATIC_SMEM_BYTES}"
        )

    def smem_bytes(self) -> int:
        """Dynamic shared memory of the backward's storage (bwd_sm90.SharedStorage): the
        barriers and the per-stage lse2 / delta first, then K, V, the Q and dO stages, the two
        dS buffers and the float32 dQ tiles (tile_m x head_dim in all), each 1024-byte aligned."""
        small = 8 * (2 + 4 * self.num_stages) + 2 * 4 * (self.tile_m + STAT_PAD) * self.num_stages
        tiles = (
            2 * self.tile_n * self.head_dim * _ELEM_BYTES
            + 2 * self.num_stages * self.tile_m * self.head_dim * _ELEM_BYTES
            + 2 * self.tile_m * self.tile_n * _ELEM_BYTES
            + self.tile_m * self.head_dim * 4
        )
        return _align_1024(small) + tiles


D128_BWD_ROWS = 80  # q block rows of the D 128 backward's default config


@functools.cache
def default_bwd_config(head_dim: int, softcap: bool = False) -> BwdConfig:
    """128-key tiles, two consumer warpgroups; q blocks of 80 rows at D 128 and 128 rows at
    D 64 (measured on an H100, kernel alone, against 64 rows in the same run: full 8k 585 -> 663,
    causal 8k 511 -> 569, varlen causal 32k 434 -> 455 TFLOP/s at D 128; causal 8k d64 422 ->
    509). With softcap both larger blocks spill (384 / 448 bytes), so softcap keeps 64 rows."""
    if softcap:
        return BwdConfig(head_dim=head_dim)
    return BwdConfig(head_dim=head_dim, tile_m=D128_BWD_ROWS if head_dim == 128 else 128)


# Deterministic mode: a key tile adds to a q block after the key tiles before it in CTA order
# (`tile_plan.visit_ranks`). With 80-row q blocks, 128-key tiles on a causal or banded mask start
# their walks 1 or 2 blocks apart, so a tile can be one step behind the one it waits for: a lag per
# CTA that long walks absorb and short ones do not. 64-row blocks put them 2 blocks apart. Measured
# on an H100 (deterministic against the default backward, 80 / 64 rows; `tile_plan.mean_walk` at 80
# rows): sliding window 8k w1024 (walk 15) +36% / +8 to +9% (two runs), varlen causal 32k (26)
# +18% / +23%, GQA 64:8 varlen causal 32k (61) +11% / +15%, causal 8k (69) +8% / +19%, full 8k
# (103) +15% / +25%. The threshold lies between 15 and 26. Only the 80-row default (D 128) moves:
# D 64's 128-row blocks were not measured this way.
DET_SHORT_WALK_BLOCKS = 20


def deterministic_bwd_config(cfg: BwdConfig, walk_blocks: float) -> BwdConfig:
    """The deterministic backward's config for a plan made with ``cfg`` whose key tiles walk
    ``walk_blocks`` of its q blocks (`tile_plan.mean_walk`): 80-row blocks become 64 when the
    walks are short; any other config stays."""
    if cfg.tile_m == D128_BWD_ROWS and walk_blocks < DET_SHORT_WALK_BLOCKS:
        return _with_rows(cfg, 64)
    return cfg


@functools.cache
def _with_rows(cfg: BwdConfig, rows: int) -> BwdConfig:
    return dataclasses.replace(cfg, tile_m=rows)
