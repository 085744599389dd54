"""Warp-specialized block-sparse attention forward for Hopper (sm_90), written in Gluon.

The Triton kernel (`pbs.kernels.block_sparse_attn`) is software-pipelined by the compiler:
every loop step ends in CTA-wide barriers, so its two warpgroups do their softmax at the same time
while the tensor cores wait, and each program pays its prologue (list lookup, Q load, pipeline
fill) with nothing to overlap it. This kernel splits a CTA into three partitions that talk only
through mbarriers:

* a **producer** warp walks the selected-block list of each tile and streams Q and the selected
  K/V blocks into shared-memory rings with TMA, running ahead of the consumers;
* two **consumer** warpgroups each own 64 of the tile's 128 query rows. Per key block a consumer
  issues ``S = Q K^T`` for block ``j`` and then ``O += P V`` for block ``j - 1`` and does the
  softmax of ``S_j`` while that product runs, so exponentials overlap tensor-core work; the two
  warpgroups drift apart freely and fill each other's gaps (in e4m3 they take turns issuing
  their products, `pbs.kernels.hopper_e4m3`).

Each warpgroup's output leaves through shared memory by one TMA copy: the tile's last K slot,
which the producer gets back only once the copy has read it, holds it (`_consumer`).

The grid is persistent (one CTA per SM). The producer takes tiles from a global counter, in the
Triton kernel's order (query heads of one KV head side by side, heaviest tiles first), and hands
each tile's rank to the consumers through shared memory. A CTA that drew light tiles draws more,
and CTAs running at the same time work on neighbouring ranks, which share K/V in L2. The producer
loads the next tile's Q and first K/V blocks while the consumers finish the current one.

It covers the common case only (`SUPPORTED_DTYPES`, `SUPPORTED_HEAD_DIMS` for queries and
values alike, mask blocks of `BLOCK_SIZE`, compute capability 9.x); the dispatch layer's
`pbs.backends.eligibility.gluon_kernel_reasons` says when it does not apply. Causality is checked
on original positions in the masked tail of each list exactly as in the Triton kernel, which is
this kernel's differential twin (``tests/test_hopper_attn.py``); where that tail starts is read
from the mask (``BlockMask.full_counts``, one rule for every backend), not worked out here.

It also reads one sequence's keys and values from a paged cache in place (``block_table``, a
``page_size`` that is a multiple of the 128-key block or a power of two from 16 to 64): the producer
looks up each block's page and loads it from the cache viewed as ``(num_pages, Hk, page_size, D)``,
the page where the batch was; a block of smaller pages takes one TMA copy per page, each into its
rows of the block's shared-memory buffer.
The last block of a sequence that ends inside a page loads its values through a second descriptor
whose rows end where the sequence ends, so the stale rows after it arrive as zeros.

In the e4m3 precisions (`E4M3_PRECISIONS`, after `pbs.kernels.block_sparse_attn.quantize_call`)
Q.K^T runs on e4m3 wgmma (int8 in `INT8_PRECISIONS`: `_float_scores`), the query-block and
key-block scales folded into the exponent's factor (`_step_scale`), and under ``"fp8"`` P.V too,
against V stored transposed with each 16 keys in the order the weights leave the score
accumulator (`_weights`), so no weight crosses threads. With
the tensor-core work halved, the softmax's instructions per weight set the pace (docs/fp8.md has
the measurements): the weights' factor 448 rides in the exponent (`_softmax_step`), one
exponential in four is a polynomial on the FMA pipe, and the weights are rounded from float32 to
e4m3 four to a register next to the product (`_operand`); the inline PTX of these is in
`pbs.kernels.hopper_e4m3`.
"""

from __future__ import annotations

import functools
import inspect

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from pbs.kernels import _common
from pbs.kernels._common import COMPILE_OPTIONS, FAR_FUTURE, LOG2_E, descriptor_ready, sm_count, tma_descriptor
from pbs.kernels.hopper_e4m3 import TURN_MIN_BLOCKS, exp2_mixed, pass_turn, take_turn, to_e4m3x4
from pbs.layout import cdiv
from pbs.types import PRECISION_FORMATS

# Triton 3.6 names the TMA load async_copy_global_to_shared; later releases call it async_load.
_tma_load = getattr(tma, "async_load", None) or getattr(tma, "async_copy_global_to_shared", None)
_tma_store = getattr(tma, "async_store", None) or getattr(tma, "async_copy_shared_to_global", None)
_partition_barrier = getattr(gl, "barrier", None) or getattr(gl, "thread_barrier", None)
if (_tma_load is None or _tma_store is None or _partition_barrier is None
        or "functions_and_args" not in inspect.signature(gl.warp_specialize).parameters):
    raise ImportError("pbs.kernels.hopper_attn is written for the Gluon API of Triton 3.6-3.9")

BLOCK_SIZE = 128  # query rows per tile and keys per block (the mask block)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (64, 128)
# The `pbs.PBSConfig.precision` values with e4m3 Q and K, and with int8 Q and K (`_float_scores`).
E4M3_PRECISIONS = tuple(name for name, (qk_format, _) in PRECISION_FORMATS.items() if qk_format == "e4m3")
INT8_PRECISIONS = tuple(name for name, (qk_format, _) in PRECISION_FORMATS.items() if qk_format == "int8")
QUANTIZED_PRECISIONS = E4M3_PRECISIONS + INT8_PRECISIONS  # every quantized precision the kernel computes
# int8 scores come out as the float32 SCORE_OFFSET + s (`pbs.kernels._common.SCORE_OFFSET`), and the
# offset is taken off in the exponent's multiply-add, where the scale is applied anyway: no score
# takes a conversion instruction (I2F, quarter-rate like the exponentials) or a subtraction.
SCORE_OFFSET = gl.constexpr(_common.SCORE_OFFSET)
_SCORE_OFFSET_BITS = gl.constexpr(_common.SCORE_OFFSET_BITS)
COMPUTE_CAPABILITY_MAJOR = 9
HALF_ROWS = 64  # query rows per consumer warpgroup
MIN_PAGE_SIZE = 16  # the smallest page a TMA copy moves into its rows of a key block (8 swizzled rows x 2)
BLOCK = gl.constexpr(BLOCK_SIZE)
HALF = gl.constexpr(HALF_ROWS)
STAGES = 3  # K/V ring depth; 3 x (K + V) + Q = 224 KB of shared memory at head dim 128
_FAR_FUTURE = gl.constexpr(FAR_FUTURE)  # the position of padded key slots (see pbs.kernels._common)
_PRODUCER_REGS = gl.constexpr(24)
_CONSUMER_REGS = gl.constexpr(240)


@gluon.jit
def _tile_coords(rank, group, tiles_per_head, heads_k):
    """(batch, KV head, query head, tile) of tile ``rank``: query heads of one KV head fastest, then
    tiles heaviest (last) first, then KV heads, then batches.

    Within each run of ``group`` ranks the query head is rotated by the run index. The rotation
    dates from the static schedule that the global tile counter replaced (program ``p`` took ranks
    ``p, p + P, ...``, ``P`` the SM count, often a multiple of the group, so without it a program
    always got the same query head of each group). With the counter the programs draw ranks as they
    finish, so the order of the heads inside a run no longer decides the balance; the rotation only
    changes which head of a run comes first (docs/notes.md, "Load balance")."""
    rest = rank // group
    i_g = (rank + rest) % group
    i_t = tiles_per_head - 1 - rest % tiles_per_head
    rest = rest // tiles_per_head
    i_hk = rest % heads_k
    i_b = rest // heads_k
    return i_b, i_hk, i_hk * group + i_g, i_t


@gluon.jit
def _tile_list(rank, ptrs, strides, dims, DENSE: gl.constexpr, CAUSAL: gl.constexpr):
    """Coordinates of tile ``rank``, its count of selected blocks and a pointer to its block list.

    ``DENSE``: every visible key block, in order (block ``it`` is entry ``it``); no list is read."""
    counts_ptr, indices_ptr = ptrs[0], ptrs[1]
    stride_cb, stride_ch, stride_ci = strides[0], strides[1], strides[2]
    stride_ib, stride_ih, stride_ii = strides[3], strides[4], strides[5]
    heads_k, group, seq_len_q, seq_len_k, tiles_per_head, query_offset = dims[0], dims[1], dims[2], dims[3], dims[4], dims[6]
    i_b, i_hk, i_hq, i_t = _tile_coords(rank, group, tiles_per_head, heads_k)
    if DENSE:
        if CAUSAL:
            # Up to the block of the tile's last query position (queries are the last Nq of Nk).
            count = (gl.minimum(i_t * BLOCK + BLOCK, seq_len_q) - 1 + query_offset) // BLOCK + 1
        else:
            count = (seq_len_k + BLOCK - 1) // BLOCK
        p_list = indices_ptr
    else:
        count = gl.load(counts_ptr + i_b.to(gl.int64) * stride_cb + i_hq * stride_ch + i_t * stride_ci)
        p_list = indices_ptr + i_b.to(gl.int64) * stride_ib + i_hq.to(gl.int64) * stride_ih + i_t.to(gl.int64) * stride_ii
    return i_b, i_hk, i_hq, i_t, count, p_list


@gluon.jit
def _block_start(p_list, it, DENSE: gl.constexpr):
    """First key slot of entry ``it`` of a tile's list."""
    if DENSE:
        start = it * BLOCK
    else:
        start = gl.load(p_list + it).to(gl.int32) * BLOCK
    return start


@gluon.jit
def _full_count(i_b, i_hq, i_t, ptrs, strides, dims, DENSE: gl.constexpr, CAUSAL: gl.constexpr):
    """How many leading entries of the tile's list need no per-token check
    (``BlockMask.full_counts``: a tile is one query block here). ``DENSE``: the key blocks wholly
    at or before the tile's first query (causal), or every whole key block (not causal)."""
    if DENSE:
        if CAUSAL:
            full = (i_t * BLOCK + dims[6] + 1) // BLOCK
        else:
            full = dims[3] // BLOCK
    else:
        full_ptr = ptrs[6]
        stride_fb, stride_fh, stride_fi = strides[15], strides[16], strides[17]
        full = gl.load(full_ptr + i_b.to(gl.int64) * stride_fb + i_hq * stride_fh + i_t * stride_fi)
    return full


@gluon.jit
def _gate_open(ptrs, dims):
    """Whether the density probe's counters (kept, visible) say dense:
    ``kept * 2**20 > limit * visible`` in integers, the rule `pbs.dense.probe_says_dense` applies on
    the host to the same two numbers, so host and device never disagree."""
    gate_ptr = ptrs[7]
    kept = gl.load(gate_ptr).to(gl.int64)
    visible = gl.load(gate_ptr + 1).to(gl.int64)
    return kept * 1048576 > dims[8].to(gl.int64) * visible


@gluon.jit
def _publish_tile(rank, t, tile_ids, tile_ready, tile_empty):
    """Producer: hand tile ``rank`` (or the end mark, any rank >= the tile count) to the consumers."""
    slot = t % 2
    mbarrier.wait(tile_empty.index(slot), ((t // 2) & 1) ^ 1)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    tile_ids.index(slot).store(gl.full([1], rank, gl.int32, layout))
    mbarrier.arrive(tile_ready.index(slot))


@gluon.jit
def _next_tile(t, tile_ids, tile_ready, tile_empty):
    """Consumer: the rank of its ``t``-th tile, as published by the producer."""
    slot = t % 2
    mbarrier.wait(tile_ready.index(slot), (t // 2) & 1)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    rank = gl.max(tile_ids.index(slot).load(layout), 0)
    mbarrier.arrive(tile_empty.index(slot))
    return rank


@gluon.jit
def _turn_taken(turn, here, WG: gl.constexpr, TURNS: gl.constexpr):
    """`take_turn` where the warpgroups take turns (``TURNS``) and the tile has the blocks for it
    (``here``: at least `TURN_MIN_BLOCKS`); ``turn`` as it was otherwise."""
    if TURNS:
        if here:
            turn = take_turn(turn, WG)
    return turn


@gluon.jit
def _turn_passed(turn, here, WG: gl.constexpr, TURNS: gl.constexpr):
    """`pass_turn` under the same conditions as `_turn_taken`."""
    if TURNS:
        if here:
            turn = pass_turn(turn, WG)
    return turn


@gluon.jit
def _float_scores(s, QK_INT8: gl.constexpr):
    """The step's scores as float32: as they are, or int8 Q.K^T's int32 ones as ``SCORE_OFFSET + s``
    (one integer add; `_softmax_step` takes the offset off)."""
    if QK_INT8:
        s = (s + _SCORE_OFFSET_BITS).to(gl.float32, bitcast=True)
    return s


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale, LOG2_GAIN: gl.constexpr, PV_FP8: gl.constexpr, QK_INT8: gl.constexpr):
    """Online-softmax update from raw scores (scale folded into the exponent's FMA). The weights
    and the row sums come out times ``2 ** LOG2_GAIN`` (the same FMA: no multiply per weight).
    Weights bound for e4m3 take one exponential in four from a polynomial (`exp2_mixed`).
    ``QK_INT8``: the scores carry `SCORE_OFFSET` (`_float_scores`), taken off per row here and in
    the same FMA per weight; it changes a step's exponents by a rounding of ``SCORE_OFFSET *
    qk_scale``, about 2^-24 of it, the same for every weight of a row."""
    if QK_INT8:
        offset = SCORE_OFFSET * qk_scale
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale - offset)
        x = s * qk_scale - gl.expand_dims(m_new + offset - LOG2_GAIN, 1)
    else:
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        x = s * qk_scale - gl.expand_dims(m_new - LOG2_GAIN, 1)
    if PV_FP8:
        p = exp2_mixed(x)
    else:
        p = gl.exp2(x)
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    return m_new, l_i, p, alpha


@gluon.jit
def _page_of(table_ptr, key, seq_len_k, PAGE_SIZE: gl.constexpr):
    """The cache page holding ``key`` of the sequence, read from its block-table row at the key
    clamped to the sequence's last (one unsigned min: a key past the end, or a -1 pad read as a
    huge unsigned number, reads the last page's entry)."""
    key = gl.minimum(key.to(gl.uint32, bitcast=True), (seq_len_k - 1).to(gl.uint32, bitcast=True))
    return gl.load(table_ptr + key // PAGE_SIZE)


@gluon.jit
def _ragged_tiles(starts_ptr, b, batch):
    """Query tiles of entry ``b`` of a ragged batch (0 past the last entry)."""
    inside = b < batch
    first_row = gl.load(starts_ptr + b, mask=inside, other=0)
    end_row = gl.load(starts_ptr + b + 1, mask=inside, other=0)
    return (end_row - first_row + BLOCK - 1) // BLOCK


@gluon.jit
def _ragged_rank(draw, b, first, ptrs, dims):
    """``(rank, b, first)``: the rank in the padded tile order (`_tile_coords`) of the ``draw``-th
    tile of a ragged batch, whose entry ``b`` has only its first ``cdiv(rows_b, BLOCK)`` query
    tiles (``row_starts``), the entry it fell in and that entry's first draw. The tiles past an
    entry's rows get no draw at all, so nothing is spent on them. A CTA's draws only grow (one
    global counter), so the entry is found by walking forward from the last one: each CTA reads
    every entry's start once per launch."""
    starts_ptr = ptrs[10]
    heads_k, group, tiles_per_head, num_tiles, batch = dims[0], dims[1], dims[4], dims[5], dims[9]
    heads_q = heads_k * group
    tiles = _ragged_tiles(starts_ptr, b, batch) * heads_q
    while (b < batch) & (draw >= first + tiles):
        first += tiles
        b += 1
        tiles = _ragged_tiles(starts_ptr, b, batch) * heads_q
    rank = num_tiles  # past the last entry: the end mark
    if b < batch:
        # Real tiles are the last ``own`` of each padded head run (heaviest first: i_t = own - 1 .. 0).
        own = tiles // heads_q
        local = draw - first
        i_hk = local // (group * own)
        rank = ((b * heads_k + i_hk) * tiles_per_head + tiles_per_head - own) * group + local % (group * own)
    return rank, b, first


@gluon.jit
def _producer(descs, bufs, bars, ptrs, strides, dims, STAGES: gl.constexpr, DENSE: gl.constexpr,
              GATED: gl.constexpr, CAUSAL: gl.constexpr, PAGE_SIZE: gl.constexpr, RAGGED: gl.constexpr,
              PV_FP8: gl.constexpr):
    q_desc, k_desc, v_desc, v_last_desc, _ = descs
    table_ptr = ptrs[9]
    seq_len_k = dims[3]
    q_smem, k_smem, v_smem = bufs
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, tile_ids, tile_ready, tile_empty, _ = bars
    tile_counter_ptr = ptrs[5]
    num_tiles = dims[5]

    kv_i = 0
    t = 0
    # Tiles are taken in rank order from a global counter, so a CTA that got light tiles takes more
    # of them (the hardware's own balance for a non-persistent grid), while CTAs running at the
    # same time still work on neighbouring ranks, which share K/V in L2.
    rank = gl.atomic_add(tile_counter_ptr, 1, sem="relaxed")
    ragged_b = 0
    ragged_first = 0
    if RAGGED:
        rank, ragged_b, ragged_first = _ragged_rank(rank, ragged_b, ragged_first, ptrs, dims)
    if GATED:
        # A closed gate: publish the end mark at once, and the whole CTA exits.
        if not _gate_open(ptrs, dims):
            rank = num_tiles
    while rank < num_tiles:
        _publish_tile(rank, t, tile_ids, tile_ready, tile_empty)
        # The next tile is claimed now and used after this one's loads, so the atomic's round trip
        # overlaps them (tiles of one or two blocks left it exposed). Relaxed: the counter hands out
        # tickets and publishes no data, and an acquire would hold back the list reads below.
        draw = gl.atomic_add(tile_counter_ptr, 1, sem="relaxed")
        i_b, i_hk, i_hq, i_t, count, p_list = _tile_list(rank, ptrs, strides, dims, DENSE, CAUSAL)
        row0 = i_t * BLOCK

        q_b = i_b
        q_row = row0
        if RAGGED:
            # The packed queries, viewed as (1, Hq, Tq, D): the entry's rows from its first one (rows
            # past its end read the next entry's queries or TMA's zeros; they are never stored).
            q_b = 0
            q_row = gl.load(ptrs[10] + i_b) + row0
        mbarrier.wait(q_empty, (t & 1) ^ 1)
        mbarrier.expect(q_ready, 2 * q_desc.block_type.nbytes)
        _tma_load(q_desc, [q_b, i_hq, q_row, 0], q_ready, q_smem.index(0))
        _tma_load(q_desc, [q_b, i_hq, q_row + HALF, 0], q_ready, q_smem.index(1))

        for it in range(count):
            start_n = _block_start(p_list, it, DENSE)
            slot = kv_i % STAGES
            phase = (kv_i // STAGES) & 1
            if PAGE_SIZE == 0 or PAGE_SIZE >= BLOCK:
                if PAGE_SIZE == 0:
                    kv_b = i_b
                    kv_row = start_n
                else:
                    # A paged cache, viewed as (num_pages, Hk, page_size, D): the block's page in
                    # place of the batch (pages hold whole blocks). The table is read at the block's
                    # first key clamped to the sequence's last, so only at the sequence's own
                    # (checked) pages whatever the entry: a block past seq_len_k reads the last page,
                    # and a -1 pad, huge as unsigned, too (one unsigned min: a signed two-sided clamp
                    # cost the 24-register producer 24 bytes of stack).
                    kv_b = _page_of(table_ptr, start_n, seq_len_k, PAGE_SIZE)
                    kv_row = start_n % PAGE_SIZE
                mbarrier.wait(k_empty.index(slot), phase ^ 1)
                mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
                _tma_load(k_desc, [kv_b, i_hk, kv_row, 0], k_ready.index(slot), k_smem.index(slot))
                mbarrier.wait(v_empty.index(slot), phase ^ 1)
                mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
                if PV_FP8:
                    # e4m3 values stored (B, Hk, Dv, N): the block's keys are columns.
                    _tma_load(v_desc, [kv_b, i_hk, 0, kv_row], v_ready.index(slot), v_smem.index(slot))
                elif PAGE_SIZE == 0:
                    _tma_load(v_desc, [kv_b, i_hk, kv_row, 0], v_ready.index(slot), v_smem.index(slot))
                elif start_n + BLOCK > seq_len_k:
                    # The last page's rows past the sequence hold stale values, which a zero weight
                    # does not cancel if they are NaN: this descriptor ends the page's rows at the
                    # sequence's end, so TMA fills the rest with zeros.
                    _tma_load(v_last_desc, [kv_b, i_hk, kv_row, 0], v_ready.index(slot), v_smem.index(slot))
                else:
                    _tma_load(v_desc, [kv_b, i_hk, kv_row, 0], v_ready.index(slot), v_smem.index(slot))
            else:
                # Pages smaller than a block: the block's PAGES_PER_BLOCK pages, each looked up and
                # loaded by its own TMA copy into its rows of the block's buffer (one barrier for
                # all of them). Pages past the sequence read its last page, their keys masked and
                # their values through the last page's descriptor, as above.
                PAGES_PER_BLOCK: gl.constexpr = BLOCK // PAGE_SIZE
                mbarrier.wait(k_empty.index(slot), phase ^ 1)
                mbarrier.wait(v_empty.index(slot), phase ^ 1)
                mbarrier.expect(k_ready.index(slot), PAGES_PER_BLOCK * k_desc.block_type.nbytes)
                mbarrier.expect(v_ready.index(slot), PAGES_PER_BLOCK * v_desc.block_type.nbytes)
                for j in gl.static_range(PAGES_PER_BLOCK):
                    # One lookup per page for both copies (the producer has 24 registers).
                    page = _page_of(table_ptr, start_n + j * PAGE_SIZE, seq_len_k, PAGE_SIZE)
                    _tma_load(k_desc, [page, i_hk, 0, 0], k_ready.index(slot),
                              k_smem.index(slot).slice(j * PAGE_SIZE, PAGE_SIZE, dim=2))
                    if start_n + (j + 1) * PAGE_SIZE > seq_len_k:
                        _tma_load(v_last_desc, [page, i_hk, 0, 0], v_ready.index(slot),
                                  v_smem.index(slot).slice(j * PAGE_SIZE, PAGE_SIZE, dim=2))
                    else:
                        _tma_load(v_desc, [page, i_hk, 0, 0], v_ready.index(slot),
                                  v_smem.index(slot).slice(j * PAGE_SIZE, PAGE_SIZE, dim=2))
            kv_i += 1
        t += 1
        rank = draw
        if RAGGED:
            rank, ragged_b, ragged_first = _ragged_rank(rank, ragged_b, ragged_first, ptrs, dims)
    _publish_tile(rank, t, tile_ids, tile_ready, tile_empty)  # the end mark


@gluon.jit
def _consumer(WG: gl.constexpr, descs, bufs, bars, ptrs, strides, dims, HEAD_DIM: gl.constexpr,
              STAGES: gl.constexpr, CAUSAL: gl.constexpr,
              PARTIAL_LAST_KEY_BLOCK: gl.constexpr, KEYS_PERMUTED: gl.constexpr,
              QUERIES_PERMUTED: gl.constexpr, DENSE: gl.constexpr, WRITE_LSE: gl.constexpr,
              RAGGED: gl.constexpr, QK_8BIT: gl.constexpr, PV_FP8: gl.constexpr, O_TMA: gl.constexpr):
    q_desc, k_desc, v_desc, _, o_desc = descs
    q_smem, k_smem, v_smem = bufs
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, tile_ids, tile_ready, tile_empty, o_staged = bars
    qpos_ptr, kpos_ptr, o_ptr = ptrs[2], ptrs[3], ptrs[4]
    (stride_cb, stride_ch, stride_ci, stride_ib, stride_ih, stride_ii, stride_qpb, stride_qph, stride_qpn,
     stride_kpb, stride_kph, stride_kpn, stride_ob, stride_oh, stride_on, stride_fb, stride_fh, stride_fi,
     stride_lb, stride_lh, stride_qsb, stride_qsh, stride_ksb, stride_ksh, stride_vsb, stride_vsh) = strides
    seq_len_q, seq_len_k, num_tiles, query_offset, qk_scale = dims[2], dims[3], dims[5], dims[6], dims[7]
    NEEDS_SPLIT: gl.constexpr = CAUSAL or PARTIAL_LAST_KEY_BLOCK
    out_dtype: gl.constexpr = o_ptr.dtype.element_ty
    p_dtype: gl.constexpr = v_desc.dtype  # the weights' dtype on the tensor cores: V's
    QK_INT8: gl.constexpr = q_desc.dtype == gl.int8

    # A wgmma step reduces 32 bytes of each row: 16 half-precision values, 32 e4m3 or int8 ones.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK, 32 if QK_8BIT else 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 32 if PV_FP8 else 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4 if PV_FP8 else 2)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    s_cols: gl.constexpr = gl.SliceLayout(0, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    o_cols: gl.constexpr = gl.SliceLayout(0, o_layout)
    if QK_INT8:
        zero_s = gl.zeros([HALF, BLOCK], gl.int32, s_layout)
    else:
        zero_s = gl.zeros([HALF, BLOCK], gl.float32, s_layout)
    # e4m3 weights are taken times 448 (their largest value): they are in [0, 1], and e4m3 has
    # 3 bits down to 2^-6 only. The row sums carry the same factor, so the division cancels it.
    LOG2_GAIN: gl.constexpr = 8.807354922057604 if PV_FP8 else 0.0
    # e4m3 warpgroups issue their products in turns (`take_turn`), warpgroup 0 first: warpgroup 1
    # hands it the first turn here, and warpgroup 0 takes the one left over after the last tile.
    # Both read the same tile, so both skip the turns of a tile with fewer than TURN_MIN_BLOCKS.
    TURNS: gl.constexpr = PV_FP8
    turn = gl.zeros([HALF], gl.int32, s_rows)
    if TURNS:
        if WG == 1:
            turn = pass_turn(turn, WG)

    kv_i = 0
    t = 0
    staged = 0  # tiles whose output went out through a K slot (O_TMA): the phase of o_staged
    rank = _next_tile(t, tile_ids, tile_ready, tile_empty)
    while rank < num_tiles:
        i_b, i_hk, i_hq, i_t, count, p_list = _tile_list(rank, ptrs, strides, dims, DENSE, CAUSAL)
        row0 = i_t * BLOCK
        n_unmasked = count
        turns_here = count >= TURN_MIN_BLOCKS
        if NEEDS_SPLIT:
            n_unmasked = _full_count(i_b, i_hq, i_t, ptrs, strides, dims, DENSE, CAUSAL)

        o_m = row0 + WG * HALF + gl.arange(0, HALF, layout=s_rows)
        q_pos = o_m + query_offset
        if CAUSAL:
            if QUERIES_PERMUTED:
                p_qpos = qpos_ptr + i_b.to(gl.int64) * stride_qpb + i_hq.to(gl.int64) * stride_qph + o_m * stride_qpn
                q_pos = gl.load(p_qpos, mask=o_m < seq_len_q, other=0).to(gl.int32)
        p_kpos = kpos_ptr + i_b.to(gl.int64) * stride_kpb + i_hk.to(gl.int64) * stride_kph
        # Quantized Q and K: every score of a step is scaled by the tile's query-block scale and
        # the key block's scale, folded into the exponent's factor (`_step_scale`).
        tile_scale = qk_scale
        p_kscale = ptrs[12]
        if QK_8BIT:
            tile_scale = qk_scale * gl.load(ptrs[11] + i_b.to(gl.int64) * stride_qsb + i_hq.to(gl.int64) * stride_qsh
                                            + i_t)
            p_kscale = ptrs[12] + i_b.to(gl.int64) * stride_ksb + i_hk.to(gl.int64) * stride_ksh

        # A finite start for the running max keeps rows that see no key free of inf - inf.
        m_i = gl.full([HALF], -1.0e30, gl.float32, s_rows)
        l_i = gl.zeros([HALF], gl.float32, s_rows)
        acc = gl.zeros([HALF, HEAD_DIM], gl.float32, o_layout)

        mbarrier.wait(q_ready, t & 1)
        q = q_smem.index(WG).reshape([HALF, HEAD_DIM])
        prev_slot = 0
        if count > 0:
            slot = kv_i % STAGES
            phase = (kv_i // STAGES) & 1
            mbarrier.wait(k_ready.index(slot), phase)
            turn = _turn_taken(turn, turns_here, WG, TURNS)
            s = warpgroup_mma(q, k_smem.index(slot).reshape([BLOCK, HEAD_DIM]).permute((1, 0)), zero_s,
                              use_acc=False, is_async=True)
            turn = _turn_passed(turn, turns_here, WG, TURNS)
            step_scale = _step_scale(tile_scale, p_kscale, p_list, 0, count, DENSE, QK_8BIT)
            # The next entry's scale is read a step ahead: two dependent loads per step otherwise.
            next_scale = _step_scale(tile_scale, p_kscale, p_list, 1, count, DENSE, QK_8BIT)
            s = _float_scores(warpgroup_mma_wait(0, deps=[s]), QK_INT8)
            _release_keys(k_empty, o_staged, slot, count == 1, O_TMA)
            if n_unmasked == 0:
                s = _mask_scores(s, _block_start(p_list, 0, DENSE), q_pos, p_kpos, stride_kpn, seq_len_k,
                                 s_cols, CAUSAL, KEYS_PERMUTED)
            m_i, l_i, p_f32, alpha = _softmax_step(s, m_i, l_i, step_scale, LOG2_GAIN, PV_FP8, QK_INT8)
            p = _weights(p_f32, p_layout, p_dtype, PV_FP8)
            prev_slot = slot
            prev_phase = phase
            kv_i += 1
            for it in range(1, count):
                slot = kv_i % STAGES
                phase = (kv_i // STAGES) & 1
                mbarrier.wait(k_ready.index(slot), phase)
                turn = _turn_taken(turn, turns_here, WG, TURNS)
                s = warpgroup_mma(q, k_smem.index(slot).reshape([BLOCK, HEAD_DIM]).permute((1, 0)), zero_s,
                                  use_acc=False, is_async=True)
                mbarrier.wait(v_ready.index(prev_slot), prev_phase)
                acc = warpgroup_mma(_operand(p, PV_FP8), _values(v_smem, prev_slot, HEAD_DIM, PV_FP8), acc,
                                    is_async=True)
                turn = _turn_passed(turn, turns_here, WG, TURNS)
                step_scale = next_scale
                next_scale = _step_scale(tile_scale, p_kscale, p_list, it + 1, count, DENSE, QK_8BIT)
                # wgmma groups retire in order: one outstanding means S is ready, P V may still run.
                s = _float_scores(warpgroup_mma_wait(1, deps=[s]), QK_INT8)
                _release_keys(k_empty, o_staged, slot, it == count - 1, O_TMA)
                if it >= n_unmasked:
                    s = _mask_scores(s, _block_start(p_list, it, DENSE), q_pos, p_kpos, stride_kpn,
                                     seq_len_k, s_cols, CAUSAL, KEYS_PERMUTED)
                m_i, l_i, p_f32, alpha = _softmax_step(s, m_i, l_i, step_scale, LOG2_GAIN, PV_FP8, QK_INT8)
                acc = _wait_pv(acc, p, PV_FP8)
                mbarrier.arrive(v_empty.index(prev_slot))
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
                p = _weights(p_f32, p_layout, p_dtype, PV_FP8)
                prev_slot = slot
                prev_phase = phase
                kv_i += 1
            mbarrier.arrive(q_empty)
            mbarrier.wait(v_ready.index(prev_slot), prev_phase)
            turn = _turn_taken(turn, turns_here, WG, TURNS)
            acc = warpgroup_mma(_operand(p, PV_FP8), _values(v_smem, prev_slot, HEAD_DIM, PV_FP8), acc,
                                is_async=True)
            turn = _turn_passed(turn, turns_here, WG, TURNS)
            acc = _wait_pv(acc, p, PV_FP8)
            mbarrier.arrive(v_empty.index(prev_slot))
        else:
            mbarrier.arrive(q_empty)

        # Queries with no visible key keep l == 0 and acc == 0: their output is 0 and their LSE
        # -inf. A NaN score makes l NaN for good, and l == 0 is false for NaN, so NaN reaches the
        # output and the LSE (as in the Triton kernel).
        l_nonzero = gl.where(l_i == 0.0, 1.0, l_i)
        l_safe = gl.convert_layout(l_nonzero, o_rows)
        o_d = gl.arange(0, HEAD_DIM, layout=o_cols)
        out = acc / gl.expand_dims(l_safe, 1)
        if PV_FP8:
            # V went in divided by its channel scales (the weights' 448 left with the row sums).
            v_scale = gl.load(ptrs[13] + i_b.to(gl.int64) * stride_vsb + i_hk.to(gl.int64) * stride_vsh + o_d)
            out = out * gl.expand_dims(v_scale, 0)
        out = out.to(out_dtype)
        o_rows_idx = row0 + WG * HALF + gl.arange(0, HALF, layout=o_rows)
        if RAGGED:
            # Entry i_b's rows go to the packed output from its first row on (stride_ob unused).
            first_row = gl.load(ptrs[10] + i_b)
            rows = gl.load(ptrs[10] + i_b + 1) - first_row
            o_base = o_ptr + first_row.to(gl.int64) * stride_on + i_hq.to(gl.int64) * stride_oh
            lse_base = ptrs[8] + first_row.to(gl.int64) + i_hq.to(gl.int64) * stride_lh
        else:
            rows = seq_len_q
            o_base = o_ptr + i_b.to(gl.int64) * stride_ob + i_hq.to(gl.int64) * stride_oh
            lse_base = ptrs[8] + i_b.to(gl.int64) * stride_lb + i_hq.to(gl.int64) * stride_lh
        if O_TMA:
            if count > 0:
                # Through the tile's last K slot, whose release `_release_keys` held back: written
                # there in one pass and sent by one TMA copy (rows past Nq clipped by the descriptor),
                # where stores from the accumulator's layout write 4 bytes each and half-fill sectors.
                mbarrier.wait(o_staged, staged & 1)
                k_smem.index(prev_slot).reshape([BLOCK, HEAD_DIM]).slice(WG * HALF, HALF, dim=0).store(out)
                staging = k_smem.index(prev_slot).slice(WG * HALF, HALF, dim=2)  # the same rows, as the copy takes them
                fence_async_shared()
                _partition_barrier()
                _tma_store(o_desc, [i_b, i_hq, row0 + WG * HALF, 0], staging)
                tma.store_wait(0)
                mbarrier.arrive(k_empty.index(prev_slot))
                staged += 1
            else:
                _store_rows(out, o_base, o_rows_idx, rows, stride_on, o_d)
        else:
            _store_rows(out, o_base, o_rows_idx, rows, stride_on, o_d)
        if WRITE_LSE:
            # m_i and l_i are in the log2 domain of the scaled scores: lse = (m + log2 l) * ln 2.
            lse = gl.where(l_i == 0.0, float("-inf"), (m_i + gl.log2(l_nonzero) - LOG2_GAIN) * 0.6931471805599453)
            if QK_8BIT:
                # K was smoothed: each score is short by scale * q . mean(K), which the quantization
                # pass wrote per query from the unquantized q ((B, Hq, Nq), contiguous).
                shift = gl.load(ptrs[14] + (i_b * (dims[0] * dims[1]) + i_hq).to(gl.int64) * seq_len_q + o_m,
                                mask=o_m < seq_len_q, other=0.0)
                lse = lse + shift * (qk_scale * 0.6931471805599453)
            gl.store(lse_base + o_m, lse, mask=o_m < rows)
        t += 1
        rank = _next_tile(t, tile_ids, tile_ready, tile_empty)
    if TURNS:
        if WG == 0:
            turn = take_turn(turn, WG)


@gluon.jit
def _store_rows(out, o_base, o_rows_idx, rows, stride_on, o_d):
    """Consumer: its output rows stored from registers, rows past ``rows`` left alone (a ragged
    batch's packed rows, the e4m3 precisions, a tile without blocks; see `_consumer`)."""
    p_out = o_base + gl.expand_dims(o_rows_idx.to(gl.int64) * stride_on, 1) + gl.expand_dims(o_d, 0)
    gl.store(p_out, out, mask=gl.expand_dims(o_rows_idx < rows, 1))


@gluon.jit
def _release_keys(k_empty, o_staged, slot, last, O_TMA: gl.constexpr):
    """Consumer, once a block's ``S = Q K^T`` retired: hands its K slot back to the producer. Under
    ``O_TMA`` the tile's last block keeps its slot, where the output is staged; the warpgroup then
    only says, on ``o_staged``, that it has read the slot (the other one may still be reading)."""
    keeps_slot = False
    if O_TMA:
        keeps_slot = last
    if keeps_slot:
        mbarrier.arrive(o_staged)
    else:
        mbarrier.arrive(k_empty.index(slot))


@gluon.jit
def _step_scale(tile_scale, p_kscale, p_list, it, count, DENSE: gl.constexpr, QK_8BIT: gl.constexpr):
    """The exponent's factor of entry ``it``'s scores: softmax scale * log2(e), times the tile's
    query-block scale and the key block's scale when Q and K are quantized (entries past
    ``count`` read nothing)."""
    scale = tile_scale
    if QK_8BIT:
        in_list = it < count
        if DENSE:
            block = it
        else:
            block = gl.load(p_list + it, mask=in_list, other=0)
        scale = tile_scale * gl.load(p_kscale + block, mask=in_list, other=1.0)
    return scale


@gluon.jit
def _weights(p_f32, p_layout: gl.constexpr, p_dtype: gl.constexpr, PV_FP8: gl.constexpr):
    """The softmax weights for the next P V, in ``p_layout``: in V's dtype, or for e4m3 values
    (already times 448, `_softmax_step`) in float32, which `_operand` rounds to e4m3 once, just
    before the product.

    e4m3 weights are also reordered within each 16 keys, so that every thread already holds the
    operand's values (no shuffles): the score accumulator gives a thread keys {2t, 2t+1, 2t+8,
    2t+9} of 16, the 8-bit operand wants {4t, ..., 4t+3}. Operand position p = (c0, c3, c1, c2)
    in bits of key c; the quantization pass stores V's keys in that order (`quantize_values_transposed`)."""
    if PV_FP8:
        w = p_f32.reshape([HALF, BLOCK // 16, 2, 2, 2, 2]).permute((0, 1, 3, 4, 2, 5)).reshape([HALF, BLOCK])
        w = gl.convert_layout(w, p_layout)
    else:
        w = gl.convert_layout(p_f32.to(p_dtype), p_layout)
    return w


@gluon.jit
def _operand(p, PV_FP8: gl.constexpr):
    """The weights as P V's left operand: e4m3 from `_weights`' float32 (`to_e4m3x4`); others as
    they are. Converted here, next to the product, rather than carried across the loop as 8-bit
    values (which the compiler re-packs byte by byte)."""
    if PV_FP8:
        p = to_e4m3x4(p)
    return p


@gluon.jit
def _wait_pv(acc, p, PV_FP8: gl.constexpr):
    """Waits for every wgmma in flight; returns P V's accumulator. The wait names the weights as
    a dependency (their registers are read until the product retires). Under e4m3 the product
    reads `_operand`'s 8-bit temporary, not ``p``, and the wait cannot take 8-bit registers:
    ptxas keeps that temporary's registers until the product retires."""
    if PV_FP8:
        acc = warpgroup_mma_wait(0, deps=[acc])
    else:
        acc, p = warpgroup_mma_wait(0, deps=[acc, p])
    return acc


@gluon.jit
def _values(v_smem, slot, HEAD_DIM: gl.constexpr, PV_FP8: gl.constexpr):
    """The ``(BLOCK, HEAD_DIM)`` right operand of P V in ring slot ``slot``: e4m3 values are
    stored transposed (the tensor cores take an 8-bit right operand with its reduction axis, the
    keys, contiguous) and read through a permuted view."""
    if PV_FP8:
        values = v_smem.index(slot).reshape([HEAD_DIM, BLOCK]).permute((1, 0))
    else:
        values = v_smem.index(slot).reshape([BLOCK, HEAD_DIM])
    return values


@gluon.jit
def _mask_scores(s, start_n, q_pos, p_kpos, stride_kpn, seq_len_k, s_cols: gl.constexpr, CAUSAL: gl.constexpr,
                 KEYS_PERMUTED: gl.constexpr):
    """``s`` with pairs whose key is after the query (original positions), or past Nk, at -inf."""
    o_slot = start_n + gl.arange(0, BLOCK, layout=s_cols)
    if CAUSAL:
        if KEYS_PERMUTED:
            k_pos = gl.load(p_kpos + o_slot * stride_kpn, mask=o_slot < seq_len_k, other=_FAR_FUTURE).to(gl.int32)
        else:
            # Slots past Nk have positions past every query, so causality drops them.
            k_pos = o_slot
        keep = gl.expand_dims(k_pos, 0) <= gl.expand_dims(q_pos, 1)
    else:
        keep = gl.expand_dims(o_slot < seq_len_k, 0)
    return gl.where(keep, s, float("-inf"))


@gluon.jit
def _partition(ROLE: gl.constexpr, descs, bufs, bars, ptrs, strides, dims, HEAD_DIM: gl.constexpr,
               STAGES: gl.constexpr, CAUSAL: gl.constexpr,
               PARTIAL_LAST_KEY_BLOCK: gl.constexpr, KEYS_PERMUTED: gl.constexpr,
               QUERIES_PERMUTED: gl.constexpr, DENSE: gl.constexpr, GATED: gl.constexpr,
               WRITE_LSE: gl.constexpr, PAGE_SIZE: gl.constexpr, RAGGED: gl.constexpr, QK_8BIT: gl.constexpr,
               PV_FP8: gl.constexpr, O_TMA: gl.constexpr):
    """Role 0 and 1: the consumer warpgroups (query rows 0-63 and 64-127); role 2: the producer."""
    if ROLE == 2:
        _producer(descs, bufs, bars, ptrs, strides, dims, STAGES, DENSE, GATED, CAUSAL, PAGE_SIZE, RAGGED, PV_FP8)
    else:
        _consumer(ROLE, descs, bufs, bars, ptrs, strides, dims, HEAD_DIM, STAGES, CAUSAL,
                  PARTIAL_LAST_KEY_BLOCK, KEYS_PERMUTED, QUERIES_PERMUTED, DENSE, WRITE_LSE, RAGGED, QK_8BIT, PV_FP8,
                  O_TMA)


@gluon.jit
def _hopper_block_sparse_attn_fwd(
    q_desc, k_desc, v_desc, v_last_desc, o_desc, counts_ptr, full_ptr, indices_ptr, qpos_ptr, kpos_ptr, o_ptr,
    tile_counter_ptr, gate_ptr, lse_ptr, table_ptr, row_starts_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr, shift_ptr,
    stride_cb, stride_ch, stride_ci, stride_fb, stride_fh, stride_fi, stride_ib, stride_ih, stride_ii,
    stride_qpb, stride_qph, stride_qpn, stride_kpb, stride_kph, stride_kpn, stride_ob, stride_oh, stride_on,
    stride_lb, stride_lh, stride_qsb, stride_qsh, stride_ksb, stride_ksh, stride_vsb, stride_vsh,
    heads_k, group, seq_len_q, seq_len_k, tiles_per_head, num_tiles, query_offset, qk_scale, gate_limit, batch,
    HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
    PARTIAL_LAST_KEY_BLOCK: gl.constexpr, KEYS_PERMUTED: gl.constexpr, QUERIES_PERMUTED: gl.constexpr,
    DENSE: gl.constexpr, GATED: gl.constexpr, WRITE_LSE: gl.constexpr, PAGE_SIZE: gl.constexpr,
    RAGGED: gl.constexpr, QK_8BIT: gl.constexpr, PV_FP8: gl.constexpr, O_TMA: gl.constexpr,
):
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    # Whole key blocks, whatever rows one TMA copy moves (a page smaller than a block moves part of one).
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, 1, 1, BLOCK, HEAD_DIM], k_desc.layout)
    if PV_FP8:  # e4m3 values stored transposed: a block's keys are the columns
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, 1, 1, HEAD_DIM, BLOCK], v_desc.layout)
    else:
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, 1, 1, BLOCK, HEAD_DIM], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # "ready": the producer's TMA bytes landed; "empty": both consumer warpgroups are done with it.
    tile_ids = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    tile_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    tile_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    # Both consumer warpgroups have read the tile's last K slot, which then holds the output (O_TMA).
    o_staged = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(o_staged, count=2)
    mbarrier.init(q_ready, count=1)
    mbarrier.init(q_empty, count=2)
    for i in gl.static_range(2):
        mbarrier.init(tile_ready.index(i), count=1)
        mbarrier.init(tile_empty.index(i), count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=2)

    descs = (q_desc, k_desc, v_desc, v_last_desc, o_desc)
    bufs = (q_smem, k_smem, v_smem)
    bars = (q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, tile_ids, tile_ready, tile_empty, o_staged)
    ptrs = (counts_ptr, indices_ptr, qpos_ptr, kpos_ptr, o_ptr, tile_counter_ptr, full_ptr, gate_ptr, lse_ptr,
            table_ptr, row_starts_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr, shift_ptr)
    strides = (stride_cb, stride_ch, stride_ci, stride_ib, stride_ih, stride_ii, stride_qpb, stride_qph, stride_qpn,
               stride_kpb, stride_kph, stride_kpn, stride_ob, stride_oh, stride_on, stride_fb, stride_fh, stride_fi,
               stride_lb, stride_lh, stride_qsb, stride_qsh, stride_ksb, stride_ksh, stride_vsb, stride_vsh)
    dims = (heads_k, group, seq_len_q, seq_len_k, tiles_per_head, num_tiles, query_offset, qk_scale, gate_limit,
            batch)
    gl.warp_specialize(
        [
            (_partition, (0, descs, bufs, bars, ptrs, strides, dims, HEAD_DIM, STAGES, CAUSAL,
                          PARTIAL_LAST_KEY_BLOCK, KEYS_PERMUTED, QUERIES_PERMUTED, DENSE, GATED, WRITE_LSE,
                          PAGE_SIZE, RAGGED, QK_8BIT, PV_FP8, O_TMA)),
            (_partition, (1, descs, bufs, bars, ptrs, strides, dims, HEAD_DIM, STAGES, CAUSAL,
                          PARTIAL_LAST_KEY_BLOCK, KEYS_PERMUTED, QUERIES_PERMUTED, DENSE, GATED, WRITE_LSE,
                          PAGE_SIZE, RAGGED, QK_8BIT, PV_FP8, O_TMA)),
            (_partition, (2, descs, bufs, bars, ptrs, strides, dims, HEAD_DIM, STAGES, CAUSAL,
                          PARTIAL_LAST_KEY_BLOCK, KEYS_PERMUTED, QUERIES_PERMUTED, DENSE, GATED, WRITE_LSE,
                          PAGE_SIZE, RAGGED, QK_8BIT, PV_FP8, O_TMA)),
        ],
        [4, 1],
        [_CONSUMER_REGS, _PRODUCER_REGS],
    )


_GLUON_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float8_e4m3fn: gl.float8e4nv,
                 torch.int8: gl.int8}


def _nvmma_descriptor(x: torch.Tensor, rows: int, cols: int | None = None) -> TensorDescriptor:
    """A TMA descriptor of ``x`` ``(B, H, N, D)`` moving ``[1, 1, rows, cols]`` tiles (``cols``:
    all of ``D``) into the tensor cores' swizzled shared-memory layout."""
    cols = x.shape[-1] if cols is None else cols
    return tma_descriptor(TensorDescriptor, x, rows, cols, layout=_swizzled_layout(rows, cols, x.dtype))


@functools.lru_cache(maxsize=None)
def _swizzled_layout(rows: int, cols: int, dtype: torch.dtype):
    """The shared-memory layout of a ``[1, 1, rows, cols]`` tile: kept once per shape and dtype, as
    Gluon works it out through its constexpr machinery at about 40 us a call (several per launch)."""
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, cols], _GLUON_DTYPES[dtype])


def launch_arguments(call, sm_count: int, stages: int = STAGES, row_starts: torch.Tensor | None = None
                     ) -> tuple[tuple, tuple, dict]:
    """``(grid, args, kwargs)`` of the launch for a prepared call
    (`pbs.kernels.block_sparse_attn._Call`); also used to compile it without a GPU. ``row_starts``:
    a ragged batch read and written packed (`hopper_block_sparse_attention`)."""
    tile_counter = torch.zeros(1, dtype=torch.int32, device=call.out.device)
    return _arguments(
        call.q, call.k, call.v, call.out, call.scale, call.causal, sm_count, stages,
        lists=(call.counts, call.full_counts, call.indices, call.qpos, call.kpos),
        list_strides=(*call.counts.stride(), *call.full_counts.stride(), *call.indices.stride()[:3],
                      *(call.qpos.stride() if call.queries_permuted else (0, 0, 0)),
                      *(call.kpos.stride() if call.keys_permuted else (0, 0, 0))),
        tile_counter=tile_counter, gate=tile_counter, gate_limit=0,
        keys_permuted=call.keys_permuted, queries_permuted=call.queries_permuted, dense=False, gated=False,
        lse=call.lse, block_table=call.block_table, seq_len_k=call.seq_len_k, row_starts=row_starts,
        padded_rows=call.mask.layout.seq_len_q, quantized=call if call.q_scales is not None else None,
    )


def dense_launch_arguments(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, *, scale: float, causal: bool,
    sm_count: int, gate: torch.Tensor | None = None, gate_limit: int = 0, stages: int = STAGES,
) -> tuple[tuple, tuple, dict]:
    """``(grid, args, kwargs)`` of a dense-mode launch (see `launch_hopper_dense`)."""
    expected = (*q.shape[:3], v.shape[-1])
    if tuple(out.shape) != expected or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be a {expected} {q.dtype} tensor on {q.device}, got {tuple(out.shape)} "
                         f"{out.dtype} on {out.device}")
    if gate is not None and (gate.dtype != torch.int32 or gate.dim() != 1 or gate.numel() < 3
                             or gate.device != q.device):
        raise ValueError("gate must be the density probe's int32 buffer (pbs.kernels.density_probe."
                         f"probe_counters_triton: 1-d, at least 3 slots, on {q.device}), got {gate.dtype} "
                         f"{tuple(gate.shape)} on {gate.device}")
    if gate is None:
        tile_counter = torch.zeros(1, dtype=torch.int32, device=out.device)
        gate_slots = tile_counter
    else:
        tile_counter, gate_slots = gate[2:3], gate
    return _arguments(
        q, k, v, out, scale, causal, sm_count, stages,
        lists=(gate_slots,) * 5, list_strides=(0,) * 15,  # no lists are read in dense mode
        tile_counter=tile_counter, gate=gate_slots, gate_limit=gate_limit,
        keys_permuted=False, queries_permuted=False, dense=True, gated=gate is not None,
    )


def gluon_page_size_ok(page_size: int) -> bool:
    """Whether the kernel reads a paged cache of ``page_size`` rows: a multiple of the 128-key
    block (one TMA copy per block), or a power of two from 16 to 64 (one copy per page of the
    block, each into its rows of the block's buffer)."""
    if page_size % BLOCK_SIZE == 0:
        return page_size > 0
    return MIN_PAGE_SIZE <= page_size < BLOCK_SIZE and BLOCK_SIZE % page_size == 0


def _arguments(q, k, v, out, scale, causal, sm_count, stages, *, lists, list_strides, tile_counter, gate, gate_limit,
               keys_permuted, queries_permuted, dense, gated, lse=None, block_table=None,
               seq_len_k=None, row_starts=None, padded_rows=None, quantized=None) -> tuple[tuple, tuple, dict]:
    """The launch's arguments. With ``block_table``, ``k`` and ``v`` are a paged cache viewed as
    ``(num_pages, Hk, page_size, D)`` (`pbs.kernels.block_sparse_attn.prepare_call`) holding
    ``seq_len_k`` keys of one sequence, ``page_size`` a multiple of the block. ``quantized``: the
    prepared call after `pbs.kernels.block_sparse_attn.quantize_call`, whose e4m3 or int8 ``q``, ``k``
    (and with ``pv_fp8`` the transposed ``v``) these are, with its scales."""
    if quantized is not None and (block_table is not None or row_starts is not None or dense):
        raise ValueError("the Gluon kernel computes in 8 bits only on contiguous, unpadded batches (no block_table, "
                         "row_starts or dense mode)")
    b, hq, nq, d = q.shape
    if row_starts is not None:  # q is the packed (1, Hq, Tq, D) view: the tiles are the padded batch's
        b, nq = row_starts.shape[0] - 1, padded_rows
    hk, nk = k.shape[1], k.shape[2]
    page_size = 0
    v_last = None
    copy_rows = BLOCK_SIZE  # rows of K and V one TMA copy moves
    if block_table is not None:
        page_size, nk = k.shape[2], seq_len_k
        if not gluon_page_size_ok(page_size):
            raise ValueError(f"the Gluon kernel reads pages of a multiple of {BLOCK_SIZE} rows or of a power of two "
                             f"from {MIN_PAGE_SIZE} to {BLOCK_SIZE // 2}, got page_size {page_size}")
        copy_rows = min(page_size, BLOCK_SIZE)
        # The rows of the sequence's last page, on every page: its last block reads its values
        # through this, the rest of the page reading as zeros (see _producer).
        v_last = v[:, :, : nk - (nk - 1) // page_size * page_size]
    tiles_per_head = cdiv(nq, BLOCK_SIZE)
    num_tiles = b * hq * tiles_per_head
    counts, full_counts, indices, qpos, kpos = lists
    pv_fp8 = quantized is not None and quantized.pv_fp8
    # The output leaves through a K slot by TMA (see _consumer) where it has K's dtype and width
    # and the descriptor covers exactly the tiles' rows (not the packed rows of a ragged batch).
    o_tma = (quantized is None and row_starts is None and out.shape[-1] == d and out.dtype == k.dtype
             and descriptor_ready(out) is out)
    # e4m3 values are (B, Hk, Dv, N): a block's copy is all Dv rows and BLOCK columns.
    v_desc = _nvmma_descriptor(v, v.shape[2], BLOCK_SIZE) if pv_fp8 else _nvmma_descriptor(v, copy_rows)
    args = (
        _nvmma_descriptor(q, HALF_ROWS),
        _nvmma_descriptor(k, copy_rows),
        v_desc,
        v_desc if v_last is None else _nvmma_descriptor(v_last, copy_rows),  # read only when paged
        _nvmma_descriptor(out, HALF_ROWS) if o_tma else v_desc,  # any descriptor will do when unused
        counts, full_counts, indices, qpos, kpos, out, tile_counter, gate,
        tile_counter if lse is None else lse,  # any pointer will do when unused
        tile_counter if block_table is None else block_table,
        tile_counter if row_starts is None else row_starts,
        *_scale_arguments(quantized, tile_counter),
        *list_strides,
        out.stride(0), out.stride(1), out.stride(2),
        *((0, 0) if lse is None else lse.stride()[:2]),
        *_scale_strides(quantized),
        hk, hq // hk, nq, nk, tiles_per_head, num_tiles, nk - nq,
        scale * LOG2_E, gate_limit, b,
    )
    kwargs = dict(
        HEAD_DIM=d,
        STAGES=stages,
        CAUSAL=causal,
        PARTIAL_LAST_KEY_BLOCK=nk % BLOCK_SIZE != 0,
        KEYS_PERMUTED=keys_permuted,
        QUERIES_PERMUTED=queries_permuted,
        DENSE=dense,
        GATED=gated,
        WRITE_LSE=lse is not None,
        PAGE_SIZE=page_size,
        RAGGED=row_starts is not None,
        QK_8BIT=quantized is not None,
        PV_FP8=pv_fp8,
        O_TMA=o_tma,
        num_warps=4,
        # 12 warps (4 + 4 + the producer's warpgroup) x 32 x 168 fits the 64K registers of an SM;
        # setmaxnreg then moves registers from the producer to the consumers.
        maxnreg=168,
        **COMPILE_OPTIONS,
    )
    return (min(num_tiles, sm_count),), args, kwargs


def _scale_arguments(quantized, unused: torch.Tensor) -> tuple:
    """The pointers to the query-block, key-block and value-channel scales and to the LSE's
    smoothing shift (``unused`` where there are none)."""
    if quantized is None:
        return (unused,) * 4
    return (quantized.q_scales, quantized.k_scales, unused if quantized.v_scales is None else quantized.v_scales,
            unused if quantized.lse_shift is None else quantized.lse_shift)


def _scale_strides(quantized) -> tuple:
    if quantized is None:
        return (0,) * 6
    v_strides = (0, 0) if quantized.v_scales is None else quantized.v_scales.stride()[:2]
    return (*quantized.q_scales.stride()[:2], *quantized.k_scales.stride()[:2], *v_strides)


def launch_hopper(call, sm_count: int, stages: int = STAGES, row_starts: torch.Tensor | None = None) -> None:
    """Run the kernel on a prepared call (`pbs.kernels.block_sparse_attn._Call`)."""
    grid, args, kwargs = launch_arguments(call, sm_count, stages, row_starts)
    _hopper_block_sparse_attn_fwd[grid](*args, **kwargs)


def hopper_block_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, query_positions: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None, scale: float | None = None, causal: bool = True,
    out: torch.Tensor | None = None, lse: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
    row_starts: torch.Tensor | None = None, precision: str = "native",
) -> torch.Tensor:
    """`pbs.kernels.block_sparse_attn.block_sparse_attention` with this kernel: same arguments
    (no tile ``config``; ``lse`` the same optional float32 buffer; ``block_table`` the same paged
    cache, of a ``page_size`` that `gluon_page_size_ok` accepts), same result, on inputs the kernel
    supports (the caller checks).

    ``precision``: ``"native"``, or one of `QUANTIZED_PRECISIONS` (`pbs.PBSConfig.precision`): Q
    and smoothed K (``"fp8_qk"``), and P and V too (``"fp8"``), in e4m3 with the scales of
    `pbs.reference.fp8`, quantized first by `pbs.kernels.fp8_quant` as for the Triton kernel;
    or Q and K in int8 (``"int8_qk"``, ``"int8_qk_fp8_pv"``); contiguous keys and values, no
    ``row_starts``.

    ``row_starts``: ``(B + 1,)`` int32 on ``q``'s device, the cumulative query rows of a ragged
    batch (``cu_seq_q``) whose padded geometry is ``mask.layout``'s (``B`` entries of ``Nq`` rows):
    entry ``b`` holds ``row_starts[b + 1] - row_starts[b]`` real rows. ``q`` is then the packed
    ``(Tq, Hq, D)`` queries, read in place; only the real rows' tiles are drawn (the padding costs
    nothing), and they are written packed: ``out`` is the ``(Tq, Hq, Dv)`` packed output
    (required), row ``r`` of entry ``b`` at ``row_starts[b] + r``, and ``lse`` a contiguous
    ``(Hq, Tq)``. ``query_positions`` stay ``(B, Hq, Nq)``, by padded row.

    Returns:
        ``(B, Hq, Nq, Dv)`` in ``q``'s dtype and permuted query order; with ``row_starts``, ``out``.
    """
    from pbs.kernels.block_sparse_attn import attach_lse, prepare_call

    if precision != "native" and precision not in QUANTIZED_PRECISIONS:
        accepted = ", ".join(map(repr, ("native", *QUANTIZED_PRECISIONS)))
        raise ValueError(f"the Gluon kernel computes in precision {accepted}, got {precision!r}")
    if precision != "native" and (row_starts is not None or block_table is not None):
        raise ValueError(f"precision={precision!r} needs one contiguous, unpadded batch: no row_starts or block_table")

    packed_out = None
    if row_starts is not None:
        hq, dv = q.shape[1], v.shape[-1]
        if q.dim() != 3 or q.shape[1] != mask.layout.heads_q:
            raise ValueError(f"row_starts reads the packed queries: q must be (Tq, {mask.layout.heads_q}, D), got "
                             f"{tuple(q.shape)}")
        if (out is None or out.dim() != 3 or out.shape != (q.shape[0], hq, dv) or out.dtype != q.dtype
                or out.device != q.device or out.stride(-1) != 1):
            raise ValueError(f"row_starts writes the packed output: out must be a ({q.shape[0]}, {hq}, {dv}) "
                             f"{q.dtype} tensor on {q.device} with unit stride along Dv, got "
                             f"{None if out is None else (tuple(out.shape), out.dtype, out.device)}")
        entries = mask.layout.batch + 1
        if row_starts.dtype != torch.int32 or row_starts.shape != (entries,) or row_starts.device != q.device:
            raise ValueError(f"row_starts must be a ({entries},) int32 tensor on {q.device}, got "
                             f"{tuple(row_starts.shape)} {row_starts.dtype} on {row_starts.device}")
        # (1, Hq, Tq, D) views: the kernel's strides, the token's stride between rows.
        q, packed_out, out = q.transpose(0, 1)[None], out, out.transpose(0, 1)[None]
        lse = None if lse is None else lse[None]
    call = prepare_call(q, k, v, mask, query_positions, key_positions, scale, causal, out, block_table,
                        packed_out=packed_out is not None)
    attach_lse(call, lse)
    quantize_for_hopper(call, precision)
    launch_hopper(call, sm_count(q.device), row_starts=row_starts)
    return call.out if packed_out is None else packed_out


def quantize_for_hopper(call, precision: str) -> None:
    """`pbs.kernels.block_sparse_attn.quantize_call` for this kernel: a prepared call's Q, K (and
    V) in ``precision``, V's keys in the order the e4m3 weights reach the tensor cores
    (`_weights`). ``"native"`` leaves the call as it is."""
    from pbs.kernels.block_sparse_attn import quantize_call

    quantize_call(call, precision, wgmma_key_order=True)


def launch_hopper_dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, *, scale: float, causal: bool,
    sm_count: int, gate: torch.Tensor | None = None, gate_limit: int = 0,
) -> None:
    """Dense attention (every visible key, original order) with this kernel, into ``out``.

    Args:
        q: ``(B, Hq, Nq, D)``, k: ``(B, Hk, Nk, D)``, v: ``(B, Hk, Nk, D)``, TMA-ready
            (`pbs.kernels._common.descriptor_ready`), queries the last ``Nq`` positions.
        out: ``(B, Hq, Nq, D)`` in ``q``'s dtype.
        gate: None, or the density probe's int32 buffer
            (`pbs.kernels.density_probe.probe_counters_triton`): slots 0-1 hold its counters
            (kept, visible), slot 2 a zero the kernel uses as its tile counter. The kernel then
            computes only where ``kept * 2**20 > gate_limit * visible`` (`pbs.dense.probe_says_dense`)
            and otherwise exits at once, leaving ``out`` untouched. This lets `pbs.attention` start
            dense attention before the host has read the probe, so the GPU never waits for the read.
    """
    grid, args, kwargs = dense_launch_arguments(q, k, v, out, scale=scale, causal=causal, sm_count=sm_count,
                                                gate=gate, gate_limit=gate_limit)
    _hopper_block_sparse_attn_fwd[grid](*args, **kwargs)
