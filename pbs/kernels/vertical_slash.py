"""``vertical_slash`` selection on the GPU: the fast twin of `pbs.selectors.vertical_slash`.

Three launches and a few PyTorch reductions instead of the reference's dozens of ops:

1. ``_row_stats``: the log-sum-exp of the last ``R`` queries' rows, split over the keys (one
   program per query head and key split, online softmax), combined on the device;
2. ``_row_probs``: each row's softmax over a key tile; the per-key sum (vertical score) is stored
   directly, and the probabilities go to a zero-padded buffer with the keys reversed, where the
   per-offset sum (slash score) is one strided mean (`pbs.selectors.vertical_slash`'s skewed view);
3. the thresholds are the reference's own (`kept_lines`: a sort and a scan per head),
   and ``_lines_to_blocks`` compacts, per (head, query block), the key blocks that hold a kept key
   or that a kept offset crosses, plus the forced blocks, straight into a `BlockMask`.

It runs for unsegmented layouts whose keys and queries are in their original order (the
``none`` permuter, the selector's intended use); anything else falls back to the reference.
Differences to the reference come only from the logits' rounding (``tl.dot`` against an fp32
einsum), which can flip a key or offset that sits exactly at a threshold.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pbs.kernels._common import LOG2_E, interpreting
from pbs.types import BlockMask, block_index_dtype


@triton.jit
def _load_rows(q_ptr, b, hq, stride_qb, stride_qh, stride_qn, rows_start, rows,
               ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    o_r = tl.arange(0, ROWS)
    o_d = tl.arange(0, D_PAD)
    ptrs = q_ptr + b.to(tl.int64) * stride_qb + hq.to(tl.int64) * stride_qh + (rows_start + o_r)[:, None] * stride_qn
    return tl.load(ptrs + o_d[None, :], mask=(o_r[:, None] < rows) & (o_d[None, :] < HEAD_DIM), other=0.0)


@triton.jit
def _program_rows(q_ptr, stride_qb, stride_qh, stride_qn, heads_q, rows_start, rows, query_offset,
                  ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    """This program's (batch, query head), its last rows' queries and their original positions."""
    pid_bh = tl.program_id(0)
    b = pid_bh // heads_q
    hq = pid_bh % heads_q
    q = _load_rows(q_ptr, b, hq, stride_qb, stride_qh, stride_qn, rows_start, rows, ROWS, HEAD_DIM, D_PAD)
    row_pos = rows_start + query_offset + tl.arange(0, ROWS)
    return pid_bh, b, hq, q, row_pos


@triton.jit
def _scores(q, k_ptr, b, hk, stride_kb, stride_kh, stride_kn, cols, key_end, row_pos, qk_scale,
            HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr):
    """Logits of the rows against the keys ``cols`` in the log2 domain, -inf where not allowed."""
    o_d = tl.arange(0, D_PAD)
    ptrs = k_ptr + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh + cols[:, None].to(tl.int64) * stride_kn
    k = tl.load(ptrs + o_d[None, :], mask=(cols[:, None] < key_end) & (o_d[None, :] < HEAD_DIM), other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * qk_scale
    valid = cols[None, :] < key_end
    if CAUSAL:
        valid = valid & (cols[None, :] <= row_pos[:, None])
    return tl.where(valid, s, float("-inf"))


@triton.jit
def _row_stats(q_ptr, k_ptr, m_ptr, l_ptr,
               stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
               heads_q, group, rows_start, rows, seq_len_k, query_offset, keys_per_split, splits, qk_scale,
               ROWS: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
               CAUSAL: tl.constexpr, IEEE: tl.constexpr):
    pid_bh, b, hq, q, row_pos = _program_rows(q_ptr, stride_qb, stride_qh, stride_qn, heads_q, rows_start, rows,
                                              query_offset, ROWS, HEAD_DIM, D_PAD)
    split = tl.program_id(1)
    o_r = tl.arange(0, ROWS)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    key_start = split * keys_per_split
    key_end = tl.minimum(key_start + keys_per_split, seq_len_k)
    for n0 in range(key_start, key_end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        s = _scores(q, k_ptr, b, hq // group, stride_kb, stride_kh, stride_kn, cols, key_end, row_pos, qk_scale,
                    HEAD_DIM, D_PAD, CAUSAL, IEEE)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
        m_i = m_new
    out = (pid_bh * splits + split) * ROWS + o_r
    tl.store(m_ptr + out, m_i)
    tl.store(l_ptr + out, l_i)


@triton.jit
def _row_probs(q_ptr, k_ptr, lse_ptr, vertical_ptr, reversed_ptr,
               stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
               heads_q, group, rows_start, rows, seq_len_k, query_offset, row_length, qk_scale,
               ROWS: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
               CAUSAL: tl.constexpr, IEEE: tl.constexpr):
    pid_bh, b, hq, q, row_pos = _program_rows(q_ptr, stride_qb, stride_qh, stride_qn, heads_q, rows_start, rows,
                                              query_offset, ROWS, HEAD_DIM, D_PAD)
    pid_n = tl.program_id(1)
    o_r = tl.arange(0, ROWS)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    s = _scores(q, k_ptr, b, hq // group, stride_kb, stride_kh, stride_kn, cols, seq_len_k, row_pos, qk_scale,
                HEAD_DIM, D_PAD, CAUSAL, IEEE)
    lse = tl.load(lse_ptr + pid_bh * ROWS + o_r)
    p = tl.exp2(s - lse[:, None])
    p = tl.where(o_r[:, None] < rows, p, 0.0)
    in_range = cols < seq_len_k
    tl.store(vertical_ptr + pid_bh.to(tl.int64) * seq_len_k + cols, tl.sum(p, 0) / rows, mask=in_range)
    reversed_cols = seq_len_k - 1 - cols
    base = reversed_ptr + pid_bh.to(tl.int64) * rows * row_length
    ptrs = base + o_r[:, None].to(tl.int64) * row_length + reversed_cols[None, :]
    tl.store(ptrs, p, mask=(o_r[:, None] < rows) & in_range[None, :])


@triton.jit
def _lines_to_blocks(vertical_blocks_ptr, prefix_ptr, counts_ptr, indices_ptr,
                     num_query_blocks, num_key_blocks, seq_len_q, seq_len_k, query_offset,
                     BLOCK: tl.constexpr, CHUNK: tl.constexpr, CAUSAL: tl.constexpr, FORCE_SINK: tl.constexpr):
    pid = tl.program_id(0)
    bh = pid // num_query_blocks
    i = pid % num_query_blocks
    first_slot = i * BLOCK
    last_slot = tl.minimum(first_slot + BLOCK, seq_len_q) - 1
    q_lo = first_slot + query_offset
    q_hi = last_slot + query_offset
    written = i * 0
    row = indices_ptr + pid.to(tl.int64) * num_key_blocks
    prefix = prefix_ptr + bh.to(tl.int64) * (seq_len_k + 1)
    for j0 in range(0, num_key_blocks, CHUNK):
        j = j0 + tl.arange(0, CHUNK)
        in_range = j < num_key_blocks
        k_lo = j * BLOCK
        k_hi = tl.minimum(k_lo + BLOCK, seq_len_k) - 1
        allowed = in_range
        if CAUSAL:
            allowed = allowed & (k_lo <= q_hi)
        # Unsegmented layouts: the diagonal blocks are the key blocks of the query block's positions.
        forced = (j >= q_lo // BLOCK) & (j <= q_hi // BLOCK)
        if FORCE_SINK:
            forced = forced | (j == 0)
        lo = tl.minimum(tl.maximum(q_lo - k_hi, 0), seq_len_k)
        hi = tl.minimum(tl.maximum(q_hi - k_lo + 1, 0), seq_len_k)
        crossed = tl.load(prefix + hi, mask=in_range, other=0) - tl.load(prefix + lo, mask=in_range, other=0)
        vertical = tl.load(vertical_blocks_ptr + bh.to(tl.int64) * num_key_blocks + j, mask=in_range, other=0)
        keep = allowed & (forced | (vertical != 0) | (crossed > 0))
        keep_i = keep.to(tl.int32)
        slot = written + tl.cumsum(keep_i, 0) - 1
        tl.store(row + slot, j.to(indices_ptr.dtype.element_ty), mask=keep)
        written += tl.sum(keep_i, 0)
    tl.store(counts_ptr + pid, written)


def supports_fast_path(inputs) -> bool:
    """The kernels assume unsegmented blocks with keys and queries in their original order."""
    layout = inputs.layout
    if layout.segmented or (inputs.q.device.type != "cuda" and not interpreting()):
        return False
    perm = inputs.key_permutation
    return perm is None or perm.is_identity


def last_rows_scores(inputs, last_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(vertical, slash)``, each ``(B, Hq, Nk)`` float32: what
    `pbs.selectors.vertical_slash.vertical_and_slash_scores` returns for the same rows."""
    from pbs.selectors.vertical_slash import slash_of_padded_rows

    layout = inputs.layout
    q = inputs.q
    k = inputs.source_k if inputs.source_k is not None else inputs.k
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    group = hq // hk
    rows = min(last_rows, nq)
    rows_start = nq - rows
    rows_pad = max(16, triton.next_power_of_2(rows))
    d_pad = max(16, triton.next_power_of_2(d))
    block_n = 64
    ieee = q.dtype == torch.float32
    qk_scale = inputs.scale * LOG2_E
    common = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), hq, group, rows_start, rows)
    meta = dict(ROWS=rows_pad, BLOCK_N=block_n, HEAD_DIM=d, D_PAD=d_pad, CAUSAL=layout.causal, IEEE=ieee)
    # Enough programs to fill the GPU: split the keys of each head's rows.
    splits = max(1, min(triton.cdiv(nk, 4 * block_n), triton.cdiv(264, b * hq)))
    keys_per_split = triton.cdiv(triton.cdiv(nk, splits), block_n) * block_n
    splits = triton.cdiv(nk, keys_per_split)
    part_max = torch.empty(b * hq, splits, rows_pad, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    _row_stats[(b * hq, splits)](q, k, part_max, part_sum, *common, nk, layout.query_offset, keys_per_split,
                                 splits, qk_scale, **meta)
    top = part_max.amax(1, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    lse = (top.squeeze(1) + torch.log2((part_sum * torch.exp2(part_max - top)).sum(1))).contiguous()
    vertical = torch.empty(b, hq, nk, dtype=torch.float32, device=q.device)
    lag = nk - 1 - (layout.query_offset + nq - 1)
    row_length = nk + rows + lag
    reversed_rows = torch.zeros(b, hq, rows, row_length, dtype=torch.float32, device=q.device)
    _row_probs[(b * hq, triton.cdiv(nk, block_n))](q, k, lse, vertical, reversed_rows, *common, nk,
                                                   layout.query_offset, row_length, qk_scale, **meta)
    return vertical, slash_of_padded_rows(reversed_rows, nk, layout.query_offset + nq - 1)


def vertical_slash_select(config, inputs) -> BlockMask:
    """``triton`` implementation of `VerticalSlashSelector` (reference fallback off its fast path)."""
    from pbs.planning import finalize_selection
    from pbs.selectors.vertical_slash import kept_lines, offset_prefix

    if not supports_fast_path(inputs):
        return finalize_selection(config.select(inputs), inputs.layout, inputs.key_positions, inputs.force_sink_block)
    layout = inputs.layout
    b, hq = layout.batch, layout.heads_q
    tq, tk, nk, bs = layout.num_query_blocks, layout.num_key_blocks, layout.seq_len_k, layout.block_size
    vertical, slash = last_rows_scores(inputs, config.last_rows)
    keys, offsets = kept_lines(vertical, slash, config.threshold, config.vertical_threshold)
    vertical_blocks = torch.nn.functional.pad(keys, (0, tk * bs - nk)).view(b, hq, tk, bs).any(-1).to(torch.int8)
    prefix = offset_prefix(offsets).contiguous()
    counts = torch.empty(b, hq, tq, dtype=torch.int32, device=inputs.q.device)
    indices = torch.full((b, hq, tq, tk), -1, dtype=block_index_dtype(tk), device=inputs.q.device)
    _lines_to_blocks[(b * hq * tq,)](
        vertical_blocks.contiguous(), prefix, counts, indices, tq, tk, layout.seq_len_q, nk, layout.query_offset,
        BLOCK=bs, CHUNK=min(1024, triton.next_power_of_2(tk)), CAUSAL=layout.causal,
        FORCE_SINK=inputs.force_sink_block,
    )
    return BlockMask(counts=counts, indices=indices, layout=layout)
