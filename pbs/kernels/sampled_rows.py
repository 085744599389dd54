"""GPU ``sampled_rows`` block mass: the fast twin of `pbs.selectors.sampled_rows.sampled_block_mass`.

Two launches per chunk of query heads, one pass over the keys:

1. ``_sampled_lse_kernel``: one program takes ``QB`` query blocks' sampled rows (``QB * R = 128``
   rows, one MMA tile), walks the key blocks they can see once, and writes every row's
   log-sum-exp over every key block (base 2, ``-inf`` where the block holds no visible key). The
   keys are read once per 128 sampled rows, not once per row.
2. ``_combine_kernel``: one program per query block turns its ``R`` rows of block LSEs into each
   row's softmax mass per key block and averages the rows.

The scratch of step 1 is ``(B, hc, Tq * R, Tk)`` fp32, bounded by chunking the heads.

The selector's ``triton`` planner (`pbs.backends.planners`) launches it: tests/test_kernel_gpu_selection.py checks it
against the reference (its GPU tests passed on an H100), and
benchmarks/bench_planning.py times it (docs/benchmarks.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pbs.kernels._common import COMPILE_OPTIONS, LOG2_E
from pbs.layout import Layout

ROWS_PER_TILE = 128
SCRATCH_BYTES = 64 * 1024 * 1024


@triton.jit
def _sampled_lse_kernel(
    q_ptr, k_ptr, kidx_ptr, qpos_ptr, kpos_ptr, lse_ptr,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_ib, stride_ih,
    stride_qpb, stride_qph,
    stride_kpb, stride_kph,
    heads_chunk, head_offset, k_group, pos_group, seq_len_q, seq_len_k, num_query_blocks, num_key_blocks,
    segment_size, permutable_key_len, qk_scale,
    R: tl.constexpr, QB: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    GATHER: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    i_g = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // heads_chunk
    i_hl = i_bh % heads_chunk
    i_h = i_hl + head_offset
    i_hk = i_h // k_group  # head of k
    i_hp = i_h // pos_group  # head of the key positions / indices

    o_m = tl.arange(0, QB * R)
    o_qb = i_g * QB + o_m // R
    o_r = o_m % R
    m_m = o_qb < num_query_blocks
    # Row r of block i: slot i * BLOCK + round(BLOCK / R * (r + 1)) - 1, clamped to the last query.
    o_slot = o_qb * BLOCK + ((BLOCK * (o_r + 1) + R // 2) // R) - 1
    o_slot = tl.minimum(o_slot, seq_len_q - 1)
    o_d = tl.arange(0, D_PAD)
    m_d = o_d < HEAD_DIM
    b_q = tl.load(
        q_ptr + i_b.to(tl.int64) * stride_qb + i_h.to(tl.int64) * stride_qh
        + o_slot[:, None].to(tl.int64) * stride_qn + o_d[None, :],
        mask=m_m[:, None] & m_d[None, :], other=0.0,
    )
    q_pos = tl.load(qpos_ptr + i_b.to(tl.int64) * stride_qpb + i_h.to(tl.int64) * stride_qph + o_slot, mask=m_m, other=0)

    # Key slots that can hold a visible key: up to the end of the latest query's segment.
    if CAUSAL:
        last_pos = tl.max(tl.where(m_m, q_pos, 0), 0)
        key_end = tl.where(last_pos >= permutable_key_len, last_pos + 1, (last_pos // segment_size + 1) * segment_size)
        key_end = tl.minimum(key_end, seq_len_k)
    else:
        key_end = seq_len_k
    n_blocks = tl.cdiv(key_end, BLOCK)

    p_k = k_ptr + i_b.to(tl.int64) * stride_kb + i_hk.to(tl.int64) * stride_kh
    p_lse = lse_ptr + i_bh.to(tl.int64) * num_query_blocks * R * num_key_blocks
    row_out = (o_qb * R + o_r).to(tl.int64) * num_key_blocks
    for j in range(0, n_blocks):
        o_n = j * BLOCK + tl.arange(0, BLOCK)
        m_n = o_n < seq_len_k
        if GATHER:
            src = tl.load(kidx_ptr + i_b.to(tl.int64) * stride_ib + i_hp.to(tl.int64) * stride_ih + o_n, mask=m_n, other=0)
        else:
            src = o_n
        b_k = tl.load(p_k + src[:, None].to(tl.int64) * stride_kn + o_d[None, :], mask=m_n[:, None] & m_d[None, :], other=0.0)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION) * qk_scale
        keep = m_n[None, :] & m_m[:, None]
        if CAUSAL:
            k_pos = tl.load(kpos_ptr + i_b.to(tl.int64) * stride_kpb + i_hp.to(tl.int64) * stride_kph + o_n, mask=m_n, other=0)
            keep = keep & (k_pos[None, :] <= q_pos[:, None])
        b_s = tl.where(keep, b_s, float("-inf"))
        row_max = tl.max(b_s, 1)
        safe = tl.where(row_max == float("-inf"), 0.0, row_max)
        total = tl.sum(tl.math.exp2(b_s - safe[:, None]), 1)
        lse = tl.where(total > 0.0, safe + tl.math.log2(total), float("-inf"))
        tl.store(p_lse + row_out + j, lse, mask=m_m)


@triton.jit
def _combine_kernel(
    lse_ptr, allowed_ptr, out_ptr, num_query_blocks, num_key_blocks,
    R: tl.constexpr, TK_PAD: tl.constexpr,
):
    i_q = tl.program_id(0)
    i_bh = tl.program_id(1)
    o_j = tl.arange(0, TK_PAD)
    m_j = o_j < num_key_blocks
    allowed = tl.load(allowed_ptr + i_q * num_key_blocks + o_j, mask=m_j, other=0) != 0
    o_r = tl.arange(0, R)
    p_lse = lse_ptr + (i_bh.to(tl.int64) * num_query_blocks + i_q) * R * num_key_blocks
    b_lse = tl.load(p_lse + o_r[:, None] * num_key_blocks + o_j[None, :], mask=allowed[None, :], other=float("-inf"))
    row_max = tl.max(b_lse, 1)
    safe = tl.where(row_max == float("-inf"), 0.0, row_max)
    p = tl.math.exp2(b_lse - safe[:, None])
    total = tl.sum(p, 1)
    p = p / tl.where(total > 0.0, total, 1.0)[:, None]
    share = tl.sum(p, 0) / R
    tl.store(out_ptr + (i_bh.to(tl.int64) * num_query_blocks + i_q) * num_key_blocks + o_j, share, mask=m_j)


def heads_per_scratch(layout: Layout, rows_per_block: int, scratch_bytes: int | None = None) -> int:
    """Query heads whose ``(Tq * R, Tk)`` fp32 row LSEs fit ``scratch_bytes`` (at least one)."""
    scratch_bytes = SCRATCH_BYTES if scratch_bytes is None else scratch_bytes
    per_head = layout.batch * layout.num_query_blocks * rows_per_block * layout.num_key_blocks * 4
    return max(1, min(layout.heads_q, scratch_bytes // max(1, per_head)))


def sampled_block_shares(
    q: torch.Tensor,
    k: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    layout: Layout,
    rows_per_block: int,
    scale: float,
    allowed: torch.Tensor,
    *,
    key_indices: torch.Tensor | None = None,
    head_start: int = 0,
    head_stop: int | None = None,
) -> torch.Tensor:
    """Block mass of the sampled rows for query heads ``[head_start, head_stop)``.

    Args:
        q: ``(B, Hq, Nq, D)`` permuted queries.
        k: ``(B, Hk, Nk, D)`` keys: permuted, or in original order when ``key_indices`` is given.
        query_positions: ``(B, Hq, Nq)`` original position of each query slot.
        key_positions: ``(B, Hk', Nk)`` original position of each key slot (``Hk'`` divides ``Hq``).
        layout: geometry of the call.
        rows_per_block: sampled rows per query block ``R`` (a power of two, at most 128).
        scale: softmax scale.
        allowed: ``(Tq, Tk)`` bool; blocks outside it get 0.
        key_indices: ``(B, Hk', Nk)`` slot -> original key index to read ``k`` through.

    Returns:
        ``(B, hc, Tq, Tk)`` float32 shares, each row summing to 1 over its allowed blocks.
    """
    if rows_per_block & (rows_per_block - 1) or not 1 <= rows_per_block <= ROWS_PER_TILE:
        raise ValueError(f"rows_per_block must be a power of two in 1..{ROWS_PER_TILE} on the GPU, got {rows_per_block}")
    b, hq, nq, d = q.shape
    head_stop = hq if head_stop is None else head_stop
    hc = head_stop - head_start
    tq, tk, bs = layout.num_query_blocks, layout.num_key_blocks, layout.block_size
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    key_positions = key_positions.contiguous()
    query_positions = query_positions.contiguous()
    lse = torch.empty(b, hc, tq * rows_per_block, tk, dtype=torch.float32, device=q.device)
    qb = max(1, ROWS_PER_TILE // rows_per_block)
    gather = key_indices is not None
    idx = key_indices.contiguous() if gather else key_positions
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _sampled_lse_kernel[(triton.cdiv(tq, qb), b * hc)](
        q, k, idx, query_positions, key_positions, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        idx.stride(0), idx.stride(1),
        query_positions.stride(0), query_positions.stride(1),
        key_positions.stride(0), key_positions.stride(1),
        hc, head_start, hq // k.shape[1], hq // key_positions.shape[1],
        nq, layout.seq_len_k, tq, tk,
        layout.segment_size, layout.permutable_key_len, float(scale) * LOG2_E,
        R=rows_per_block, QB=qb, BLOCK=bs, HEAD_DIM=d, D_PAD=max(16, triton.next_power_of_2(d)),
        GATHER=gather, CAUSAL=layout.causal, DOT_PRECISION=dot_precision,
        num_warps=8,
        **COMPILE_OPTIONS,
    )
    out = torch.empty(b, hc, tq, tk, dtype=torch.float32, device=q.device)
    tk_pad = max(16, triton.next_power_of_2(tk))
    _combine_kernel[(tq, b * hc)](
        lse, allowed.view(torch.int8), out, tq, tk,
        R=rows_per_block, TK_PAD=tk_pad, num_warps=max(1, min(8, tk_pad * rows_per_block // 1024)),
        **COMPILE_OPTIONS,
    )
    return out
