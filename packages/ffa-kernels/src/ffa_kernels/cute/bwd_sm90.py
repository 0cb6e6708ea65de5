"""FFA backward kernel for sm90 (device code), written in CuTe DSL.

Key-tile major: one CTA per (key tile of the backward plan, q head). The CTA loads its
``tile_n`` keys and values once and walks every ``tile_m``-row q block its plan entries list
(bwd plan: the forward plan of the transposed mask, see tile_plan.py), recomputing per block

    S^T = K Q^T,  dP^T = V dO^T                     (SS wgmma, both transposed: M = keys)
    P^T = exp2(S^T * scale_log2 - lse2),  dS^T = P^T * (dP^T - delta)   (softcap: * (1 - t^2))
    dV += P^T dO,  dK += dS^T Q                      (RS wgmma: the S^T / dP^T accumulators are
                                                      already the A operand's layout)
    dQ  = dS K                                       (SS wgmma from dS^T written to shared memory)

A CTA walks the q heads ``head0 .. head0 + heads_per_cta`` of one K/V head in turn (all of a
GQA group's heads, or a part of them when there would be too few CTAs). dV and dK stay in
registers for the whole CTA; at the end they are either stored in the input dtype
(``dkv_store``: the CTA is their only writer) or added to float32 dk/dv accumulators
(``red.global.add.v2.f32``); dQ of every block goes through a float32 shared-memory tile and a
TMA reduce-add into the float32 dq accumulator (other CTAs add to the same rows). Nothing of
size Tq x Tk exists.

The softmax scale rides in P: the preprocess shifts lse2 by log2(s) (s = softmax_scale for
bfloat16, 1 for float16: ``bwd_interface.fold_scale``), so the exponentials give s * P,
and dS = s * P * (dP - delta) already carries the scale that dQ and dK need: no multiply per
block. dV = (s P)^T dO is divided by s once, at the end (``dv_scale`` = 1 / s); ``grad_scale``
(softmax_scale / s: 1 for bfloat16) multiplies dQ and dK only where it is not 1.

Warp specialisation (384 threads):
  warpgroup 0, warp 0  TMA producer: K and V once, then Q with the block's lse2 and dO with
                       its delta (a bulk copy riding each transaction) through
                       ``num_stages``-deep pipelines;
  warpgroup 0, warp 1  dQ writer: per block and consumer warpgroup, waits until the warpgroup
                       has written its float32 dQ tile (named barrier DQFull), issues the TMA
                       reduce-add and, once the copy has read the tile, frees it (DQEmpty), so
                       the consumers never wait on the copy (deterministic mode: the adds to a
                       q block in a fixed order through a semaphore, see ``dq_writer``);
  warpgroups 1, 2      consumers: 64 keys each for S^T, dP^T, dV, dK; for dQ each computes
                       half of the head dim over all 128 keys. The shared dS tile is
                       double-buffered (by block parity), so one named barrier per block (PdS,
                       "both halves of dS written") suffices: a warpgroup can only overwrite a
                       buffer after the other passed the next block's barrier, i.e. finished
                       reading it.

``lse2`` (lse * log2(e) less the log2 of the folded scale, ``bwd_interface.fold_scale``; +inf for
rows nothing covers, so P = 0 there) and ``delta``
(rowsum(dO * O)) come from the host-side preprocess as float32 (Hq, stat_stride) tensors padded
past Tq (lse2 +inf, delta 0), so a q block may run past Tq without bounds checks; Q and dO rows
past Tq are zero-filled by the TMA unit. The consumers read them from shared memory as they use
them (no per-thread global loads, and neither array is held in registers through the other's
use).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.pipeline import PipelineUserType, make_pipeline_state, pipeline_init_arrive, pipeline_init_wait

from .atomics import add_release_i32, load_acquire_i32, red_add_f32x2, store_pair_16bit
from .config import STAT_PAD, BwdConfig
from .masking import apply_band_mask, score_coords
from .mma import acc_as_operand_a, acc_rows_cols, smem_layout, smem_transpose, tiled_wgmma, wgmma
from .pipeline import NamedBarrier, consumer_wait, tma_load_rows, tma_pipeline
from .schedule import cta_work_and_head
from .tile_plan import ENTRY_COLS, WORK_COLS


class FFABackwardSm90:
    """One compiled kernel per (dtype, BwdConfig, softcap on/off, dk/dv stored or added,
    deterministic or not)."""

    def __init__(
        self, dtype, cfg: BwdConfig, has_softcap: bool, dkv_store: bool, deterministic: bool = False
    ):
        self.dtype = dtype
        self.cfg = cfg
        self.has_softcap = has_softcap
        self.dkv_store = dkv_store
        self.deterministic = deterministic
        self.tile_m, self.tile_n, self.hdim = cfg.tile_m, cfg.tile_n, cfg.head_dim
        # dQ = dS K: with 64-row q blocks each consumer warpgroup computes 64 rows x D / num_wg
        # columns; with 64 * num_wg-row blocks (D 64), 64 rows x all D columns. Either way one
        # warpgroup's dQ is a (64, dq_cols) wgmma tile, its own float32 tile in shared memory.
        # With 80-row blocks (not a multiple of the wgmma M) dQ^T = K^T dS^T is computed
        # instead: M = the head dim, 64 columns of dQ per warpgroup, all the block's rows.
        self.dq_swap = cfg.tile_m % 64 != 0
        self.dq_split_rows = cfg.tile_m == 64 * cfg.num_mma_wg
        self.dq_cols = cfg.head_dim if self.dq_split_rows else cfg.head_dim // cfg.num_mma_wg
        self.dq_rows = cfg.tile_m if self.dq_swap else 64  # rows of one warpgroup's dQ tile
        # dV's GEMM issued before the wait for dP^T (block_step): its P operand then lives
        # through dS; 80- and 128-row blocks and softcap's tanh derivatives leave no registers
        # for that (ptxas spills, and serialises the wgmmas at 80 and 128 rows)
        self.early_dv = cfg.tile_m <= 64 and not has_softcap
        # a block's lse2 / delta: a bulk copy needs a 16-byte aligned source, so it starts at the
        # block's first row rounded down to 4 and takes STAT_PAD more values
        self.stat_cols = cfg.tile_m + STAT_PAD

    # ------------------------------------------------------------------ host side (traced)
    @cute.jit
    def __call__(
        self,
        ptr_q: cute.Pointer,  # (Tq, Hq, D) contiguous
        ptr_k: cute.Pointer,  # (Tk, Hk, D), rows kv_row_stride elements apart, heads contiguous
        ptr_v: cute.Pointer,  # (Tk, Hk, D), the same strides as K
        ptr_do: cute.Pointer,  # (Tq, Hq, D) contiguous, q's dtype
        ptr_lse2: cute.Pointer,  # (Hq, stat_stride) f32
        ptr_delta: cute.Pointer,  # (Hq, stat_stride) f32
        ptr_dq: cute.Pointer,  # (Tq, Hq, D) f32 contiguous, added to
        ptr_dk: cute.Pointer,  # (Tk, Hk, D), rows dkv_row_stride apart: q's dtype, stored
        #                        (dkv_store), or f32, added to
        ptr_dv: cute.Pointer,  # (Tk, Hk, D), the same strides and dtype as dk
        ptr_work: cute.Pointer,  # (W, WORK_COLS) i32
        ptr_ent: cute.Pointer,  # (E, ENTRY_COLS) i32
        ptr_ranks: cute.Pointer,  # (W + V,) i32, tile_plan.visit_ranks (deterministic only)
        ptr_sem: cute.Pointer,  # (ceil(Tq / tile_m) * Hq + W * Hk,) i32 zeros (deterministic only)
        total_q: Int32,
        total_k: Int32,
        num_heads_q: Int32,
        num_heads_k: Int32,
        num_work: Int32,
        num_entries: Int32,
        kv_row_stride: Int32,
        dkv_row_stride: Int32,
        stat_stride: Int32,
        heads_per_cta: Int32,  # q heads one CTA walks (a divisor of Hq / Hk)
        scale_log2: Float32,  # log2(e) * (softmax_scale, or softcap with softcap)
        score_premul: Float32,  # softmax_scale / softcap (softcap only)
        grad_scale: Float32,  # softmax_scale / the scale folded into P (1.0 for bfloat16)
        dv_scale: Float32,  # 1 / the scale folded into P
        flags: Int32,
        stream: cuda.CUstream,
    ):
        D = self.hdim
        cfg = self.cfg
        hq64 = cutlass.Int64(num_heads_q)
        kv64 = cutlass.Int64(kv_row_stride)
        dkv64 = cutlass.Int64(dkv_row_stride)
        q_layout = cute.make_layout((total_q, num_heads_q, D), stride=(hq64 * D, D, 1))
        kv_layout = cute.make_layout((total_k, num_heads_k, D), stride=(kv64, D, 1))
        mQ = cute.make_tensor(ptr_q, q_layout)
        mdO = cute.make_tensor(ptr_do, q_layout)
        mK = cute.make_tensor(ptr_k, kv_layout)
        mV = cute.make_tensor(ptr_v, kv_layout)
        mdQ = cute.make_tensor(ptr_dq, q_layout)
        dkv_layout = cute.make_layout((total_k, num_heads_k, D), stride=(dkv64, D, 1))
        mdK = cute.make_tensor(ptr_dk, dkv_layout)
        mdV = cute.make_tensor(ptr_dv, dkv_layout)
        stat_layout = cute.make_layout((num_heads_q, stat_stride), stride=(cutlass.Int64(stat_stride), 1))
        mLSE2 = cute.make_tensor(ptr_lse2, stat_layout)
        mDelta = cute.make_tensor(ptr_delta, stat_layout)
        mWork = cute.make_tensor(ptr_work, cute.make_layout((num_work, WORK_COLS), stride=(WORK_COLS, 1)))
        mEnt = cute.make_tensor(ptr_ent, cute.make_layout((num_entries, ENTRY_COLS), stride=(ENTRY_COLS, 1)))
        mRanks = cute.make_tensor(ptr_ranks, cute.make_layout(num_work + total_q))  # the extent is unused
        num_qblk = (total_q + self.tile_m - 1) // self.tile_m
        mSem = cute.make_tensor(ptr_sem, cute.make_layout((num_qblk, num_heads_q), stride=(num_heads_q, 1)))
        # then one semaphore per (work tile, K/V head): the turn of the head slot that adds dK/dV
        mSemKV = cute.make_tensor(
            ptr_sem + num_qblk * num_heads_q,
            cute.make_layout((num_work, num_heads_k), stride=(num_heads_k, 1)),
        )
        # (T, H, D) -> (T, D, H): the sequence axis first, head last, for TMA
        mQt, mdOt, mKt, mVt = (
            cute.make_tensor(t.iterator, cute.select(t.layout, mode=[0, 2, 1])) for t in (mQ, mdO, mK, mV)
        )

        # S^T = K Q^T and dP^T = V dO^T: M = keys (64 per warpgroup), N = q rows of the block
        tiled_mma_sdp = tiled_wgmma(self.dtype, (cfg.num_mma_wg, 1, 1), (64, self.tile_m))
        # dV += P^T dO, dK += dS^T Q: A from registers, B = dO / Q read transposed (MN-major)
        tiled_mma_dkv = tiled_wgmma(
            self.dtype, (cfg.num_mma_wg, 1, 1), (64, D), b_transposed=True, a_in_registers=True
        )
        # dQ = dS K: M = the block's q rows, split over the warpgroups by rows or by columns;
        # dQ^T = K^T dS^T: M = head-dim columns, split over the warpgroups
        dq_cols, dq_rows = self.dq_cols, self.dq_rows
        split_m = self.dq_swap or self.dq_split_rows
        tiled_mma_dq = self.dq_mma((cfg.num_mma_wg, 1, 1) if split_m else (1, cfg.num_mma_wg, 1))
        sQ_layout, sK_layout, sV_layout, sdS_layout, sdQ_wg_layout, sdQ_layout = self.smem_layouts()

        op = cpasync.CopyBulkTensorTileG2SOp()
        row_tile = cute.select(sQ_layout, mode=[0, 1])
        tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(op, mQt, row_tile, (self.tile_m, D), 1)
        tma_atom_do, tma_do = cpasync.make_tiled_tma_atom(op, mdOt, row_tile, (self.tile_m, D), 1)
        tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(op, mKt, sK_layout, (self.tile_n, D), 1)
        tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(op, mVt, sV_layout, (self.tile_n, D), 1)
        mdQt = cute.make_tensor(mdQ.iterator, cute.select(mdQ.layout, mode=[0, 2, 1]))
        tma_atom_dq, tma_dq = cpasync.make_tiled_tma_atom(
            cpasync.CopyReduceBulkTensorTileS2GOp(), mdQt, sdQ_wg_layout, (dq_rows, dq_cols)
        )
        if cutlass.const_expr(self.dkv_store):
            # dK / dV leave through K's and V's shared buffers, one TMA store each (epilogue_dkv)
            mdKt, mdVt = (
                cute.make_tensor(t.iterator, cute.select(t.layout, mode=[0, 2, 1])) for t in (mdK, mdV)
            )
            s2g = cpasync.CopyBulkTensorTileS2GOp()
            tma_atom_dk, tma_dk = cpasync.make_tiled_tma_atom(s2g, mdKt, sK_layout, (self.tile_n, D))
            tma_atom_dv, tma_dv = cpasync.make_tiled_tma_atom(s2g, mdVt, sV_layout, (self.tile_n, D))
        else:
            # added with atomics from registers: the descriptors are never used
            tma_atom_dk, tma_dk, tma_atom_dv, tma_dv = tma_atom_k, mdK, tma_atom_v, mdV
        elem_bytes = self.dtype.width // 8
        self.bytes_q = self.tile_m * D * elem_bytes
        # lse2 / delta of a block ride its Q / dO transaction (one bulk copy each, see producer)
        self.bytes_stats = self.stat_cols * 4
        self.bytes_kv = 2 * self.tile_n * D * elem_bytes

        SharedStorage = self.shared_storage(sQ_layout, sK_layout, sV_layout, sdS_layout, sdQ_layout)

        self.kernel(
            tma_q, tma_do, tma_k, tma_v, tma_atom_q, tma_atom_do, tma_atom_k, tma_atom_v, tma_dq, tma_atom_dq,
            tma_dk, tma_atom_dk, tma_dv, tma_atom_dv, mLSE2, mDelta, mdK, mdV, mWork, mEnt, mRanks, mSem, mSemKV,
            sQ_layout, sK_layout, sV_layout, sdS_layout, sdQ_layout, tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq,
            scale_log2, score_premul, grad_scale, dv_scale, num_heads_q // num_heads_k, heads_per_cta, num_work,
            num_heads_q // heads_per_cta, flags, SharedStorage,
        ).launch(
            grid=[num_work * (num_heads_q // heads_per_cta), 1, 1],
            block=[cfg.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
        )  # fmt: skip

    def dq_mma(self, atoms: tuple):
        """The dQ GEMM over the warpgroups ``atoms`` (traced): dQ = dS K, one (64, dq_cols)
        tile per warpgroup, B = K read transposed; or with ``dq_swap`` dQ^T = K^T dS^T, one
        (dq_cols, tile_m) tile, A = K read transposed."""
        if self.dq_swap:
            return tiled_wgmma(self.dtype, atoms, (self.dq_cols, self.tile_m), a_transposed=True)
        return tiled_wgmma(self.dtype, atoms, (64, self.dq_cols), b_transposed=True)

    def smem_layouts(self):
        """Shared-memory layouts (traced): Q / dO stages, K, V, the two dS buffers, one
        warpgroup's float32 dQ tile and all of them."""
        cfg, D = self.cfg, self.hdim
        sQ_layout = smem_layout(self.dtype, self.tile_m, D, cfg.num_stages)
        # K is read MN-major by the dQ GEMM in head-dim slices of dq_cols columns
        sK_layout = smem_layout(self.dtype, self.tile_n, D, None, atom_cols=self.dq_cols)
        sV_layout = smem_layout(self.dtype, self.tile_n, D, None)
        sdS_layout = smem_layout(self.dtype, self.tile_m, self.tile_n, 2)
        # dQ in float32: one contiguous (dq_rows, dq_cols) tile per warpgroup, which one TMA
        # reduce-add adds to dq_acc
        sdQ_wg_layout = smem_layout(Float32, self.dq_rows, self.dq_cols, None, atom_cols=32)
        sdQ_layout = smem_layout(Float32, self.dq_rows, self.dq_cols, cfg.num_mma_wg, atom_cols=32)
        return sQ_layout, sK_layout, sV_layout, sdS_layout, sdQ_wg_layout, sdQ_layout

    def shared_storage(self, sQ_layout, sK_layout, sV_layout, sdS_layout, sdQ_layout):
        """The kernel's shared-memory struct (traced); config.BwdConfig.smem_bytes() is its size."""
        cfg = self.cfg
        stats = self.stat_cols * cfg.num_stages

        ms = cute.struct.MemRange
        fields = {
            "mbar_kv": ms[cutlass.Int64, 2],
            "mbar_q": ms[cutlass.Int64, cfg.num_stages * 2],
            "mbar_do": ms[cutlass.Int64, cfg.num_stages * 2],
            # the small arrays first: they fill the gap before the 1024-aligned tiles (80-row
            # blocks need every byte: 227 KiB with the tiles, 1 KiB of it static)
            "sLSE2": cute.struct.Align[ms[Float32, stats], 128],
            "sDelta": cute.struct.Align[ms[Float32, stats], 128],
            "sK": cute.struct.Align[ms[self.dtype, cute.cosize(sK_layout)], 1024],
            "sV": cute.struct.Align[ms[self.dtype, cute.cosize(sV_layout)], 1024],
            "sQ": cute.struct.Align[ms[self.dtype, cute.cosize(sQ_layout)], 1024],
            "sdO": cute.struct.Align[ms[self.dtype, cute.cosize(sQ_layout)], 1024],
            "sdS": cute.struct.Align[ms[self.dtype, cute.cosize(sdS_layout)], 1024],
            "sdQ": cute.struct.Align[ms[Float32, cute.cosize(sdQ_layout)], 1024],
        }
        # built from a dict: this module's annotations are strings (PEP 563), which the struct
        # decorator cannot resolve against this method's locals
        SharedStorage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))
        return SharedStorage

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        tma_q: cute.Tensor,
        tma_do: cute.Tensor,
        tma_k: cute.Tensor,
        tma_v: cute.Tensor,
        tma_atom_q: cute.CopyAtom,
        tma_atom_do: cute.CopyAtom,
        tma_atom_k: cute.CopyAtom,
        tma_atom_v: cute.CopyAtom,
        tma_dq: cute.Tensor,
        tma_atom_dq: cute.CopyAtom,
        tma_dk: cute.Tensor,
        tma_atom_dk: cute.CopyAtom,
        tma_dv: cute.Tensor,
        tma_atom_dv: cute.CopyAtom,
        mLSE2: cute.Tensor,
        mDelta: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mWork: cute.Tensor,
        mEnt: cute.Tensor,
        mRanks: cute.Tensor,
        mSem: cute.Tensor,
        mSemKV: cute.Tensor,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sdS_layout: cute.ComposedLayout,
        sdQ_layout: cute.ComposedLayout,
        tiled_mma_sdp: cute.TiledMma,
        tiled_mma_dkv: cute.TiledMma,
        tiled_mma_dq: cute.TiledMma,
        scale_log2: Float32,
        score_premul: Float32,
        grad_scale: Float32,
        dv_scale: Float32,
        qhead_per_kvhead: Int32,
        heads_per_cta: Int32,
        num_work: Int32,
        num_slots: Int32,
        flags: Int32,
        SharedStorage: cutlass.Constexpr,
    ):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_atom_q, tma_atom_do, tma_atom_k, tma_atom_v, tma_atom_dq):
                cpasync.prefetch_descriptor(atom)
            if cutlass.const_expr(self.dkv_store):
                cpasync.prefetch_descriptor(tma_atom_dk)
                cpasync.prefetch_descriptor(tma_atom_dv)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        warps = cfg.num_mma_wg * 4
        pipe_kv = tma_pipeline(storage.mbar_kv.data_ptr(), 1, self.bytes_kv, warps)
        tx_q = self.bytes_q + self.bytes_stats
        pipe_q = tma_pipeline(storage.mbar_q.data_ptr(), cfg.num_stages, tx_q, warps)
        pipe_do = tma_pipeline(storage.mbar_do.data_ptr(), cfg.num_stages, tx_q, warps)
        pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        sdQ = storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)
        stat_layout = cute.make_layout((self.stat_cols, cfg.num_stages))
        sLSE2 = storage.sLSE2.get_tensor(stat_layout)
        sDelta = storage.sDelta.get_tensor(stat_layout)

        w, slot = cta_work_and_head(flags, num_work, num_slots)
        n0 = mWork[w, 0]
        e0 = mWork[w, 1]
        e1 = mWork[w, 2]
        n_stop = mWork[w, 4]  # keys n0 .. n_stop - 1 are this tile's (tile_plan: segment key tiles)
        head0 = slot * heads_per_cta
        head_kv = head0 // qhead_per_kvhead
        # deterministic, dK/dV added: the head slots of a K/V head add in slot (= CTA) order
        dkv_turn = slot - head_kv * (qhead_per_kvhead // heads_per_cta)
        dkv_sem = mSemKV.iterator + cute.crd2idx((w, head_kv), mSemKV.layout)

        pipeline_init_wait(cluster_shape_mn=(1, 1))

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(cfg.producer_regs)
            if warp_idx == 0:
                self.producer(
                    tma_q, tma_do, tma_k, tma_v, tma_atom_q, tma_atom_do, tma_atom_k, tma_atom_v,
                    sQ, sdO, sK, sV, pipe_kv, pipe_q, pipe_do, mEnt, n0, e0, e1, head0, heads_per_cta, head_kv,
                    mLSE2, mDelta, sLSE2, sDelta,
                )  # fmt: skip
            if warp_idx == 1:
                self.dq_writer(tma_dq, tma_atom_dq, sdQ, mEnt, mRanks, mSem, w, e0, e1, head0, heads_per_cta)
        else:
            cute.arch.setmaxregister_increase(cfg.mma_regs)
            self.consumer(
                tidx - 128, sQ, sdO, sK, sV, sdS, sdQ, pipe_kv, pipe_q, pipe_do,
                tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq, tma_dq, tma_atom_dq,
                (tma_dk, tma_atom_dk, tma_dv, tma_atom_dv), sLSE2, sDelta, mdK, mdV, mEnt,
                n0, e0, e1, head0, heads_per_cta, head_kv, scale_log2, score_premul, grad_scale, dv_scale, dkv_sem,
                dkv_turn, n_stop,
            )  # fmt: skip

    @cute.jit
    def producer(
        self, tma_q, tma_do, tma_k, tma_v, tma_atom_q, tma_atom_do, tma_atom_k, tma_atom_v,
        sQ, sdO, sK, sV, pipe_kv, pipe_q, pipe_do, mEnt, n0, e0, e1, head0, heads_per_cta, head_kv,
        mLSE2, mDelta, sLSE2, sDelta,
    ):  # fmt: skip
        """K and V once (one transaction), then Q (+ lse2) and dO (+ delta) of every planned
        block, in the consumers' order (heads, then entries in plan order, then blocks in q
        order)."""
        cfg = self.cfg
        D = self.hdim
        kv_state = make_pipeline_state(PipelineUserType.Producer, 1)
        pipe_kv.producer_acquire(kv_state)
        bar_kv = pipe_kv.producer_get_barrier(kv_state)
        tma_load_rows(tma_atom_k, tma_k[None, None, head_kv], n0, self.tile_n, D, sK, None, bar_kv)
        tma_load_rows(tma_atom_v, tma_v[None, None, head_kv], n0, self.tile_n, D, sV, None, bar_kv)
        q_state = make_pipeline_state(PipelineUserType.Producer, cfg.num_stages)
        do_state = make_pipeline_state(PipelineUserType.Producer, cfg.num_stages)
        for hh in cutlass.range(heads_per_cta, unroll=1):
            gQ = tma_q[None, None, head0 + hh]
            gdO = tma_do[None, None, head0 + hh]
            for e in cutlass.range(e0, e1, unroll=1):
                q_lo = mEnt[e, 0]
                for j in cutlass.range(mEnt[e, 1], unroll=1):
                    qb = q_lo + j * self.tile_m
                    pipe_q.producer_acquire(q_state)
                    bar_q = pipe_q.producer_get_barrier(q_state)
                    tma_load_rows(tma_atom_q, gQ, qb, self.tile_m, D, sQ, q_state.index, bar_q)
                    self.load_stats(mLSE2, sLSE2, head0 + hh, qb, q_state.index, bar_q)
                    q_state.advance()
                    pipe_do.producer_acquire(do_state)
                    bar_do = pipe_do.producer_get_barrier(do_state)
                    tma_load_rows(tma_atom_do, gdO, qb, self.tile_m, D, sdO, do_state.index, bar_do)
                    self.load_stats(mDelta, sDelta, head0 + hh, qb, do_state.index, bar_do)
                    do_state.advance()

    @cute.jit
    def load_stats(self, mStat, sStat, head, qb, stage, bar):
        """One bulk copy: ``mStat[head, a0 : a0 + stat_cols]`` into ``sStat[:, stage]``, where a0
        is qb rounded down to a multiple of 4 (rows a0 and up are 16-byte aligned: the host's
        stat_stride is a multiple of 4 and padded past Tq by at least tile_m + STAT_PAD); the consumers
        read the block's rows at ``qb - a0`` on."""
        a0 = qb - qb % 4
        src = mStat.iterator + cute.crd2idx((head, a0), mStat.layout)
        src16 = cute.make_ptr(Float32, src.toint(), cute.AddressSpace.gmem, assumed_align=16)
        atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), Float32, num_bits_per_copy=self.stat_cols * 32)
        if cute.arch.lane_idx() == 0:  # a bulk copy is issued by one thread (no election by the compiler)
            cute.copy(
                atom,
                cute.make_tensor(src16, cute.make_layout(self.stat_cols)),
                sStat[None, stage],
                mbar_ptr=bar,
            )

    @cute.jit
    def consumer(
        self, ctid, sQ, sdO, sK, sV, sdS, sdQ, pipe_kv, pipe_q, pipe_do,
        tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq, tma_dq, tma_atom_dq, tma_dkv, sLSE2, sDelta, mdK, mdV, mEnt,
        n0, e0, e1, head0, heads_per_cta, head_kv, scale_log2, score_premul, grad_scale, dv_scale, dkv_sem,
                dkv_turn, n_stop,
    ):  # fmt: skip
        cfg = self.cfg
        D = self.hdim
        wg_idx = cute.arch.make_warp_uniform(ctid // 128)
        thr_sdp = tiled_mma_sdp.get_slice(ctid)
        wg_sdp = tiled_mma_sdp.get_slice(wg_idx * 128)
        wg_dkv = tiled_mma_dkv.get_slice(wg_idx * 128)
        wg_dq = tiled_mma_dq.get_slice(wg_idx * 128)
        # S^T, dP^T operands
        tSrK = wg_sdp.make_fragment_A(wg_sdp.partition_A(sK))
        tSrQ = wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ))
        tPrV = wg_sdp.make_fragment_A(wg_sdp.partition_A(sV))
        tPrdO = wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO))
        acc_shape_sdp = wg_sdp.partition_shape_C((self.tile_n, self.tile_m))
        # dV / dK operands and accumulators
        tdVrdOt = wg_dkv.make_fragment_B(wg_dkv.partition_B(smem_transpose(sdO)))
        tdKrQt = wg_dkv.make_fragment_B(wg_dkv.partition_B(smem_transpose(sQ)))
        tdVrP = wg_dkv.make_fragment_A(wg_dkv.partition_shape_A((self.tile_n, self.tile_m)))
        tdKrdS = wg_dkv.make_fragment_A(wg_dkv.partition_shape_A((self.tile_n, self.tile_m)))
        acc_dV = cute.make_rmem_tensor(wg_dkv.partition_shape_C((self.tile_n, D)), Float32)
        acc_dK = cute.make_rmem_tensor(wg_dkv.partition_shape_C((self.tile_n, D)), Float32)
        acc_dV.fill(0.0)
        acc_dK.fill(0.0)
        # dQ operands (the dQ^T GEMM: K^T as A, dS as B)
        if cutlass.const_expr(self.dq_swap):
            tdQrKt = wg_dq.make_fragment_A(wg_dq.partition_A(smem_transpose(sK)))
            tdQrdS = wg_dq.make_fragment_B(wg_dq.partition_B(sdS))
            acc_shape_dq = wg_dq.partition_shape_C((D, self.tile_m))
        else:
            tdQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(sdS))
            tdQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(smem_transpose(sK)))
            acc_shape_dq = wg_dq.partition_shape_C((self.tile_m, D))
        # dS^T registers -> dS in shared memory (transposing stmatrix)
        store_atom = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype
        )
        thr_store = cute.make_tiled_copy_C(store_atom, tiled_mma_sdp).get_slice(ctid)
        tdSsdS = thr_store.partition_D(smem_transpose(sdS))

        tScS = score_coords(thr_sdp, self.tile_n, self.tile_m)
        t0ScS = score_coords(tiled_mma_sdp.get_slice(0), self.tile_n, self.tile_m)
        # this warpgroup's (dq_rows, dq_cols) dQ tile: the C layout of one warpgroup's wgmma
        # (dQ^T's: the tile seen transposed, one float per store)
        sdQ_wg = sdQ[None, None, wg_idx]
        tdQsdQ = (
            self.dq_mma((1, 1, 1))
            .get_slice(ctid % 128)
            .partition_C(smem_transpose(sdQ_wg) if self.dq_swap else sdQ_wg)
        )

        kv_state = make_pipeline_state(PipelineUserType.Consumer, 1)
        q_state = make_pipeline_state(PipelineUserType.Consumer, cfg.num_stages)
        do_state = make_pipeline_state(PipelineUserType.Consumer, cfg.num_stages)
        consumer_wait(pipe_kv, kv_state)
        for hh in cutlass.range(heads_per_cta, unroll=1):
            head = head0 + hh
            for e in cutlass.range(e0, e1, unroll=1):
                q_lo = mEnt[e, 0]
                nblk = mEnt[e, 1]
                # the transposed band: rows are keys, columns q rows (tile_plan.build_bwd_plan_cpu)
                ks = mEnt[e, 2]
                ke = mEnt[e, 3]
                lo = mEnt[e, 4]
                hi = mEnt[e, 5]
                qs = mEnt[e, 6]
                qe = mEnt[e, 7]
                f_lo = mEnt[e, 8]
                f_hi = mEnt[e, 9]
                for seg in cutlass.range_constexpr(3):
                    seg_lo = (0, f_lo, f_hi)[seg]
                    seg_hi = (f_lo, f_hi, nblk)[seg]
                    for j in cutlass.range(seg_lo, seg_hi, unroll=1):
                        self.block_step(
                            seg != 1, ctid, q_lo + j * self.tile_m, n0, head, ks, ke, lo, hi, qs, qe,
                            tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq, acc_shape_sdp, acc_shape_dq,
                            tSrK, tSrQ, tPrV, tPrdO, tdVrdOt, tdKrQt, tdVrP, tdKrdS, acc_dV, acc_dK, tdQrdS,
                            tdQrKt, store_atom, thr_store, tdSsdS, tScS, t0ScS, tdQsdQ, pipe_q, pipe_do,
                            q_state, do_state, sLSE2, sDelta, scale_log2, score_premul, grad_scale,
                        )  # fmt: skip
                        q_state.advance()
                        do_state.advance()
        consumers = cfg.num_mma_wg * 128
        if cutlass.const_expr(self.deterministic and not self.dkv_store):
            # the head slots of one K/V head add their dK/dV in slot (= CTA) order: wait for
            # this slot's turn (a semaphore per work tile and K/V head)
            if ctid == 0:
                while load_acquire_i32(dkv_sem) != dkv_turn:
                    pass
            cute.arch.barrier(barrier_id=int(NamedBarrier.Epilogue), number_of_threads=consumers)
        if cutlass.const_expr(self.dkv_store):
            # a segment tile (work column 4 stops it before the grid's tile end) shares its last
            # rows with the next document's tile: a whole-tile TMA store would overwrite them
            whole_tile = n_stop >= cutlass.min(n0 + self.tile_n, mdK.shape[0])
            if whole_tile:
                self.epilogue_dkv_store(ctid, tiled_mma_dkv, acc_dK, acc_dV, sK, sV, tma_dkv, n0, head_kv,
                                        grad_scale, dv_scale)  # fmt: skip
            else:
                self.epilogue_dkv(
                    ctid, tiled_mma_dkv, acc_dK, acc_dV, mdK, mdV, n0, n_stop, head_kv, grad_scale, dv_scale
                )
        else:
            # the same call as above, kept apart: one call would need a condition that is a
            # compile-time False here, and an `if` outside const_expr traces both arms (scf.if):
            # this kernel would trace epilogue_dkv_store on its stand-in TMA descriptors
            self.epilogue_dkv(
                ctid, tiled_mma_dkv, acc_dK, acc_dV, mdK, mdV, n0, n_stop, head_kv, grad_scale, dv_scale
            )
        if cutlass.const_expr(self.deterministic and not self.dkv_store):
            # every consumer's adds precede the barrier, which precedes the release
            cute.arch.barrier(barrier_id=int(NamedBarrier.Epilogue), number_of_threads=consumers)
            if ctid == 0:
                add_release_i32(dkv_sem, 1)

    @cute.jit
    def block_step(
        self, masked: cutlass.Constexpr[bool], ctid, qb, n0, head, ks, ke, lo, hi, qs, qe,
        tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq, acc_shape_sdp, acc_shape_dq,
        tSrK, tSrQ, tPrV, tPrdO, tdVrdOt, tdKrQt, tdVrP, tdKrdS, acc_dV, acc_dK, tdQrdS, tdQrKt,
        store_atom, thr_store, tdSsdS, tScS, t0ScS, tdQsdQ,
        pipe_q, pipe_do, q_state, do_state, sLSE2, sDelta, scale_log2, score_premul, grad_scale,
    ):  # fmt: skip
        """One q block (rows qb .. qb + tile_m) against this CTA's keys; the caller advances
        the pipeline states."""
        cfg = self.cfg
        consumer_wait(pipe_q, q_state)
        acc_S = cute.make_rmem_tensor(acc_shape_sdp, Float32)
        wgmma(tiled_mma_sdp, acc_S, tSrK, tSrQ[None, None, None, q_state.index], True, -1)
        consumer_wait(pipe_do, do_state)
        acc_dP = cute.make_rmem_tensor(acc_shape_sdp, Float32)
        wgmma(tiled_mma_sdp, acc_dP, tPrV, tPrdO[None, None, None, do_state.index], True, -1)

        # per-column (q row) statistics of this block, from shared memory (load_stats) when
        # needed: lse2 for the exponentials, delta for dS (neither is live through the other)
        s = acc_rows_cols(acc_S)
        ncol = cute.size(s, mode=[1])
        shift = qb % 4  # the statistics' bulk copy started at qb - shift
        sLSE2_blk = sLSE2[None, q_state.index]
        sDelta_blk = sDelta[None, do_state.index]

        warpgroup.wait_group(1)  # S^T
        dtanh = None
        if cutlass.const_expr(self.has_softcap):
            # tanh before the mask (a masked -inf would give NaN in 1 - t^2), the mask before exp
            dtanh = cute.make_rmem_tensor_like(acc_S, Float32)
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                t = cute.math.tanh(acc_S[i] * score_premul, fastmath=True)
                acc_S[i] = t
                dtanh[i] = 1.0 - t * t
        if cutlass.const_expr(masked):
            apply_band_mask(acc_S, tScS, t0ScS, qb, n0, ks, ke, lo, hi, qs, qe)
        for c in cutlass.range_constexpr(ncol):
            lse2 = sLSE2_blk[shift + tScS[0, c][1]]
            for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                s[r, c] = cute.math.exp2(s[r, c] * scale_log2 - lse2, fastmath=True)
        tdVrP.store(acc_as_operand_a(acc_S).load().to(self.dtype))
        if cutlass.const_expr(self.early_dv):
            # dV's GEMM goes in right behind dP^T's: the tensor cores have it while this
            # warpgroup computes dS, and ptxas cannot hoist the wait below above the
            # exponentials (it did: 6 of 32 ex2 ran before it, the rest after dP^T was done)
            wgmma(tiled_mma_dkv, acc_dV, tdVrP, tdVrdOt[None, None, None, do_state.index], False, -1)
            warpgroup.wait_group(1)  # dP^T (dV may still run)
        else:
            warpgroup.wait_group(0)  # dP^T
        dp = acc_rows_cols(acc_dP)
        for c in cutlass.range_constexpr(ncol):
            delta = sDelta_blk[shift + tScS[0, c][1]]
            for r in cutlass.range_constexpr(cute.size(dp, mode=[0])):
                dp[r, c] = s[r, c] * (dp[r, c] - delta)
        if cutlass.const_expr(self.has_softcap):
            for i in cutlass.range_constexpr(cute.size(acc_dP)):
                acc_dP[i] = acc_dP[i] * dtanh[i]
        tdKrdS.store(acc_as_operand_a(acc_dP).load().to(self.dtype))
        rdS = cute.make_rmem_tensor_like(acc_dP, self.dtype)
        rdS.store(acc_dP.load().to(self.dtype))

        # dS^T -> this block's dS buffer (double-buffered: see the module docstring)
        ds_idx = q_state.index % 2
        cute.copy(store_atom, thr_store.retile(rdS), tdSsdS[None, None, None, ds_idx])
        if cutlass.const_expr(not self.early_dv):
            # dV's GEMM needs only this warpgroup's registers: it runs while the warpgroups meet
            wgmma(tiled_mma_dkv, acc_dV, tdVrP, tdVrdOt[None, None, None, do_state.index], False, -1)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(NamedBarrier.PdS), number_of_threads=128 * cfg.num_mma_wg)

        acc_dQ = cute.make_rmem_tensor(acc_shape_dq, Float32)
        if cutlass.const_expr(self.dq_swap):
            wgmma(tiled_mma_dq, acc_dQ, tdQrKt, tdQrdS[None, None, None, ds_idx], True, -1)
        else:
            wgmma(tiled_mma_dq, acc_dQ, tdQrdS[None, None, None, ds_idx], tdQrKt, True, -1)
        wgmma(tiled_mma_dkv, acc_dK, tdKrdS, tdKrQt[None, None, None, q_state.index], False, -1)
        warpgroup.wait_group(1)  # dV and dQ
        pipe_do.consumer_release(do_state)
        self.add_dq(ctid, acc_dQ, tdQsdQ, grad_scale)
        warpgroup.wait_group(0)  # dK
        pipe_q.consumer_release(q_state)

    @cute.jit
    def add_dq(self, ctid, acc_dQ, tdQsdQ, grad_scale):
        """This warpgroup's float32 dQ tile in shared memory = grad_scale * dQ, for the dQ
        writer warp to add to dq_acc: wait until the tile is free, write, signal it full."""
        wg_idx = ctid // 128
        threads = 128 + cute.arch.WARP_SIZE
        cute.arch.barrier(barrier_id=int(NamedBarrier.DQEmptyWG1) + wg_idx, number_of_threads=threads)
        if grad_scale != 1.0:  # uniform; float16 does not fold the scale into P
            for i in cutlass.range_constexpr(cute.size(acc_dQ)):
                acc_dQ[i] = acc_dQ[i] * grad_scale
        # vector stores where the layouts allow (a thread's adjacent columns are 8 bytes apart
        # in the swizzled tile too)
        cute.autovec_copy(acc_dQ, tdQsdQ)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.DQFullWG1) + wg_idx, number_of_threads=threads)

    @cute.jit
    def dq_writer(self, tma_dq, tma_atom_dq, sdQ, mEnt, mRanks, mSem, w, e0, e1, head0, heads_per_cta):
        """The dQ writer warp: for every block (in the consumers' order) and consumer warpgroup,
        dq_acc[the warpgroup's rows and columns of the block, head] += its shared-memory tile, by one TMA
        reduce-add (rows past Tq are clipped by the TMA unit; rows the entry does not cover hold
        dS = 0, so they add +0). Each tile is freed (DQEmpty) once the previous reduce-add that
        read it has finished reading, then awaited (DQFull): one arrive and one wait per block, so
        no barrier is left pending at exit.

        Deterministic mode (q blocks aligned to tile_m): before adding to a block, wait until
        the block's semaphore for this head counts this visit's rank (tile_plan.visit_ranks), and
        after the adds have landed (not only read shared memory) release it with +1, so every
        run adds the partial dQs of a block in the same order. The tiles are freed before that
        wait, so the consumers write a block and go on to the next while the writer waits for
        the block's turn (one block of slack; freeing them after the turn, the consumers idled
        in every wait: on an H100 this order took the deterministic cost on full 8k from +25%
        to +15% of the default backward, causal 8k +15% -> +8%)."""
        cfg = self.cfg
        threads = 128 + cute.arch.WARP_SIZE
        for hh in cutlass.range(heads_per_cta, unroll=1):
            head = head0 + hh
            gdQ_head = tma_dq[None, None, head]
            visit = mRanks[w] if cutlass.const_expr(self.deterministic) else 0
            for e in cutlass.range(e0, e1, unroll=1):
                q_lo = mEnt[e, 0]
                for j in cutlass.range(mEnt[e, 1], unroll=1):
                    qb = q_lo + j * self.tile_m
                    if cutlass.const_expr(self.deterministic):
                        # every tile of the previous block has landed (waited below), so all are
                        # freed first: the consumers write this block while one lane waits for its
                        # turn (the block's semaphore counts this visit's rank), and go on to the
                        # next block; the adds then wait for the tiles and the turn
                        for wg in cutlass.range_constexpr(cfg.num_mma_wg):
                            cute.arch.barrier_arrive(
                                barrier_id=int(NamedBarrier.DQEmptyWG1) + wg, number_of_threads=threads
                            )
                        sem = mSem.iterator + cute.crd2idx((qb // self.tile_m, head), mSem.layout)
                        rank = mRanks[visit]
                        if cute.arch.lane_idx() == 0:
                            while load_acquire_i32(sem) != rank:
                                pass
                        cute.arch.sync_warp()
                        for wg in cutlass.range_constexpr(cfg.num_mma_wg):
                            cute.arch.barrier(
                                barrier_id=int(NamedBarrier.DQFullWG1) + wg, number_of_threads=threads
                            )
                            self.dq_reduce_add(tma_atom_dq, sdQ, gdQ_head, qb, wg)
                        # released once the adds have landed, not only read shared memory: every
                        # lane waits for its own bulk groups (the copies' elected lane among them;
                        # elect.sync need not pick lane 0), then lane 0 releases
                        cute.arch.cp_async_bulk_wait_group(0, read=False)
                        cute.arch.sync_warp()
                        if cute.arch.lane_idx() == 0:
                            add_release_i32(sem, 1)
                        cute.arch.sync_warp()
                        visit += 1
                    else:
                        for wg in cutlass.range_constexpr(cfg.num_mma_wg):
                            # the oldest outstanding copy is this warpgroup's previous one
                            cute.arch.cp_async_bulk_wait_group(cfg.num_mma_wg - 1, read=True)
                            cute.arch.barrier_arrive(
                                barrier_id=int(NamedBarrier.DQEmptyWG1) + wg, number_of_threads=threads
                            )
                            cute.arch.barrier(
                                barrier_id=int(NamedBarrier.DQFullWG1) + wg, number_of_threads=threads
                            )
                            self.dq_reduce_add(tma_atom_dq, sdQ, gdQ_head, qb, wg)
        cute.arch.cp_async_bulk_wait_group(0, read=False)  # the last reductions land before exit

    @cute.jit
    def dq_reduce_add(self, tma_atom_dq, sdQ, gdQ_head, qb, wg: cutlass.Constexpr):
        """Issue (and commit) the TMA reduce-add of warpgroup ``wg``'s shared-memory dQ tile into
        the rows of q block ``qb`` of one head's dq_acc."""
        gdQ = cute.local_tile(
            cute.domain_offset((qb, 0), gdQ_head),
            (self.dq_rows, self.dq_cols),
            (wg, 0) if self.dq_split_rows else (0, wg),
        )
        s_part, g_part = cpasync.tma_partition(
            tma_atom_dq,
            0,
            cute.make_layout(1),
            cute.group_modes(sdQ[None, None, wg], 0, 2),
            cute.group_modes(gdQ, 0, 2),
        )
        cute.copy(tma_atom_dq, s_part, g_part)
        cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def epilogue_dkv_store(
        self, ctid, tiled_mma_dkv, acc_dK, acc_dV, sK, sV, tma_dkv, n0, head_kv, grad_scale, dv_scale
    ):
        """``dkv_store``: this tile's rows of dk / dv (the CTA is their one writer) in q's dtype,
        through K's and V's shared buffers and one TMA store each (rows past Tk clipped by the
        TMA unit). Stores from registers took 64 4-byte stores per thread that the CTA's exit
        waited on; short walks (a sliding window: about 15 q blocks per key tile) felt them."""
        cfg = self.cfg
        consumers = cfg.num_mma_wg * 128
        tma_dk, tma_atom_dk, tma_dv, tma_atom_dv = tma_dkv
        # every warpgroup's last dQ GEMM (dS K) read all of sK: all of them are done before any
        # overwrites it (S^T and dP^T read only the warpgroup's own rows of sK and sV)
        cute.arch.barrier(barrier_id=int(NamedBarrier.Epilogue), number_of_threads=consumers)
        store_atom = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype
        )
        thr_store = cute.make_tiled_copy_C(store_atom, tiled_mma_dkv).get_slice(ctid)
        self.stage_rows(acc_dK, grad_scale, sK, store_atom, thr_store)
        self.stage_rows(acc_dV, dv_scale, sV, store_atom, thr_store)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(NamedBarrier.Epilogue), number_of_threads=consumers)
        if ctid < 32:
            self.tma_store_tile(tma_atom_dk, tma_dk, sK, n0, head_kv)
            self.tma_store_tile(tma_atom_dv, tma_dv, sV, n0, head_kv)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def stage_rows(self, acc, scale, s_buf, store_atom, thr_store):
        """``acc`` times ``scale`` in q's dtype into ``s_buf`` (this thread's fragment)."""
        r = cute.make_rmem_tensor_like(acc, self.dtype)
        r.store((acc.load() * scale).to(self.dtype))
        cute.copy(store_atom, thr_store.retile(r), thr_store.partition_D(s_buf))

    @cute.jit
    def tma_store_tile(self, tma_atom, tma_t, s_buf, n0, head_kv):
        """One TMA store of ``s_buf`` (tile_n, D) to rows n0.. of head ``head_kv`` of ``tma_t``."""
        g = cute.local_tile(
            cute.domain_offset((n0, 0), tma_t[None, None, head_kv]), (self.tile_n, self.hdim), (0, 0)
        )
        s_part, g_part = cpasync.tma_partition(
            tma_atom, 0, cute.make_layout(1), cute.group_modes(s_buf, 0, 2), cute.group_modes(g, 0, 2)
        )
        cute.copy(tma_atom, s_part, g_part)

    @cute.jit
    def epilogue_dkv(
        self, ctid, tiled_mma_dkv, acc_dK, acc_dV, mdK, mdV, n0, n_stop, head_kv, grad_scale, dv_scale
    ):
        """Rows n0 .. n_stop - 1 of dk / dv from the register accumulators (dK times
        ``grad_scale``, dV times ``dv_scale``: the scale folded into P, see the module docstring):
        stored in q's dtype with ``dkv_store`` (a segment tile's; whole tiles go through
        `epilogue_dkv_store`), else added in float32: other CTAs (other q heads of the GQA
        group) may add to the same rows, so the adds are atomic."""
        thr_dkv = tiled_mma_dkv.get_slice(ctid)
        cdKV = acc_rows_cols(thr_dkv.partition_C(cute.make_identity_tensor((self.tile_n, self.hdim))))
        dk = acc_rows_cols(acc_dK)
        dv = acc_rows_cols(acc_dV)
        row_stride = mdK.stride[0]
        base_k = mdK.iterator + cute.crd2idx((0, head_kv, 0), mdK.layout)
        base_v = mdV.iterator + cute.crd2idx((0, head_kv, 0), mdV.layout)
        for r in cutlass.range_constexpr(cute.size(dk, mode=[0])):
            row = n0 + cdKV[r, 0][0]
            if row < n_stop:  # the tile's own keys: a segment tile stops early (<= Tk)
                off = cutlass.Int64(row) * row_stride
                for c in cutlass.range_constexpr(0, cute.size(dk, mode=[1]), 2):
                    col = cdKV[r, c][1]
                    dk0 = dk[r, c] * grad_scale
                    dk1 = dk[r, c + 1] * grad_scale
                    dv0 = dv[r, c] * dv_scale
                    dv1 = dv[r, c + 1] * dv_scale
                    if cutlass.const_expr(self.dkv_store):
                        is_bf16 = self.dtype == cutlass.BFloat16
                        store_pair_16bit(base_k + off + col, dk0, dk1, is_bf16)
                        store_pair_16bit(base_v + off + col, dv0, dv1, is_bf16)
                    else:
                        red_add_f32x2(base_k + off + col, dk0, dk1)
                        red_add_f32x2(base_v + off + col, dv0, dv1)
