"""Block-sparse flash-attention forward in Triton: the fast twin of
`pbs.reference.block_sparse_attention_reference`.

One program computes one tile of ``BLOCK_M`` query slots of one (batch, query head) and walks only
the key blocks its query block selected (``mask.indices[b, h, i, :mask.counts[b, h, i]]``). The
list is ascending and the per-token causal check is only needed for key blocks whose effective
position range reaches the query block's (the on-diagonal segment, and a partial last key block),
so those come last. The mask stores where they start (``mask.full_counts``, one rule for every
backend: `pbs.layout.Layout.first_masked_blocks`); the program reads it next to the count and
runs an unmasked loop over the list's head and a masked loop over its short tail. Causality is checked on *original* positions (permuted slots carry their positions),
so permuted keys and queries stay exact.

GQA is native: query head ``h`` reads key/value head ``h // (Hq // Hk)`` of ``k``/``v``
``(B, Hk, Nk, D)``, with ``Hk`` either ``Hq`` (per-head permutations, K/V already replicated by
the gather) or ``Hkv`` (shared permutations, no copy). Programs are ordered so that the query heads
of one KV head and neighbouring query tiles run together: they read the same K/V, which then stays
in L2.

Tiles are moved with tensor descriptors (TMA on Hopper); out-of-range rows and padded head-dim
columns read as zero and are never stored, so any ``N`` and head dims such as 96 need no copies.

Keys and values can also be read in place from a paged cache ``(num_pages, page_size, Hk, D)``
through one sequence's block table (``block_table=``; batch 1). The cache is viewed as
``(num_pages, Hk, page_size, D)``, so a tile inside one page is the same TMA load with the page
where the batch was (pages of a multiple of ``BLOCK_N`` rows). Smaller pages would cut the tiles
down to a page, short for the tensor cores, so a tile spans pages instead and its rows are loaded
through pointers, each from its page. Rows of the last page past the sequence's end hold whatever
the cache holds there: their scores are masked like those of any slot past ``Nk`` and their values
zeroed, so that stale NaNs cannot reach the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from pbs.kernels._common import (
    COMPILE_OPTIONS, FAR_FUTURE, LOG2_E, SCORE_OFFSET, SCORE_OFFSET_BITS, descriptor_ready, interpreting, pow2_at_least,
    tma_descriptor,
)
from pbs.kernels.fp8_quant import E4M3_MAX, channel_balance, quantize_blocks, quantize_values_transposed, round_to_e4m3
from pbs.layout import cdiv
from pbs.reference.fp8 import BALANCED_FORMATS
from pbs.types import PRECISION_FORMATS, BlockMask

_FAR_FUTURE = tl.constexpr(FAR_FUTURE)  # the position of padded key slots (see pbs.kernels._common)
_SCORE_OFFSET = tl.constexpr(SCORE_OFFSET)  # int8 scores' float32 offset (see pbs.kernels._common)
_SCORE_OFFSET_BITS = tl.constexpr(SCORE_OFFSET_BITS)


@triton.jit
def _online_softmax_step(b_s, qk_scale, m_i, l_i, acc, b_v, DOT_PRECISION: tl.constexpr, PV_FP8: tl.constexpr,
                         INTERPRET: tl.constexpr):
    """One flash-attention update from raw scores ``b_s``; ``qk_scale`` = softmax scale * log2(e)
    (times the Q and K block scales under FP8).

    The row max is taken before scaling and the scaling is folded into the exponent's FMA, which
    saves a multiply per score. With ``PV_FP8`` the weights (in [0, 1]) go to the tensor cores as
    e4m3 times 448 and ``b_v`` is e4m3 (the caller divides the 448 and V's scales out at the end);
    the row sums stay fp32.
    """
    m_new = tl.maximum(m_i, tl.max(b_s, 1) * qk_scale)
    b_p = tl.math.exp2(b_s * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(b_p, 1)
    acc = acc * alpha[:, None]
    if PV_FP8:
        b_w = b_p * E4M3_MAX
        if INTERPRET:
            b_w = round_to_e4m3(b_w)  # the interpreter's own cast mis-rounds (pbs.kernels.fp8_quant)
        acc = tl.dot(b_w.to(tl.float8e4nv), b_v, acc)
    else:
        acc = tl.dot(b_p.to(b_v.dtype), b_v, acc, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _load_block_index(p_entry, PLAIN_LOAD: tl.constexpr):
    """One entry (or a block of entries) of a selected-block list or a block table (int32).

    On the GPU it is read with inline PTX (``ld.global.nc``: the lists are read-only here) because
    the software pipeliner turns a plain ``tl.load`` in the loop into an async copy through shared
    memory, which adds a CTA barrier per step and takes the shared memory of a third K/V stage.
    The interpreter has no inline PTX, so it gets the plain load.

    The PTX load has no mask, and the pipeliner does not predicate it either (it is pure): a
    pipelined loop runs it for ``num_stages - 1`` steps past its last one (and from its first step
    when it has none), at the address those steps make. Every caller therefore passes an address
    that is in bounds for *any* loop counter (`_list_entry`, and the clamped slots of
    `_load_kv_tile`), not only for the steps the loop really runs.
    """
    if PLAIN_LOAD:
        return tl.load(p_entry)
    return tl.inline_asm_elementwise(
        "ld.global.nc.b32 $0, [$1];", "=r,l", [p_entry], dtype=tl.int32, is_pure=True, pack=1
    )


@triton.jit
def _load_kv_tile(desc, p_cache, table_ptr, i_b, i_hk, start_n, seq_len_k, stride_p, stride_h, stride_n, dim,
                  ROWS: tl.constexpr, COLS: tl.constexpr, PAGE_SIZE: tl.constexpr, INTERPRET: tl.constexpr):
    """The ``(ROWS, COLS)`` tile of keys or values at slots ``start_n ...`` of head ``i_hk``.

    ``PAGE_SIZE`` 0: contiguous ``(B, Hk, N, D)``, one TMA load. Otherwise ``desc`` and ``p_cache``
    view the cache as ``(num_pages, Hk, page_size, D)`` and ``table_ptr`` is the sequence's block
    table: pages of a multiple of ``ROWS`` rows hold whole tiles (one TMA load, the page in place
    of the batch); smaller ones are read row by row through pointers (rows past ``seq_len_k`` read
    0). Table entries are read like the block lists (`_load_block_index`: no async copy in the
    pipelined loop), at slots clamped to the last key: a tile that starts past the end (a mask
    block's second sub-tile) reads the last page again, and the caller masks its rows.

    The slots are clamped to ``[0, seq_len_k - 1]`` before they index the table (and, for small
    pages, before they pick the row), so that every lane's address lies in one of the sequence's
    own pages whatever ``start_n`` is: the table read is unmasked inline PTX that a pipelined loop
    also runs ahead of its real steps (`_load_block_index`), where ``start_n`` comes from a list
    entry past the list (a ``-1`` pad) or from whatever followed the list in memory.
    """
    if PAGE_SIZE == 0:
        b_x = desc.load([i_b, i_hk, start_n, 0]).reshape(ROWS, COLS)
    elif PAGE_SIZE % ROWS == 0:
        slot = tl.maximum(tl.minimum(start_n, seq_len_k - 1), 0)
        page = _load_block_index(table_ptr + slot // PAGE_SIZE, INTERPRET)
        b_x = desc.load([page, i_hk, start_n % PAGE_SIZE, 0]).reshape(ROWS, COLS)
    else:
        o_r = start_n + tl.arange(0, ROWS)
        o_d = tl.arange(0, COLS)
        m_r = o_r < seq_len_k
        slot = tl.maximum(tl.minimum(o_r, seq_len_k - 1), 0)  # == o_r on every row that is loaded
        page = _load_block_index(table_ptr + slot // PAGE_SIZE, INTERPRET)
        p_rows = p_cache + page.to(tl.int64) * stride_p + i_hk.to(tl.int64) * stride_h + (slot % PAGE_SIZE) * stride_n
        b_x = tl.load(p_rows[:, None] + o_d[None, :], mask=m_r[:, None] & (o_d < dim)[None, :], other=0.0)
    return b_x


@triton.jit
def _list_entry(p_list, it, count, SUB_N: tl.constexpr, INTERPRET: tl.constexpr):
    """The key block of step ``it`` of a tile's walk over its ``count`` listed blocks (``SUB_N``
    steps per block).

    The entry index is clamped to ``[0, count - 1]`` (entry 0 for an empty list; every row has
    ``Tk >= 1`` entries): a no-op on the loop's own steps, but the read is unmasked inline PTX that a
    pipelined loop also runs for the steps after its last (`_load_block_index`), which would read
    the row's ``-1`` pads or, after the tensor's last row, past its end. Clamped, they read a
    listed block again, whose loads the pipeliner predicates off.
    """
    entry = tl.maximum(tl.minimum(it // SUB_N, count - 1), 0)
    return _load_block_index(p_list + entry, INTERPRET)


@triton.jit
def _scores(b_q, b_k, DOT_PRECISION: tl.constexpr, QK_INT8: tl.constexpr):
    """``q . k^T`` of a tile in fp32: int8 operands accumulate exactly in int32 first, and come
    out as float32 by an integer add and a float subtract of `_SCORE_OFFSET` (exact while |s| <
    2^22, and |s| <= D * 127^2 < 2^22 for D <= 256), on full-rate pipes where a conversion (I2F)
    takes a quarter-rate one, as the exponentials do."""
    # One return: the compiler types every return statement, pruned branch or not.
    if QK_INT8:
        b_s = tl.dot(b_q, b_k.T, out_dtype=tl.int32)
        b_s = (b_s + _SCORE_OFFSET_BITS).to(tl.float32, bitcast=True) - _SCORE_OFFSET
    else:
        b_s = tl.dot(b_q, b_k.T, input_precision=DOT_PRECISION)
    return b_s


@triton.jit
def _load_values(desc, p_cache, table_ptr, i_b, i_hk, start_n, seq_len_k, stride_p, stride_h, stride_n, dim,
                 ROWS: tl.constexpr, COLS: tl.constexpr, PAGE_SIZE: tl.constexpr, INTERPRET: tl.constexpr,
                 PV_FP8: tl.constexpr):
    """The ``(ROWS, COLS)`` value tile at slots ``start_n ...`` (`_load_kv_tile`); under ``PV_FP8``
    from the e4m3 values stored transposed, ``(B, Hk, Dv, N)``, which the tensor cores need."""
    if PV_FP8:
        return desc.load([i_b, i_hk, 0, start_n]).reshape(COLS, ROWS).T
    return _load_kv_tile(desc, p_cache, table_ptr, i_b, i_hk, start_n, seq_len_k, stride_p, stride_h, stride_n, dim,
                         ROWS, COLS, PAGE_SIZE, INTERPRET)


@triton.jit
def _block_sparse_attn_fwd(
    q_desc,
    k_desc,
    v_desc,
    o_desc,
    counts_ptr,
    full_ptr,
    indices_ptr,
    qpos_ptr,
    kpos_ptr,
    lse_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    q_scale_ptr,
    k_scale_ptr,
    v_scale_ptr,
    lse_shift_ptr,
    stride_qsb,
    stride_qsh,
    stride_ksb,
    stride_ksh,
    stride_vsb,
    stride_vsh,
    stride_kp,
    stride_kh,
    stride_kn,
    stride_vp,
    stride_vh,
    stride_vn,
    dim_k,
    dim_v,
    stride_cb,
    stride_ch,
    stride_ci,
    stride_fb,
    stride_fh,
    stride_fi,
    stride_ib,
    stride_ih,
    stride_ii,
    stride_qpb,
    stride_qph,
    stride_qpn,
    stride_kpb,
    stride_kph,
    stride_kpn,
    stride_lb,
    stride_lh,
    heads_k,
    group,
    seq_len_q,
    seq_len_k,
    tiles_per_head,
    query_offset,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    MASK_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    PARTIAL_LAST_KEY_BLOCK: tl.constexpr,
    KEYS_PERMUTED: tl.constexpr,
    QUERIES_PERMUTED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    QK_QUANTIZED: tl.constexpr,
    PV_FP8: tl.constexpr,
    QK_INT8: tl.constexpr,
):
    SPLIT_M: tl.constexpr = MASK_BLOCK // BLOCK_M
    SUB_N: tl.constexpr = MASK_BLOCK // BLOCK_N
    NEEDS_SPLIT: tl.constexpr = CAUSAL or PARTIAL_LAST_KEY_BLOCK

    # Program order (fastest first): query head within its GQA group, query tile (heaviest, i.e.
    # last, first), KV head, batch. Concurrent programs then share one KV head's K/V in L2, and
    # the short tiles fill the tail of the launch.
    i_pid = tl.program_id(0)
    i_g = i_pid % group
    i_rest = i_pid // group
    i_t = tiles_per_head - 1 - i_rest % tiles_per_head
    i_rest = i_rest // tiles_per_head
    i_hk = i_rest % heads_k
    i_b = i_rest // heads_k
    i_hq = i_hk * group + i_g
    i_qb = i_t // SPLIT_M
    row0 = i_t * BLOCK_M

    o_m = row0 + tl.arange(0, BLOCK_M)
    o_n = tl.arange(0, BLOCK_N)

    count = tl.load(counts_ptr + i_b.to(tl.int64) * stride_cb + i_hq * stride_ch + i_qb * stride_ci)
    p_list = indices_ptr + i_b.to(tl.int64) * stride_ib + i_hq.to(tl.int64) * stride_ih + i_qb.to(tl.int64) * stride_ii

    # The list is ascending and its first `n_unmasked` entries are wholly in the past of every
    # query of the query block (BlockMask.full_counts, worked out once where the mask was built);
    # the rest (the on-diagonal segment, a partial last key block) get the per-token check. The
    # split belongs to the query block, so the SPLIT_M tiles of one block share it; a later tile's
    # own split could start a block later (when Nk - Nq is not a multiple of the block), but the
    # check on a block wholly in the past keeps every score, so the result is the same.
    n_unmasked = count
    if NEEDS_SPLIT:
        n_unmasked = tl.load(full_ptr + i_b.to(tl.int64) * stride_fb + i_hq * stride_fh + i_qb * stride_fi)

    b_q = q_desc.load([i_b, i_hq, row0, 0]).reshape(BLOCK_M, HEAD_DIM)
    # Quantized, every score of a step is scaled by its query block's and key block's scales: the
    # key block's is read per step, next to its list entry (int32 bits: the same no-async load).
    qk_scale_q = qk_scale
    if QK_QUANTIZED:
        q_scale = tl.load(q_scale_ptr + i_b.to(tl.int64) * stride_qsb + i_hq.to(tl.int64) * stride_qsh + i_qb)
        qk_scale_q = qk_scale * q_scale
        p_kscale = k_scale_ptr + i_b.to(tl.int64) * stride_ksb + i_hk.to(tl.int64) * stride_ksh
    if CAUSAL:
        if QUERIES_PERMUTED:
            p_qpos = qpos_ptr + i_b.to(tl.int64) * stride_qpb + i_hq.to(tl.int64) * stride_qph + o_m * stride_qpn
            b_qpos = tl.load(p_qpos, mask=o_m < seq_len_q, other=0).to(tl.int32)
        else:
            b_qpos = o_m + query_offset

    # A finite start for the running max keeps rows that see no key at all free of inf - inf.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V], dtype=tl.float32)

    # Off-diagonal blocks: no mask at all.
    for it in range(0, n_unmasked * SUB_N):
        j = _list_entry(p_list, it, count, SUB_N, INTERPRET)
        start_n = j * MASK_BLOCK + (it % SUB_N) * BLOCK_N
        b_k = _load_kv_tile(k_desc, k_ptr, table_ptr, i_b, i_hk, start_n, seq_len_k, stride_kp, stride_kh,
                            stride_kn, dim_k, BLOCK_N, HEAD_DIM, PAGE_SIZE, INTERPRET)
        b_s = _scores(b_q, b_k, DOT_PRECISION, QK_INT8)
        step_scale = qk_scale_q
        if QK_QUANTIZED:
            step_scale = qk_scale_q * _load_block_index(p_kscale + j, INTERPRET).to(tl.float32, bitcast=True)
        b_v = _load_values(v_desc, v_ptr, table_ptr, i_b, i_hk, start_n, seq_len_k, stride_vp, stride_vh,
                           stride_vn, dim_v, BLOCK_N, HEAD_DIM_V, PAGE_SIZE, INTERPRET, PV_FP8)
        m_i, l_i, acc = _online_softmax_step(b_s, step_scale, m_i, l_i, acc, b_v, DOT_PRECISION, PV_FP8, INTERPRET)

    # On-diagonal blocks (and a partial last key block): per-token check on original positions.
    if NEEDS_SPLIT:
        if KEYS_PERMUTED:
            p_kpos_head = kpos_ptr + i_b.to(tl.int64) * stride_kpb + i_hk.to(tl.int64) * stride_kph
        for it in range(n_unmasked * SUB_N, count * SUB_N):
            j = _list_entry(p_list, it, count, SUB_N, INTERPRET)
            start_n = j * MASK_BLOCK + (it % SUB_N) * BLOCK_N
            b_k = _load_kv_tile(k_desc, k_ptr, table_ptr, i_b, i_hk, start_n, seq_len_k, stride_kp, stride_kh,
                                stride_kn, dim_k, BLOCK_N, HEAD_DIM, PAGE_SIZE, INTERPRET)
            b_s = _scores(b_q, b_k, DOT_PRECISION, QK_INT8)
            o_slot = start_n + o_n
            if CAUSAL:
                if KEYS_PERMUTED:
                    b_kpos = tl.load(
                        p_kpos_head + o_slot * stride_kpn, mask=o_slot < seq_len_k, other=_FAR_FUTURE
                    ).to(tl.int32)
                else:
                    # Slots past Nk have positions past every query, so causality drops them.
                    b_kpos = o_slot
                m_keep = b_kpos[None, :] <= b_qpos[:, None]
            else:
                m_keep = (o_slot < seq_len_k)[None, :]
            b_s = tl.where(m_keep, b_s, float("-inf"))
            step_scale = qk_scale_q
            if QK_QUANTIZED:
                step_scale = qk_scale_q * _load_block_index(p_kscale + j, INTERPRET).to(tl.float32, bitcast=True)
            b_v = _load_values(v_desc, v_ptr, table_ptr, i_b, i_hk, start_n, seq_len_k, stride_vp, stride_vh,
                               stride_vn, dim_v, BLOCK_N, HEAD_DIM_V, PAGE_SIZE, INTERPRET, PV_FP8)
            if PAGE_SIZE != 0:
                # A page's rows past the sequence's end are another sequence's or stale: their
                # weight is 0, but 0 * NaN is not.
                b_v = tl.where((o_slot < seq_len_k)[:, None], b_v, tl.zeros_like(b_v))
            m_i, l_i, acc = _online_softmax_step(b_s, step_scale, m_i, l_i, acc, b_v, DOT_PRECISION, PV_FP8,
                                                 INTERPRET)

    # Queries with no visible key keep l == 0 and acc == 0: their output is 0 and their LSE -inf.
    # A NaN score leaves l NaN for good (NaN * alpha is NaN). l == 0 is false for NaN, so such a
    # row keeps its NaN in the output and the LSE; l > 0, false for NaN too, took it for "no key".
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    b_o = acc / l_safe[:, None]
    if PV_FP8:
        o_dv = tl.arange(0, HEAD_DIM_V)
        b_vscale = tl.load(v_scale_ptr + i_b.to(tl.int64) * stride_vsb + i_hk.to(tl.int64) * stride_vsh + o_dv,
                           mask=o_dv < dim_v, other=1.0)
        b_o = b_o * (b_vscale / E4M3_MAX)[None, :]
    o_desc.store([i_b, i_hq, row0, 0], b_o.to(o_desc.dtype).reshape(1, 1, BLOCK_M, HEAD_DIM_V))
    if WRITE_LSE:
        # m_i and l_i are in the log2 domain of the scaled scores: lse = (m + log2 l) * ln 2.
        b_lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
        if QK_QUANTIZED:
            # K was smoothed: every score of a row is short by scale * q . mean(K), which the
            # quantization pass wrote from the unquantized q (lse_shift_ptr: that (B, Hq, Nq) shift).
            b_shift = tl.load(lse_shift_ptr + (i_b * (heads_k * group) + i_hq).to(tl.int64) * seq_len_q + o_m,
                              mask=o_m < seq_len_q, other=0.0)
            b_lse = b_lse + b_shift * (qk_scale * 0.6931471805599453)
        p_lse = lse_ptr + i_b.to(tl.int64) * stride_lb + i_hq.to(tl.int64) * stride_lh + o_m
        tl.store(p_lse, b_lse, mask=o_m < seq_len_q)


@dataclass(frozen=True)
class KernelConfig:
    """Tile shape and schedule of one launch.

    ``block_m`` / ``block_n`` are capped at the mask's block size; a mask block larger than a tile
    is covered by several query tiles (programs) or key sub-tiles (loop steps).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def fitted(self, mask_block: int) -> "KernelConfig":
        return KernelConfig(min(self.block_m, mask_block), min(self.block_n, mask_block), self.num_warps, self.num_stages)

    def __str__(self) -> str:
        return f"m{self.block_m}n{self.block_n}w{self.num_warps}s{self.num_stages}"

    @classmethod
    def parse(cls, text: str) -> "KernelConfig":
        """From ``"128,128,8,2"`` (block_m, block_n, num_warps, num_stages)."""
        bm, bn, w, s = (int(x) for x in text.split(","))
        return cls(bm, bn, w, s)


def candidate_configs(dtype: torch.dtype, head_dim: int, interpret: bool) -> list[KernelConfig]:
    """The small set the tuner times (the first one is the default; the interpreter gets only it).

    ``head_dim`` is the padded (power of two) head dim. Every entry compiles for sm_90 without
    register spills (checked from ptxas' report), except fp32, which is a correctness mode.
    """
    if interpret:
        return [KernelConfig(64, 64, 4, 1)]
    if dtype in (torch.float8_e4m3fn, torch.int8) and head_dim <= 128:
        # Quantized Q and K (precision fp8_qk / fp8): 64-row query tiles of 4 warps beat 128x128 by
        # 1.1x (fp8) on an H100 (docs/fp8.md); the tuner also times the bf16 default.
        return [KernelConfig(64, 128, 4, 3), KernelConfig(128, 128, 8, 3), KernelConfig(128, 64, 4, 3)]
    if dtype == torch.float32:
        return [KernelConfig(64, 32, 4, 2)]
    if head_dim <= 64:
        return [KernelConfig(128, 128, 8, 3), KernelConfig(128, 64, 4, 3), KernelConfig(128, 128, 8, 2)]
    if head_dim <= 128:
        # 128x128 tiles with three K/V stages won every timing on an H200 (docs/notes.md, v1 to
        # v3); 128x64, 64-row tiles and two stages lost, and a short tuning run picked two stages
        # by noise, so the tuner is not asked.
        return [KernelConfig(128, 128, 8, 3)]
    return [KernelConfig(128, 64, 8, 2), KernelConfig(64, 64, 4, 2), KernelConfig(128, 32, 8, 2)]


# The fastest config per shape class, found by `select_config` (benchmarks clear it to tune again).
TUNED_CONFIGS: dict[tuple, KernelConfig] = {}


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: BlockMask,
    query_positions: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
    scale: float | None = None,
    causal: bool = True,
    config: KernelConfig | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    precision: str = "native",
) -> torch.Tensor:
    """Attention of every query over the key blocks its query block selected (Triton).

    Args:
        q: ``(B, Hq, Nq, D)`` queries in permuted order (fp16, bf16 or fp32).
        k: ``(B, Hk, Nk, D)`` keys in permuted order, ``Hq % Hk == 0``.
        v: ``(B, Hk, Nk, Dv)`` values in the keys' order.
        mask: selected key blocks: ``counts (B, Hq, Tq)``, ``indices (B, Hq, Tq, Tk)`` int32.
        query_positions: ``(B, Hq, Nq)`` original position of each query slot, or None when the
            queries are not permuted (slot ``t`` is position ``Nk - Nq + t``).
        key_positions: ``(B, Hk, Nk)`` original position of each key slot, or None when the keys
            are not permuted.
        scale: softmax scale, default ``D ** -0.5``.
        causal: mask pairs with ``key_position > query_position``.
        config: tile shape and schedule; default `select_config`.
        out: optional ``(B, Hq, Nq, Dv)`` output buffer in ``q``'s dtype (16-byte aligned rows).
        lse: optional contiguous ``(B, Hq, Nq)`` float32 buffer that receives each query's
            log-sum-exp (natural log) of its scaled scores over the keys it attends to, ``-inf``
            where it sees none.
        block_table: ``(max_pages,)`` int32: ``k`` and ``v`` are then paged caches
            ``(num_pages, page_size, Hk, D)`` and ``(num_pages, page_size, Hk, Dv)`` (a power-of-two
            ``page_size``), read in place; key slot ``t`` is row ``t % page_size`` of page
            ``block_table[t // page_size]``, ``Nk`` is ``mask.layout.seq_len_k``, ``B`` is 1, and
            the keys must be in their original order (``key_positions`` None).
        precision: ``"native"``, ``"fp8_qk"`` or ``"fp8"`` (`pbs.PBSConfig.precision`): Q and
            smoothed K, and with ``"fp8"`` P and V, are quantized to e4m3 first
            (`pbs.kernels.fp8_quant`, with the scales of its twin `pbs.reference.fp8`); contiguous
            keys and values only.

    Returns:
        ``(B, Hq, Nq, Dv)`` in ``q``'s dtype and permuted query order. A query with no selected
        key gets 0.
    """
    call = prepare_call(q, k, v, mask, query_positions, key_positions, scale, causal, out, block_table)
    attach_lse(call, lse)
    quantize_call(call, precision)
    if config is None:
        config = _select(call)
    _launch(call, config.fitted(mask.layout.block_size))
    return call.out


def select_config(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: BlockMask,
    query_positions: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
    scale: float | None = None,
    causal: bool = True,
) -> KernelConfig:
    """The config `block_sparse_attention` uses for these arguments.

    The interpreter and single-candidate cases take the first candidate (pass ``config=`` to
    `block_sparse_attention` to run another); otherwise the candidates are timed once per shape class
    (device, dtype, head dims, mask block, causality, GQA group, ``Nk`` rounded to a power of two)
    and the fastest is remembered.
    """
    return _select(prepare_call(q, k, v, mask, query_positions, key_positions, scale, causal, None))


@dataclass
class _Call:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    mask: BlockMask
    counts: torch.Tensor
    full_counts: torch.Tensor
    indices: torch.Tensor
    qpos: torch.Tensor
    kpos: torch.Tensor
    queries_permuted: bool
    keys_permuted: bool
    scale: float
    causal: bool
    head_dim: int
    head_dim_v: int
    seq_len_k: int
    block_table: torch.Tensor | None = None  # k and v are (num_pages, Hk, page_size, D) views of a paged cache
    lse: torch.Tensor | None = None
    # Under FP8 (quantize_call): q and k hold e4m3 values, and with pv_fp8 v holds them (B, Hk, Dv, Nk).
    q_scales: torch.Tensor | None = None  # (B, Hq, Tq) float32
    k_scales: torch.Tensor | None = None  # (B, Hk, Tk) float32
    k_mean: torch.Tensor | None = None  # (B, Hk, 1, D) float32
    lse_shift: torch.Tensor | None = None  # (B, Hq, Nq) float32: q . k_mean per query, when the LSE is written
    v_scales: torch.Tensor | None = None  # (B, Hk, Dv) float32
    pv_fp8: bool = False

    @property
    def page_size(self) -> int:
        """Rows per page, 0 for contiguous keys and values."""
        return 0 if self.block_table is None else self.k.shape[2]


def attach_lse(call: _Call, lse: torch.Tensor | None) -> None:
    """Checks an LSE buffer (contiguous float32 on ``q``'s device, shaped as the output's rows: ``(B,
    Hq, Nq)``, or ``(1, Hq, Tq)`` for a packed output) and gives it to the prepared call; None leaves
    the call without one."""
    if lse is None:
        return
    expected = tuple(call.out.shape[:3])
    if tuple(lse.shape) != expected or lse.dtype != torch.float32 or lse.device != call.q.device or not lse.is_contiguous():
        raise ValueError(f"lse must be a contiguous {expected} float32 tensor on {call.q.device}, got "
                         f"{tuple(lse.shape)} {lse.dtype} on {lse.device}")
    call.lse = lse


PRECISIONS = tuple(PRECISION_FORMATS)
"""The `pbs.PBSConfig.precision` values this kernel runs."""


def quantize_call(call: _Call, precision: str, wgmma_key_order: bool = False) -> None:
    """Replaces the prepared call's Q and K (and where P.V runs in e4m3, V) with their quantized
    values and scales (`pbs.reference.fp8` defines them); ``"native"`` leaves it as it is.
    ``wgmma_key_order``: V's keys in the Gluon kernel's order (`quantize_values_transposed`)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    qk_format, pv_fp8 = PRECISION_FORMATS[precision]
    if qk_format is None:
        return
    if call.q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"precision={precision!r} takes float16 or bfloat16 inputs, got {call.q.dtype}")
    if call.block_table is not None:
        raise ValueError(f"precision={precision!r} needs contiguous keys and values (K's mean over the tokens, "
                         "V's per-channel scales), not a paged cache (block_table)")
    block_size = call.mask.layout.block_size
    call.k_mean = call.k.mean(dim=2, keepdim=True, dtype=torch.float32)
    q_factor = k_factor = None
    if qk_format in BALANCED_FORMATS:
        q_factor, k_factor = channel_balance(call.q, call.k, call.k_mean)
    if call.lse is not None:
        call.lse_shift = torch.empty(call.q.shape[:3], dtype=torch.float32, device=call.q.device)
    call.q, call.q_scales = quantize_blocks(call.q, block_size, shift_mean=call.k_mean if call.lse is not None else None,
                                            shift=call.lse_shift, fmt=qk_format, factor=q_factor)
    call.k, call.k_scales = quantize_blocks(call.k, block_size, call.k_mean, fmt=qk_format, factor=k_factor)
    if pv_fp8:
        call.v_scales = _channel_scales(call.v)
        call.v = quantize_values_transposed(call.v, call.v_scales, wgmma_key_order)
        call.pv_fp8 = True


def _channel_scales(v: torch.Tensor) -> torch.Tensor:
    """V's per-channel scales over the tokens (`pbs.reference.fp8.channel_scales`)."""
    if v.shape[2] == 0:
        return torch.ones(v.shape[0], v.shape[1], v.shape[3], dtype=torch.float32, device=v.device)
    amax = torch.linalg.vector_norm(v, ord=float("inf"), dim=2, dtype=torch.float32)
    quotient = amax / torch.full_like(amax, 448.0)  # IEEE (a scalar divisor is a reciprocal's product on CUDA)
    return torch.where((amax > 0) | amax.isnan(), quotient, torch.ones_like(amax))


def prepare_call(q, k, v, mask, query_positions, key_positions, scale, causal, out, block_table=None,
                 packed_out: bool = False) -> _Call:
    """The checked, TMA-ready arguments of one `block_sparse_attention` call, which both kernels
    launch on (a ``block_table`` only the Triton one). ``packed_out``: ``out`` is a ragged batch's
    packed output viewed as ``(1, Hq, Tq, Dv)`` (the Gluon kernel's ``row_starts``)."""
    b, hq, nq, d = q.shape
    dv = v.shape[-1]
    if block_table is not None:
        if b != 1 or key_positions is not None:
            raise ValueError("a paged cache holds one sequence's keys in their original order: batch 1, "
                             "key_positions None")
        page_size = k.shape[1]
        if page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {page_size}")
        # (num_pages, page_size, Hk, D) -> (num_pages, Hk, page_size, D): the (B, H, N, D) order the
        # descriptors and the kernel index, with the page where the batch was. A view, no copy.
        k, v = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
        block_table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    q, k, v = (descriptor_ready(x) for x in (q, k, v))
    if packed_out:
        assert out is not None and out.shape[:2] == (1, hq) and out.shape[3] == dv and out.stride(-1) == 1
    elif out is None:
        out = torch.empty(b, hq, nq, dv, dtype=q.dtype, device=q.device)
    elif descriptor_ready(out) is not out or out.shape != (b, hq, nq, dv) or out.dtype != q.dtype:
        raise ValueError(f"out must be a ({b}, {hq}, {nq}, {dv}) {q.dtype} tensor with 16-byte aligned rows")
    if causal and not mask.layout.causal:
        # The mask's split (full_counts) was made without causality: its on-diagonal blocks are
        # counted as full, and a causal run would skip their per-token check.
        raise ValueError("causal=True needs a mask built for causal attention (mask.layout.causal is False)")
    counts = mask.counts.to(torch.int32)
    full_counts = mask.full_counts.to(torch.int32)
    indices = mask.indices if mask.indices.stride(-1) == 1 else mask.indices.contiguous()
    queries_permuted = causal and query_positions is not None
    keys_permuted = causal and key_positions is not None
    return _Call(
        q, k, v, out, mask, counts, full_counts, indices,
        qpos=query_positions if queries_permuted else counts,  # any pointer will do when unused
        kpos=key_positions if keys_permuted else counts,
        queries_permuted=queries_permuted,
        keys_permuted=keys_permuted,
        scale=d**-0.5 if scale is None else float(scale),
        causal=causal,
        head_dim=pow2_at_least(d),
        head_dim_v=pow2_at_least(dv),
        seq_len_k=mask.layout.seq_len_k if block_table is not None else k.shape[2],
        block_table=block_table,
    )


def _launch(call: _Call, config: KernelConfig) -> None:
    layout = call.mask.layout
    b, hq, nq, _ = call.q.shape
    hk, nk = call.k.shape[1], call.seq_len_k
    mask_block = layout.block_size
    tiles_per_head = cdiv(nq, config.block_m)
    # This kernel reads int32 lists: an int16 read (ld.global.nc.b16) passed the differential tests
    # but hit an illegal address in the H200 dense-mode benchmark (docs/notes.md), so
    # int16 masks are widened here, which costs Hq * Tq * Tk * 4 bytes for the call.
    indices = call.indices.to(torch.int32)
    # Pages smaller than a key tile are read through pointers, never this descriptor: its box is
    # kept within a page all the same (a TMA box should not exceed the tensor).
    kv_rows = min(config.block_n, call.page_size) if call.page_size else config.block_n
    _block_sparse_attn_fwd[(b * hq * tiles_per_head,)](
        tma_descriptor(TensorDescriptor, call.q, config.block_m, call.head_dim),
        tma_descriptor(TensorDescriptor, call.k, kv_rows, call.head_dim),
        (tma_descriptor(TensorDescriptor, call.v, call.head_dim_v, config.block_n) if call.pv_fp8 else
         tma_descriptor(TensorDescriptor, call.v, kv_rows, call.head_dim_v)),
        tma_descriptor(TensorDescriptor, call.out, config.block_m, call.head_dim_v),
        call.counts, call.full_counts, indices, call.qpos, call.kpos,
        call.counts if call.lse is None else call.lse,  # any pointer will do when unused
        call.k, call.v, call.counts if call.block_table is None else call.block_table,
        *_fp8_arguments(call),
        *(call.k.stride()[:3] if call.page_size else (0, 0, 0)),
        *(call.v.stride()[:3] if call.page_size else (0, 0, 0)),
        call.q.shape[-1], call.out.shape[-1],
        *call.counts.stride(), *call.full_counts.stride(), *indices.stride()[:3],
        *(call.qpos.stride() if call.queries_permuted else (0, 0, 0)),
        *(call.kpos.stride() if call.keys_permuted else (0, 0, 0)),
        *((0, 0) if call.lse is None else call.lse.stride()[:2]),
        hk, hq // hk, nq, nk, tiles_per_head,
        nk - nq,
        call.scale * LOG2_E,
        HEAD_DIM=call.head_dim,
        HEAD_DIM_V=call.head_dim_v,
        MASK_BLOCK=mask_block,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        CAUSAL=call.causal,
        PARTIAL_LAST_KEY_BLOCK=nk % mask_block != 0,
        KEYS_PERMUTED=call.keys_permuted,
        QUERIES_PERMUTED=call.queries_permuted,
        # fp32 inputs: three tf32 products per dot, close to fp32 accuracy at tensor-core speed.
        DOT_PRECISION="tf32x3" if call.out.dtype == torch.float32 else None,
        INTERPRET=interpreting(),
        WRITE_LSE=call.lse is not None,
        PAGE_SIZE=call.page_size,
        QK_QUANTIZED=call.q_scales is not None,
        PV_FP8=call.pv_fp8,
        QK_INT8=call.q.dtype == torch.int8,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **COMPILE_OPTIONS,
    )


def run_prepared(call: _Call, config: KernelConfig | None = None) -> torch.Tensor:
    """Launches a call made by `prepare_call` (and `attach_lse` / `quantize_call`), with
    ``config`` or the one `select_config` would pick; returns ``call.out``. Benchmarks time the
    attention apart from the preparation this way."""
    _launch(call, (config or _select(call)).fitted(call.mask.layout.block_size))
    return call.out


def _fp8_arguments(call: _Call) -> tuple:
    """The scale pointers and strides of the FP8 paths (any pointer where unused). The key scales
    go as int32 bits: the kernel reads them with the block lists' no-async load."""
    if call.q_scales is None:
        return (call.counts,) * 4 + (0,) * 6
    v_scales = call.v_scales if call.v_scales is not None else call.q_scales
    shift = call.lse_shift if call.lse_shift is not None else call.q_scales
    return (call.q_scales, call.k_scales.view(torch.int32), v_scales, shift,
            *call.q_scales.stride()[:2], *call.k_scales.stride()[:2], *v_scales.stride()[:2])


def _select(call: _Call) -> KernelConfig:
    candidates = candidate_configs(call.q.dtype, max(call.head_dim, call.head_dim_v), interpreting())
    if len(candidates) == 1 or call.q.device.type != "cuda":
        return candidates[0]
    mask_block = call.mask.layout.block_size
    key = (call.q.device.index, call.q.dtype, call.pv_fp8, call.head_dim, call.head_dim_v, mask_block, call.causal,
           call.q.shape[1] // call.k.shape[1], call.seq_len_k.bit_length(), call.page_size)
    if key not in TUNED_CONFIGS and torch.cuda.is_current_stream_capturing():
        # Timing candidates needs syncs, which a graph capture forbids: the untuned default runs
        # (a warm-up call before capturing tunes it).
        return candidates[0]
    if key not in TUNED_CONFIGS:
        import triton.testing

        timings = {}
        for candidate in candidates:
            try:
                timings[candidate] = triton.testing.do_bench(
                    lambda c=candidate: _launch(call, c.fitted(mask_block)), warmup=10, rep=50, return_mode="median"
                )
            except Exception:  # noqa: BLE001 - a config that does not fit this GPU is just not chosen
                continue
        if not timings:
            raise RuntimeError("no Triton kernel configuration could run this call")
        TUNED_CONFIGS[key] = min(timings, key=timings.get)
    return TUNED_CONFIGS[key]
