"""FFA forward kernel for sm90 (device code), written in CuTe DSL.

Warp specialisation (384 threads at tile_m = 128):
  warpgroup 0, warp 0  TMA producer: Q once, then K/V blocks of every plan entry of the tile
                       through ``num_stages``-deep K and V pipelines (K runs one block ahead
                       of V, matching the consumers' order);
  warpgroups 1..n      consumers: 64 q rows each; S = Q K^T and O += P V with WGMMA,
                       P kept in registers (RS wgmma), online softmax in the log2 domain.
With ``intra_wg_overlap`` the S GEMM of block j is in flight together with the PV GEMM of
block j-1 while the softmax of block j runs; with ``pingpong`` the two consumer warpgroups
take turns issuing GEMMs (named barriers), so one's softmax overlaps the other's GEMMs.

Q, K and S = Q K^T have head dim D (``cfg.head_dim``); V, the PV GEMM and O have head dim Dv
(``cfg.head_dim_v``: D, or 128 at MLA's D = 192). One code path serves both.

One CTA per (work tile, head); the plan (tile_plan.py) lists per work tile its entries
(slice pieces) and the K/V blocks they need; blocks fully inside a slice skip masking,
partial ones get the band mask, empty ones are never planned (never loaded). With ``pack`` = G
> 1 (GQA packed tiles, compile-time; not in the accumulate mode) a CTA runs one work tile of
tile_m / G tokens for one K/V head: its row p is token m0 + p // G of q head hk * G + p % G,
Q and O travel by TMA through q's storage seen as ((G, Tq), D, Hk).

With ``wait_kv`` (compile-time; normal epilogue only) key/value rows from ``ready_row`` on may
still be arriving when the kernel starts (another stream, a copy engine or a peer GPU writes
them): the producer loads the first block that reaches them only after the int32 at
``ptr_ready`` is >= ``ready_value`` (`atomics.await_flag`: acquire at system scope, then the
async-proxy fence its TMA loads need; bounded). Each CTA waits at most once; CTAs whose blocks
all lie before ``ready_row`` never wait.

Two epilogues, chosen at compile time (``accumulate``):
  normal      O in q.dtype through shared memory (Q's buffer, in O's own (tile_m, Dv) layout)
              and one TMA store per whole tile (a tile that stops early at m_end, a
              per-document tile, stores its rows from registers), lse f32; every
              row of every q tile is written (uncovered rows: out = 0, lse = -inf);
  accumulate  O and lse are a float32 partial result already in global memory (out normalised,
              lse natural log). Each consumer thread reads its own fragment rows/columns,
              merges them with its normalised result by log-sum-exp and writes them back
              (plain loads/stores: one CTA owns each (row, head)). Rows this call does not
              cover, and work tiles with no entries, are not written at all.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.pipeline import PipelineUserType, make_pipeline_state, pipeline_init_arrive, pipeline_init_wait

from .atomics import await_flag, store_pair_16bit
from .config import FwdConfig
from .masking import apply_band_mask, block_is_full, score_coords
from .mma import acc_as_operand_a, acc_rows_cols, smem_layout, smem_transpose, tiled_wgmma, wgmma
from .pipeline import (
    NamedBarrier,
    consumer_wait,
    make_tma_pipelines,
    sched_barrier_arrive,
    sched_barrier_sync,
    tma_load_rows,
)
from .schedule import cta_work_and_head
from .softmax import LN_2, LOG2_E, finalize, init_state, online_step, quad_max, rescale_rows
from .tile_plan import ENTRY_COLS, WORK_COLS

FLAG_HAS_SINK = 1
FLAG_MAX_LOGITS = 2


class FFAForwardSm90:
    """One compiled kernel per (dtype, FwdConfig, softcap on/off, accumulate on/off, pack,
    wait_kv on/off).

    accumulate=False: ``ptr_o`` is the (Tq, Hq, Dv) output in ``dtype``, ``ptr_lse`` the f32 lse,
    both written for every row. accumulate=True: ``ptr_o`` is a float32 (Tq, Hq, Dv) and
    ``ptr_lse`` a float32 (Tq, Hq) accumulator, read and merged in place; no sink.
    """

    def __init__(
        self, dtype, cfg: FwdConfig, has_softcap: bool, accumulate: bool = False, pack: int = 1,
        wait_kv: bool = False,
    ):  # fmt: skip
        self.dtype = dtype
        self.cfg = cfg
        self.has_softcap = has_softcap
        self.accumulate = accumulate
        self.tile_m, self.tile_n, self.hdim = cfg.tile_m, cfg.tile_n, cfg.head_dim
        # pack > 1 (GQA packed, G = Hq / Hk q heads per K/V head): a tile's row p is token
        # m0 + p // G of q head hk * G + p % G, one CTA per (work tile, K/V head); the plan's
        # tiles are tile_m / G tokens. Not with accumulate (the stage API keeps one q head per CTA).
        assert pack >= 1 and cfg.tile_m % pack == 0, f"pack: {pack} must divide tile_m {cfg.tile_m}"
        assert pack == 1 or not accumulate, "pack: the accumulate epilogue is not packed"
        self.pack = pack
        assert not (wait_kv and accumulate), "wait_kv: the accumulate epilogue does not wait"
        self.wait_kv = wait_kv
        self.tile_tokens = cfg.tile_m // pack
        # band masks by bit runs (masking.apply_band_mask) at 128 keys per block: faster at D 64;
        # at D 256 (80 keys) they measured within noise (docs/perf.md) and the comparisons stay
        self.bit_runs = cfg.tile_n == 128
        self.hdim_v = cfg.head_dim_v  # V, O and the PV GEMM's N (self.hdim: Q, K and the QK^T GEMM's K)

    # ------------------------------------------------------------------ host side (traced)
    @cute.jit
    def __call__(
        self,
        ptr_q: cute.Pointer,  # (Tq, Hq, D) contiguous
        ptr_k: cute.Pointer,  # (Tk, Hk, D), rows k_row_stride elements apart, heads contiguous
        ptr_v: cute.Pointer,  # (Tk, Hk, Dv), rows v_row_stride elements apart, heads contiguous
        ptr_o: cute.Pointer,  # (Tq, Hq, Dv) contiguous; dtype (normal) or f32 accumulator (accumulate)
        ptr_lse: cute.Pointer,  # (Tq, Hq) f32 (accumulate: read and merged in place)
        ptr_work: cute.Pointer,  # (W, WORK_COLS) i32
        ptr_ent: cute.Pointer,  # (E, 8) i32
        ptr_sink: cute.Pointer,  # (Tq, Hq) f32, natural-log LSE of the sink logits (dummy if none)
        ptr_maxlogit: cute.Pointer,  # (Hq,) f32, -inf initialised (dummy if not requested)
        ptr_ready: cute.Pointer,  # (1,) i32: rows from ready_row on once >= ready_value (wait_kv)
        total_q: Int32,
        total_k: Int32,
        num_heads_q: Int32,
        num_heads_k: Int32,
        num_work: Int32,
        num_entries: Int32,
        k_row_stride: Int32,  # elements between K rows: Hk * D, or more for packed K/V
        v_row_stride: Int32,  # elements between V rows: Hk * Dv, or more for packed K/V
        scale_log2: Float32,  # log2(e) * (softmax_scale, or softcap with softcap)
        score_premul: Float32,  # softmax_scale / softcap (softcap only)
        softmax_scale: Float32,
        flags: Int32,
        ready_value: Int32,
        ready_row: Int32,
        stream: cuda.CUstream,
    ):
        D, Dv = self.hdim, self.hdim_v
        hq64 = cutlass.Int64(num_heads_q)
        k64 = cutlass.Int64(k_row_stride)
        v64 = cutlass.Int64(v_row_stride)
        mQ = cute.make_tensor(ptr_q, cute.make_layout((total_q, num_heads_q, D), stride=(hq64 * D, D, 1)))
        mK = cute.make_tensor(ptr_k, cute.make_layout((total_k, num_heads_k, D), stride=(k64, D, 1)))
        mV = cute.make_tensor(ptr_v, cute.make_layout((total_k, num_heads_k, Dv), stride=(v64, Dv, 1)))
        mO = cute.make_tensor(ptr_o, cute.make_layout((total_q, num_heads_q, Dv), stride=(hq64 * Dv, Dv, 1)))
        mLSE = cute.make_tensor(ptr_lse, cute.make_layout((total_q, num_heads_q), stride=(hq64, 1)))
        mWork = cute.make_tensor(ptr_work, cute.make_layout((num_work, WORK_COLS), stride=(WORK_COLS, 1)))
        mEnt = cute.make_tensor(ptr_ent, cute.make_layout((num_entries, ENTRY_COLS), stride=(ENTRY_COLS, 1)))
        mSinkLse = cute.make_tensor(ptr_sink, cute.make_layout((total_q, num_heads_q), stride=(hq64, 1)))
        mMaxLogit = cute.make_tensor(ptr_maxlogit, cute.make_layout((num_heads_q,), stride=(1,)))
        mReady = cute.make_tensor(ptr_ready, cute.make_layout((1,), stride=(1,)))
        qhead_per_kvhead = num_heads_q // num_heads_k
        cfg = self.cfg
        # (T, H, D) -> (T, D, H): the sequence axis first, head last, for TMA
        mQt = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[0, 2, 1]))
        mKt = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[0, 2, 1]))
        mVt = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[0, 2, 1]))

        tiled_mma_qk = tiled_wgmma(self.dtype, (cfg.num_mma_wg, 1, 1), (64, self.tile_n))
        tiled_mma_pv = tiled_wgmma(
            self.dtype, (cfg.num_mma_wg, 1, 1), (64, Dv), b_transposed=True, a_in_registers=True
        )
        sQ_layout = smem_layout(self.dtype, self.tile_m, D, None)
        sK_layout = smem_layout(self.dtype, self.tile_n, D, cfg.num_stages)
        sV_layout = smem_layout(self.dtype, self.tile_n, Dv, cfg.num_stages)
        # O goes out through Q's buffer in its own layout (Dv <= D columns: it fits). Both tile
        # the rows first in swizzle atoms of the same width (64 columns at Dv, D in 64, 128,
        # 192, 256), so the O rows of a warpgroup land only on its own Q rows (epilogue_store).
        sO_layout = smem_layout(self.dtype, self.tile_m, Dv, None)

        op = cpasync.CopyBulkTensorTileG2SOp()
        G, TT = self.pack, self.tile_tokens
        if cutlass.const_expr(G > 1):
            mQp = self.packed_rows(ptr_q, total_q, D, hq64, num_heads_k)
            tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(op, mQp, sQ_layout, ((G, TT), D))
        else:
            tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(op, mQt, sQ_layout, (self.tile_m, D))
        tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(
            op, mKt, cute.select(sK_layout, mode=[0, 1]), (self.tile_n, D), 1
        )
        tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(
            op, mVt, cute.select(sV_layout, mode=[0, 1]), (self.tile_n, Dv), 1
        )
        if cutlass.const_expr(self.accumulate):
            # no TMA store: the epilogue reads and writes the f32 accumulator directly
            # (tma_atom_q only fills the unused descriptor argument)
            tma_atom_o, tma_o = tma_atom_q, mO
        elif cutlass.const_expr(G > 1):
            mOp = self.packed_rows(ptr_o, total_q, Dv, hq64, num_heads_k)
            tma_atom_o, tma_o = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mOp, sO_layout, ((G, TT), Dv)
            )
        else:
            mOt = cute.make_tensor(mO.iterator, cute.select(mO.layout, mode=[0, 2, 1]))
            tma_atom_o, tma_o = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mOt, sO_layout, (self.tile_m, Dv)
            )
        elem_bytes = self.dtype.width // 8
        self.bytes_q = self.tile_m * D * elem_bytes
        self.bytes_k = self.tile_n * D * elem_bytes
        self.bytes_v = self.tile_n * Dv * elem_bytes

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, cfg.num_stages * 2]
            mbar_v: cute.struct.MemRange[cutlass.Int64, cfg.num_stages * 2]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]

        num_heads = num_heads_k if cutlass.const_expr(G > 1) else num_heads_q  # CTAs per work tile
        self.kernel(
            tma_q,
            tma_k,
            tma_v,
            tma_atom_q,
            tma_atom_k,
            tma_atom_v,
            tma_o,
            tma_atom_o,
            mO,
            mLSE,
            mWork,
            mEnt,
            mSinkLse,
            mMaxLogit,
            mReady,
            sQ_layout,
            sK_layout,
            sV_layout,
            sO_layout,
            tiled_mma_qk,
            tiled_mma_pv,
            scale_log2,
            score_premul,
            softmax_scale,
            qhead_per_kvhead,
            num_work,
            num_heads,
            flags,
            ready_value,
            ready_row,
            SharedStorage,
        ).launch(
            grid=[num_work * num_heads, 1, 1],
            block=[cfg.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
        )

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        tma_q: cute.Tensor,
        tma_k: cute.Tensor,
        tma_v: cute.Tensor,
        tma_atom_q: cute.CopyAtom,
        tma_atom_k: cute.CopyAtom,
        tma_atom_v: cute.CopyAtom,
        tma_o: cute.Tensor,
        tma_atom_o: cute.CopyAtom,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mWork: cute.Tensor,
        mEnt: cute.Tensor,
        mSinkLse: cute.Tensor,
        mMaxLogit: cute.Tensor,
        mReady: cute.Tensor,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        scale_log2: Float32,
        score_premul: Float32,
        softmax_scale: Float32,
        qhead_per_kvhead: Int32,
        num_work: Int32,
        num_heads: Int32,
        flags: Int32,
        ready_value: Int32,
        ready_row: Int32,
        SharedStorage: cutlass.Constexpr,
    ):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_q)
            cpasync.prefetch_descriptor(tma_atom_k)
            cpasync.prefetch_descriptor(tma_atom_v)
            if cutlass.const_expr(not self.accumulate):
                cpasync.prefetch_descriptor(tma_atom_o)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        pipe_q, pipe_k, pipe_v = make_tma_pipelines(storage, cfg, self.bytes_q, self.bytes_k, self.bytes_v)
        pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sO = storage.sQ.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)  # Q's buffer, O's layout

        w, head = cta_work_and_head(flags, num_work, num_heads)
        m0 = mWork[w, 0]
        e0 = mWork[w, 1]
        e1 = mWork[w, 2]
        nb_total = mWork[w, 3]
        m_end = mWork[w, 4]  # rows m0 .. m_end - 1 are this tile's to store (tile_plan.row_tiles)
        head_kv = head  # pack > 1: the CTA's head is its K/V head
        if cutlass.const_expr(self.pack == 1):
            head_kv = head // qhead_per_kvhead

        pipeline_init_wait(cluster_shape_mn=(1, 1))

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(cfg.producer_regs)
            if warp_idx == 0:
                self.producer(
                    tma_q, tma_k, tma_v, tma_atom_q, tma_atom_k, tma_atom_v, sQ, sK, sV,
                    pipe_q, pipe_k, pipe_v, mEnt, m0, e0, e1, nb_total, head, head_kv,
                    mReady, ready_value, ready_row,
                )  # fmt: skip
        else:
            cute.arch.setmaxregister_increase(cfg.mma_regs)
            self.consumer(
                tidx - 128, sQ, sK, sV, sO, pipe_q, pipe_k, pipe_v, tiled_mma_qk, tiled_mma_pv,
                tma_o, tma_atom_o, mO, mLSE, mEnt, mSinkLse, mMaxLogit, m0, m_end, e0, e1, nb_total, head,
                scale_log2, score_premul, softmax_scale, flags,
            )  # fmt: skip

    @cute.jit
    def producer(
        self, tma_q, tma_k, tma_v, tma_atom_q, tma_atom_k, tma_atom_v, sQ, sK, sV,
        pipe_q, pipe_k, pipe_v, mEnt, m0, e0, e1, nb_total, head, head_kv,
        mReady, ready_value, ready_row,
    ):  # fmt: skip
        cfg = self.cfg
        # wait_kv: 0 until this CTA has waited for the rows from ready_row on (once at most)
        waited = Int32(0)
        gQ = tma_q[None, None, head]
        gK = tma_k[None, None, head_kv]
        gV = tma_v[None, None, head_kv]
        q_state = make_pipeline_state(PipelineUserType.Producer, 1)
        k_state = make_pipeline_state(PipelineUserType.Producer, cfg.num_stages)
        v_state = make_pipeline_state(PipelineUserType.Producer, cfg.num_stages)
        if nb_total > 0:
            kb = mEnt[e0, 0]
            if cutlass.const_expr(self.wait_kv):
                waited = self.await_rows(mReady, ready_value, ready_row, kb, waited)
            # K of block 0 first, then Q (both needed by the first GEMM)
            pipe_k.producer_acquire(k_state)
            tma_load_rows(tma_atom_k, gK, kb, self.tile_n, self.hdim, sK, k_state.index,
                          pipe_k.producer_get_barrier(k_state))  # fmt: skip
            k_state.advance()
            pipe_q.producer_acquire(q_state)
            tma_load_rows(tma_atom_q, gQ, self.tile_row0(m0), self.tile_m, self.hdim, sQ, None,
                          pipe_q.producer_get_barrier(q_state))  # fmt: skip
            if cutlass.const_expr(not cfg.intra_wg_overlap):
                pipe_v.producer_acquire(v_state)
                tma_load_rows(tma_atom_v, gV, kb, self.tile_n, self.hdim_v, sV, v_state.index,
                              pipe_v.producer_get_barrier(v_state))  # fmt: skip
                v_state.advance()
            kb_prev = kb
            j_start = Int32(1)
            for e in cutlass.range(e0, e1, unroll=1):
                k_lo = mEnt[e, 0]
                nblk = mEnt[e, 1]
                for j in cutlass.range(j_start, nblk, unroll=1):
                    kb = k_lo + j * self.tile_n
                    if cutlass.const_expr(self.wait_kv):
                        waited = self.await_rows(mReady, ready_value, ready_row, kb, waited)
                    pipe_k.producer_acquire(k_state)
                    tma_load_rows(tma_atom_k, gK, kb, self.tile_n, self.hdim, sK, k_state.index,
                                  pipe_k.producer_get_barrier(k_state))  # fmt: skip
                    k_state.advance()
                    vb = kb_prev  # V runs one block behind K (consumers' order)
                    if cutlass.const_expr(not cfg.intra_wg_overlap):
                        vb = kb
                    pipe_v.producer_acquire(v_state)
                    tma_load_rows(tma_atom_v, gV, vb, self.tile_n, self.hdim_v, sV, v_state.index,
                                  pipe_v.producer_get_barrier(v_state))  # fmt: skip
                    v_state.advance()
                    kb_prev = kb
                j_start = Int32(0)
            if cutlass.const_expr(cfg.intra_wg_overlap):
                pipe_v.producer_acquire(v_state)
                tma_load_rows(tma_atom_v, gV, kb_prev, self.tile_n, self.hdim_v, sV, v_state.index,
                              pipe_v.producer_get_barrier(v_state))  # fmt: skip
                v_state.advance()

    @cute.jit
    def await_rows(self, mReady, ready_value, ready_row, kb, waited):
        """Before K block ``kb`` is loaded: if it reaches row ``ready_row`` and this CTA has not
        waited yet, wait for the flag (V blocks follow their K block: covered too). Returns the
        new ``waited``."""
        if waited == 0 and kb + self.tile_n > ready_row:
            await_flag(mReady.iterator, ready_value)
            waited = Int32(1)
        return waited

    @cute.jit
    def scores(
        self,
        acc_S: cute.Tensor,
        tScS: cute.Tensor,
        t0ScS: cute.Tensor,
        ks,
        ke,
        lo,
        hi,
        qs,
        qe,
        kb,
        m0,
        score_premul: Float32,
        raw_max: cute.Tensor,
        track_max,
        masked: cutlass.Constexpr = None,
    ):
        """Mask (masked=True; None: decide at run time), track the pre-softcap max, apply softcap."""
        if cutlass.const_expr(masked is None):
            full = block_is_full(kb, m0, self.tile_tokens, self.tile_n, ks, ke, lo, hi, qs, qe)
            if not full:
                apply_band_mask(acc_S, tScS, t0ScS, kb, m0, ks, ke, lo, hi, qs, qe, self.bit_runs, self.pack)
        elif cutlass.const_expr(masked):
            apply_band_mask(acc_S, tScS, t0ScS, kb, m0, ks, ke, lo, hi, qs, qe, self.bit_runs, self.pack)
        if cutlass.const_expr(self.has_softcap):
            s = acc_rows_cols(acc_S)
            if track_max:
                for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                    mx = raw_max[r]
                    for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
                        mx = cute.arch.fmax(mx, s[r, c])
                    raw_max[r] = mx
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                x = acc_S[i]
                y = cute.math.tanh(x * score_premul, fastmath=True)
                acc_S[i] = y if x != -Float32.inf else -Float32.inf

    @cute.jit
    def overlap_step(
        self, masked: cutlass.Constexpr[bool], wg_idx, tiled_mma_qk, tiled_mma_pv, acc_S, tSrQ, tSrK, tOrVt, tOrP,
        acc_O, pipe_k, pipe_v, k_state, v_state, tScS, t0ScS, ks, ke, lo, hi, qs, qe, kb, m0,
        score_premul, raw_max, track_max, row_max, row_sum, row_scale, true_max, scale_log2,
    ):  # fmt: skip
        """One K/V block with intra-warpgroup overlap: S_j = Q K_j^T and O += P_{j-1} V_{j-1} in
        flight together; softmax of S_j while the PV GEMM runs. K_j was waited for by the caller;
        the caller advances the pipeline states."""
        cfg = self.cfg
        sched_barrier_sync(cfg.pingpong, wg_idx)
        wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, k_state.index], True, -1)
        consumer_wait(pipe_v, v_state)
        wgmma(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, v_state.index], False, -1)
        sched_barrier_arrive(cfg.pingpong, wg_idx, cfg.num_mma_wg)
        warpgroup.wait_group(1)
        pipe_k.consumer_release(k_state)
        self.scores(
            acc_S, tScS, t0ScS, ks, ke, lo, hi, qs, qe, kb, m0, score_premul, raw_max, track_max, masked
        )
        online_step(row_max, row_sum, acc_S, row_scale, true_max, scale_log2, cfg.rescale_threshold)
        warpgroup.wait_group(0)
        pipe_v.consumer_release(v_state)
        tOrP.store(acc_as_operand_a(acc_S).load().to(self.dtype))
        rescale_rows(acc_O, row_scale)

    @cute.jit
    def serial_step(
        self, masked: cutlass.Constexpr[bool], wg_idx, tiled_mma_qk, tiled_mma_pv, acc_S, tSrQ, tSrK, tOrVt, tOrP,
        acc_O, pipe_k, pipe_v, k_state, v_state, tScS, t0ScS, ks, ke, lo, hi, qs, qe, kb, m0,
        score_premul, raw_max, track_max, row_max, row_sum, row_scale, true_max, scale_log2,
    ):  # fmt: skip
        """One K/V block without intra-warpgroup overlap (S, softmax, then O += P V)."""
        cfg = self.cfg
        wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, k_state.index], True, 0)
        pipe_k.consumer_release(k_state)
        self.scores(
            acc_S, tScS, t0ScS, ks, ke, lo, hi, qs, qe, kb, m0, score_premul, raw_max, track_max, masked
        )
        online_step(row_max, row_sum, acc_S, row_scale, true_max, scale_log2, cfg.rescale_threshold)
        tOrP.store(acc_as_operand_a(acc_S).load().to(self.dtype))
        rescale_rows(acc_O, row_scale)
        consumer_wait(pipe_v, v_state)
        wgmma(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, v_state.index], False, 0)
        pipe_v.consumer_release(v_state)

    @cute.jit
    def consumer(
        self, ctid, sQ, sK, sV, sO, pipe_q, pipe_k, pipe_v, tiled_mma_qk, tiled_mma_pv,
        tma_o, tma_atom_o, mO, mLSE, mEnt, mSinkLse, mMaxLogit, m0, m_end, e0, e1, nb_total, head,
        scale_log2, score_premul, softmax_scale, flags,
    ):  # fmt: skip
        cfg = self.cfg
        wg_idx = cute.arch.make_warp_uniform(ctid // 128)
        thr_mma_qk = tiled_mma_qk.get_slice(ctid)
        wg_mma_qk = tiled_mma_qk.get_slice(wg_idx * 128)
        wg_mma_pv = tiled_mma_pv.get_slice(wg_idx * 128)
        tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ))
        tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK))
        sVt = smem_transpose(sV)
        tOrVt = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(sVt))
        acc_shape_S = wg_mma_qk.partition_shape_C((self.tile_m, self.tile_n))
        acc_O = cute.make_rmem_tensor(wg_mma_pv.partition_shape_C((self.tile_m, self.hdim_v)), Float32)
        acc_O.fill(0.0)
        tOrP = wg_mma_pv.make_fragment_A(wg_mma_pv.partition_shape_A((self.tile_m, self.tile_n)))

        tScS = score_coords(thr_mma_qk, self.tile_m, self.tile_n)
        t0ScS = score_coords(tiled_mma_qk.get_slice(0), self.tile_m, self.tile_n)

        num_rows = cute.size(acc_rows_cols(acc_O), mode=[0])
        row_max, row_sum = init_state(num_rows)
        row_scale = cute.make_rmem_tensor(num_rows, Float32)
        raw_max = cute.make_rmem_tensor(num_rows, Float32)
        raw_max.fill(-Float32.inf)
        true_max = cute.make_rmem_tensor(num_rows, Float32)
        true_max.fill(-Float32.inf)
        track_max = (flags & FLAG_MAX_LOGITS) != 0

        q_state = make_pipeline_state(PipelineUserType.Consumer, 1)
        k_state = make_pipeline_state(PipelineUserType.Consumer, cfg.num_stages)
        v_state = make_pipeline_state(PipelineUserType.Consumer, cfg.num_stages)

        if nb_total > 0:
            if cutlass.const_expr(cfg.pingpong):  # noqa: SIM102 (DSL: keep compile-time and run-time conditions apart)
                if wg_idx == 0:
                    cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.SchedWG1), number_of_threads=256)
            consumer_wait(pipe_q, q_state)
            # ---- block 0: S = Q K^T, softmax, P
            consumer_wait(pipe_k, k_state)
            acc_S = cute.make_rmem_tensor(acc_shape_S, Float32)
            wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, k_state.index], True, 0)
            pipe_k.consumer_release(k_state)
            k_state.advance()
            self.scores(
                acc_S, tScS, t0ScS, mEnt[e0, 2], mEnt[e0, 3], mEnt[e0, 4], mEnt[e0, 5], mEnt[e0, 6], mEnt[e0, 7],
                mEnt[e0, 0], m0, score_premul, raw_max, track_max,
            )  # fmt: skip
            online_step(row_max, row_sum, acc_S, row_scale, true_max, scale_log2, cfg.rescale_threshold)
            tOrP.store(acc_as_operand_a(acc_S).load().to(self.dtype))
            if cutlass.const_expr(not cfg.intra_wg_overlap):
                consumer_wait(pipe_v, v_state)
                wgmma(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, v_state.index], False, 0)
                pipe_v.consumer_release(v_state)
                v_state.advance()
            # ---- remaining blocks, entry by entry; per entry: masked head, unmasked middle, masked tail
            step = self.overlap_step if cutlass.const_expr(cfg.intra_wg_overlap) else self.serial_step
            j_start = Int32(1)
            for e in cutlass.range(e0, e1, unroll=1):
                k_lo = mEnt[e, 0]
                nblk = mEnt[e, 1]
                ks = mEnt[e, 2]
                ke = mEnt[e, 3]
                lo = mEnt[e, 4]
                hi = mEnt[e, 5]
                qs = mEnt[e, 6]
                qe = mEnt[e, 7]
                h_end = cutlass.max(j_start, mEnt[e, 8])
                f_end = cutlass.max(h_end, mEnt[e, 9])
                for seg in cutlass.range_constexpr(3):
                    seg_lo = (j_start, h_end, f_end)[seg]
                    seg_hi = (h_end, f_end, nblk)[seg]
                    for j in cutlass.range(seg_lo, seg_hi, unroll=1):
                        kb = k_lo + j * self.tile_n
                        consumer_wait(pipe_k, k_state)
                        acc_S = cute.make_rmem_tensor(acc_shape_S, Float32)
                        step(
                            seg != 1, wg_idx, tiled_mma_qk, tiled_mma_pv, acc_S, tSrQ, tSrK, tOrVt, tOrP, acc_O,
                            pipe_k, pipe_v, k_state, v_state, tScS, t0ScS, ks, ke, lo, hi, qs, qe, kb, m0,
                            score_premul, raw_max, track_max, row_max, row_sum, row_scale, true_max, scale_log2,
                        )  # fmt: skip
                        k_state.advance()
                        v_state.advance()
                j_start = Int32(0)
            if cutlass.const_expr(cfg.intra_wg_overlap):
                consumer_wait(pipe_v, v_state)
                wgmma(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, v_state.index], False, 0)
                pipe_v.consumer_release(v_state)
                v_state.advance()

        # ---- epilogue
        if cutlass.const_expr(self.accumulate):
            if nb_total > 0:  # a work tile with no entries leaves the accumulator untouched
                self.epilogue_accumulate(
                    ctid, tiled_mma_pv, acc_O, row_max, row_sum, raw_max, true_max, tma_o, mLSE, m0, m_end, head,
                    scale_log2, softmax_scale, track_max, mMaxLogit,
                )  # fmt: skip
        else:
            self.epilogue_store(
                ctid, sO, tiled_mma_pv, tma_o, tma_atom_o, mO, acc_O, row_max, row_sum, raw_max, true_max, mLSE,
                mSinkLse, mMaxLogit, m0, m_end, head, scale_log2, softmax_scale, flags, track_max,
            )  # fmt: skip

    @cute.jit
    def epilogue_store(
        self, ctid, sO, tiled_mma_pv, tma_o, tma_atom_o, mO, acc_O, row_max, row_sum, raw_max, true_max, mLSE,
        mSinkLse, mMaxLogit, m0, m_end, head, scale_log2, softmax_scale, flags, track_max,
    ):  # fmt: skip
        """Normal epilogue: O (dtype) and lse f32 of the rows m0 .. m_end - 1. A tile that ends
        where the grid would (m0 + tile_m, or Tq) goes through shared memory and one TMA store;
        a segment tile that stops early (tile_plan.row_tiles) stores its rows from registers,
        so the rows after m_end, another tile's, are left alone."""
        cfg = self.cfg
        num_rows = cute.size(row_max)
        thr_mma_pv = tiled_mma_pv.get_slice(ctid)
        tOcO = acc_rows_cols(thr_mma_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.hdim_v))))
        total_q = mLSE.shape[0]
        sink_lse = cute.make_rmem_tensor(num_rows, Float32)
        for r in cutlass.range_constexpr(num_rows):
            row, h = self.token_head(tOcO[r, 0][0], m0, head)
            sv = -Float32.inf
            if (flags & FLAG_HAS_SINK) != 0:  # noqa: SIM102 (DSL: keep compile-time and run-time conditions apart)
                if row < total_q:
                    sv = mSinkLse[row, h]
            sink_lse[r] = sv
        row_inv = cute.make_rmem_tensor(num_rows, Float32)
        row_lse = cute.make_rmem_tensor(num_rows, Float32)
        finalize(row_max, row_sum, scale_log2, sink_lse, row_inv, row_lse)
        rescale_rows(acc_O, row_inv)
        # the grid's tile end (rows past Tq are clipped by the TMA unit); before it: a segment tile
        whole_tile = m_end >= cutlass.min(m0 + self.tile_tokens, total_q)
        if whole_tile:
            rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
            rO.store(acc_O.load().to(self.dtype))
            # O: registers -> smem (sO: Q's buffer in O's layout; each warpgroup only overwrites
            # its own 64 Q rows, which its own last GEMM has finished reading) -> one TMA store
            store_atom = cute.make_copy_atom(
                cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype
            )
            thr_store = cute.make_tiled_copy_C(store_atom, tiled_mma_pv).get_slice(ctid)
            cute.copy(store_atom, thr_store.retile(rO), thr_store.partition_D(sO))
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=int(NamedBarrier.Epilogue), number_of_threads=128 * cfg.num_mma_wg)
            if ctid < 32:
                gO = cute.local_tile(
                    cute.domain_offset((self.tile_row0(m0), 0), tma_o[None, None, head]),
                    (self.tile_m, self.hdim_v),
                    (0, 0),
                )
                s_part, g_part = cpasync.tma_partition(
                    tma_atom_o, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2), cute.group_modes(gO, 0, 2)
                )
                cute.copy(tma_atom_o, s_part, g_part)
                cute.arch.cp_async_bulk_commit_group()
        else:
            self.store_rows(tOcO, acc_O, mO, m0, m_end, head)
        col0 = tOcO[0, 0][1]
        if col0 == 0:
            for r in cutlass.range_constexpr(num_rows):
                row, h = self.token_head(tOcO[r, 0][0], m0, head)
                if row < m_end:
                    mLSE[row, h] = row_lse[r]
        if track_max:
            if cutlass.const_expr(self.pack == 1):
                self.store_max_logit(tOcO, raw_max, true_max, mMaxLogit, m0, m_end, head, softmax_scale)
            else:
                self.store_max_logit_packed(
                    tOcO, raw_max, true_max, mMaxLogit, m0, m_end, head, softmax_scale
                )
        if whole_tile:  # noqa: SIM102 (DSL: keep run-time conditions apart)
            if ctid < 32:
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    def packed_rows(self, ptr, total_q, d, hq64, num_heads_k):
        """Packed tiles: q's (or O's) storage ``(Tq, Hq, d)`` seen as ``((G, Tq), d, Hk)``, a
        tile's rows (head within the group, token) with heads inner, so that one 3-D TMA box
        (d, G, tile_m / G) moves its tile_m rows of one K/V head (traced inline)."""
        G = self.pack
        return cute.make_tensor(
            ptr, cute.make_layout(((G, total_q), d, num_heads_k), stride=((d, hq64 * d), 1, G * d))
        )

    def tile_row0(self, m0):
        """The TMA coordinate of a tile's first row (traced inline): token ``m0``, or packed,
        (head 0 of the group, token ``m0``)."""
        return m0 if self.pack == 1 else (0, m0)

    def token_head(self, p, m0, head):
        """(token, q head) of tile row ``p`` (traced inline): (m0 + p, head), or packed (G =
        pack), (m0 + p // G, head * G + p % G) with ``head`` the CTA's K/V head (G a
        compile-time constant: shifts for powers of two)."""
        if self.pack == 1:
            return m0 + p, head
        return m0 + p // self.pack, head * self.pack + p % self.pack

    @cute.jit
    def store_rows(self, tOcO, acc_O, mO, m0, m_end, head):
        """O rows of tokens m0 .. m_end - 1 from registers (two adjacent columns per 4-byte store)."""
        o = acc_rows_cols(acc_O)
        row_stride = mO.stride[0]
        is_bf16 = self.dtype == cutlass.BFloat16
        base = mO.iterator  # unpacked: the head's offset once (packed: per row, its own head)
        if cutlass.const_expr(self.pack == 1):
            base = mO.iterator + cute.crd2idx((0, head, 0), mO.layout)
        for r in cutlass.range_constexpr(cute.size(o, mode=[0])):
            row, h = self.token_head(tOcO[r, 0][0], m0, head)
            if row < m_end:
                off = cutlass.Int64(row) * row_stride
                if cutlass.const_expr(self.pack > 1):
                    off = off + h * mO.stride[1]
                for c in cutlass.range_constexpr(0, cute.size(o, mode=[1]), 2):
                    store_pair_16bit(base + off + tOcO[r, c][1], o[r, c], o[r, c + 1], is_bf16)

    @cute.jit
    def store_max_logit(self, tOcO, raw_max, true_max, mMaxLogit, m0, m_end, head, softmax_scale):
        """Warp max of the raw score max of the rows below m_end (a segment tile computes the
        rows after it unmasked, for nothing), then one atomic fmax per warp into max_logits[head]."""
        mx = -Float32.inf
        for r in cutlass.range_constexpr(cute.size(raw_max)):
            rm = raw_max[r] if cutlass.const_expr(self.has_softcap) else true_max[r]
            if m0 + tOcO[r, 0][0] < m_end:
                mx = cute.arch.fmax(mx, rm)
        mx = cute.arch.warp_reduction_max(mx)
        if cute.arch.lane_idx() == 0:  # noqa: SIM102 (DSL: keep compile-time and run-time conditions apart)
            if mx != -Float32.inf:
                cute.arch.atomic_fmax(mMaxLogit.iterator + head, mx * softmax_scale)

    @cute.jit
    def store_max_logit_packed(self, tOcO, raw_max, true_max, mMaxLogit, m0, m_end, head, softmax_scale):
        """Packed tiles: a warp's rows belong to several q heads, so the raw score max goes out
        per row (one atomic fmax per row, from the quad's first thread) into max_logits[q head].
        raw_max (softcap) holds the thread's own columns only: the quad's max first."""
        rms = cute.make_rmem_tensor(cute.size(raw_max), Float32)
        for r in cutlass.range_constexpr(cute.size(raw_max)):
            rms[r] = quad_max(raw_max[r]) if cutlass.const_expr(self.has_softcap) else true_max[r]
        if tOcO[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(raw_max)):
                rm = rms[r]
                row, h = self.token_head(tOcO[r, 0][0], m0, head)
                if row < m_end:  # noqa: SIM102 (DSL: keep run-time conditions apart)
                    if rm != -Float32.inf:
                        cute.arch.atomic_fmax(mMaxLogit.iterator + h, rm * softmax_scale)

    @cute.jit
    def epilogue_accumulate(
        self, ctid, tiled_mma_pv, acc_O, row_max, row_sum, raw_max, true_max, mO, mLSE, m0, m_end, head,
        scale_log2, softmax_scale, track_max, mMaxLogit,
    ):  # fmt: skip
        """Accumulate epilogue: merge this tile's result into float32 (out_acc, lse_acc) in place.

        mO: f32 (Tq, Hq, Dv), mLSE: f32 (Tq, Hq). Per row (o2, l2 = this call, o1, l1 = stored):
        l = logaddexp(l1, l2), o = exp(l1 - l) * o1 + exp(l2 - l) * o2. l2 = -inf (row not
        covered by this call) writes nothing; l1 = -inf takes (o2, l2) as they are (whatever o1
        holds). Each thread reads and writes only its own fragment elements; the 4 threads of a
        quad share a row, so all of them read l1 before one of them writes the new lse.
        """
        num_rows = cute.size(row_max)
        thr_mma_pv = tiled_mma_pv.get_slice(ctid)
        tOcO = acc_rows_cols(thr_mma_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.hdim_v))))
        gO = cute.local_tile(
            cute.domain_offset((m0, 0), mO[None, head, None]), (self.tile_m, self.hdim_v), (0, 0)
        )
        tOgO = acc_rows_cols(thr_mma_pv.partition_C(gO))
        no_sink = cute.make_rmem_tensor(num_rows, Float32)
        no_sink.fill(-Float32.inf)
        row_inv = cute.make_rmem_tensor(num_rows, Float32)
        row_lse = cute.make_rmem_tensor(num_rows, Float32)
        finalize(row_max, row_sum, scale_log2, no_sink, row_inv, row_lse)
        rescale_rows(acc_O, row_inv)
        o_new = acc_rows_cols(acc_O)
        # old lse of every row this thread holds (-inf from m_end on: those rows are never written)
        lse_old = cute.make_rmem_tensor(num_rows, Float32)
        for r in cutlass.range_constexpr(num_rows):
            row = m0 + tOcO[r, 0][0]
            lv = -Float32.inf
            if row < m_end:
                lv = mLSE[row, head]
            lse_old[r] = lv
        cute.arch.sync_warp()  # the quad's reads of lse_acc happen before its one write below
        col0 = tOcO[0, 0][1]
        for r in cutlass.range_constexpr(num_rows):
            row = m0 + tOcO[r, 0][0]
            l1 = lse_old[r]
            l2 = row_lse[r]
            if row < m_end:  # noqa: SIM102 (DSL: keep run-time conditions apart)
                if l2 != -Float32.inf:
                    l_new = l2
                    w1 = Float32(0.0)
                    w2 = Float32(1.0)
                    if l1 != -Float32.inf:
                        mx = cute.arch.fmax(l1, l2)
                        mn = l1 if l1 < l2 else l2
                        e = cute.math.exp2((mn - mx) * LOG2_E, fastmath=True)  # in (0, 1]
                        l_new = mx + cute.math.log2(1.0 + e, fastmath=True) * LN_2
                        w1 = cute.math.exp2((l1 - l_new) * LOG2_E, fastmath=True)
                        w2 = cute.math.exp2((l2 - l_new) * LOG2_E, fastmath=True)
                    keep_old = l1 != -Float32.inf
                    # this row's columns: ((2, V, N)), pairs of adjacent columns at even offsets;
                    # out_acc is 16-byte aligned and Dv is even, so every pair is 8-byte aligned
                    g_row = tOgO[r, None]
                    g_ptr = cute.make_ptr(
                        Float32, g_row.iterator.toint(), cute.AddressSpace.gmem, assumed_align=8
                    )
                    g_row = cute.make_tensor(g_ptr, g_row.layout)
                    o_row = cute.make_rmem_tensor(g_row.shape, Float32)
                    cute.autovec_copy(g_row, o_row)
                    for c in cutlass.range_constexpr(cute.size(o_row)):
                        o2 = o_new[r, c]
                        o_row[c] = o_row[c] * w1 + o2 * w2 if keep_old else o2
                    cute.autovec_copy(o_row, g_row)
                    if col0 == 0:
                        mLSE[row, head] = l_new
        if track_max:
            self.store_max_logit(tOcO, raw_max, true_max, mMaxLogit, m0, m_end, head, softmax_scale)
