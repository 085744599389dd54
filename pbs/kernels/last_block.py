"""GPU ``last_block`` key permutation: the fast twin of :mod:`pbs.permuters.last_block`.

Three launches, none of which holds more than one tile of scores:

1. ``_row_stats``: per chunk of keys, each proxy query's max and sum of ``exp2`` of its logits;
   the chunks are merged into one log-sum-exp per query (a few KB, in torch);
2. ``_key_scores``: ``s[n] = mean_rows(softmax)[n]`` for every key, recomputed tile by tile
   against that log-sum-exp (Eq. 3);
3. ``_sort_segments``: one program per segment sorts the packed ``(score, reversed index)`` keys,
   which gives the reference's stable descending order, and writes the permutation and its inverse.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pbs.components import PermutationInputs, Permutations
from pbs.types import Permutation

LOG2_E = 1.4426950408889634


@triton.jit
def _row_stats(
    q_ptr, k_ptr, max_ptr, sum_ptr,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    heads, group, num_queries, seq_len_k, first_query_pos, num_chunks, qk_scale,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // heads
    i_h = i_bh % heads
    o_m = tl.arange(0, M_PAD)
    o_n = i_c * BLOCK_N + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, D_PAD)
    m_d = o_d < HEAD_DIM
    b_q = tl.load(
        q_ptr + i_b.to(tl.int64) * stride_qb + i_h.to(tl.int64) * stride_qh + o_m[:, None] * stride_qm + o_d[None, :],
        mask=(o_m[:, None] < num_queries) & m_d[None, :], other=0.0,
    )
    b_k = tl.load(
        k_ptr + i_b.to(tl.int64) * stride_kb + (i_h // group).to(tl.int64) * stride_kh
        + o_n[:, None].to(tl.int64) * stride_kn + o_d[None, :],
        mask=(o_n[:, None] < seq_len_k) & m_d[None, :], other=0.0,
    )
    b_s = tl.dot(b_q, b_k.T, input_precision=DOT_PRECISION) * qk_scale
    keep = (o_n[None, :] < seq_len_k) & (o_m[:, None] < num_queries)
    if CAUSAL:
        keep = keep & (o_n[None, :] <= first_query_pos + o_m[:, None])
    b_s = tl.where(keep, b_s, float("-inf"))
    row_max = tl.max(b_s, 1)
    safe_max = tl.where(row_max == float("-inf"), 0.0, row_max)
    row_sum = tl.sum(tl.math.exp2(b_s - safe_max[:, None]), 1)
    p_out = (i_bh.to(tl.int64) * num_chunks + i_c) * M_PAD + o_m
    tl.store(max_ptr + p_out, row_max)
    tl.store(sum_ptr + p_out, row_sum)


@triton.jit
def _key_scores(
    q_ptr, k_ptr, lse_ptr, out_ptr,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    heads, group, num_queries, seq_len_k, first_query_pos, qk_scale,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // heads
    i_h = i_bh % heads
    o_m = tl.arange(0, M_PAD)
    o_n = i_c * BLOCK_N + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, D_PAD)
    m_d = o_d < HEAD_DIM
    b_q = tl.load(
        q_ptr + i_b.to(tl.int64) * stride_qb + i_h.to(tl.int64) * stride_qh + o_m[:, None] * stride_qm + o_d[None, :],
        mask=(o_m[:, None] < num_queries) & m_d[None, :], other=0.0,
    )
    b_k = tl.load(
        k_ptr + i_b.to(tl.int64) * stride_kb + (i_h // group).to(tl.int64) * stride_kh
        + o_n[:, None].to(tl.int64) * stride_kn + o_d[None, :],
        mask=(o_n[:, None] < seq_len_k) & m_d[None, :], other=0.0,
    )
    b_lse = tl.load(lse_ptr + i_bh.to(tl.int64) * M_PAD + o_m)
    b_s = tl.dot(b_q, b_k.T, input_precision=DOT_PRECISION) * qk_scale
    keep = (o_n[None, :] < seq_len_k) & (o_m[:, None] < num_queries)
    if CAUSAL:
        keep = keep & (o_n[None, :] <= first_query_pos + o_m[:, None])
    b_p = tl.where(keep, tl.math.exp2(b_s - b_lse[:, None]), 0.0)
    scores = tl.sum(b_p, 0) / num_queries
    tl.store(out_ptr + i_bh.to(tl.int64) * seq_len_k + o_n, scores, mask=o_n < seq_len_k)


@triton.jit
def _sort_segments(
    scores_ptr, indices_ptr, inverse_ptr, seq_len,
    SEGMENT: tl.constexpr, S_PAD: tl.constexpr,
):
    i_g = tl.program_id(0)
    i_bh = tl.program_id(1)
    o_s = tl.arange(0, S_PAD)
    m_s = o_s < SEGMENT
    base = i_bh.to(tl.int64) * seq_len + i_g * SEGMENT
    score = tl.load(scores_ptr + base + o_s, mask=m_s, other=0.0)
    score = tl.maximum(score, 0.0)  # non-negative floats order like their bits
    key = (score.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (S_PAD - 1 - o_s).to(tl.int64)
    key = tl.where(m_s, key, -1)
    ranked = tl.sort(key, 0, descending=True)
    local = (S_PAD - 1 - (ranked & 0xFFFFFFFF)).to(tl.int32)
    first = i_g * SEGMENT
    tl.store(indices_ptr + base + o_s, (first + local).to(tl.int64), mask=m_s)
    tl.store(inverse_ptr + base + local, (first + o_s).to(tl.int64), mask=m_s)


def _proxy_queries(inputs: PermutationInputs, num_queries: int) -> torch.Tensor:
    """The last ``num_queries`` queries, group-averaged in shared GQA mode: ``(B, Hs, M, D)``."""
    q, layout = inputs.q, inputs.layout
    last = q[:, :, layout.seq_len_q - num_queries :]
    if inputs.gqa == "per_head":
        return last.contiguous()
    b, _, m, d = last.shape
    # Same rounding as the reference (pbs.permuters._segments.scoring_queries).
    return last.reshape(b, layout.heads_kv, layout.group_size, m, d).float().mean(2).to(q.dtype).contiguous()


def last_block_key_scores(inputs: PermutationInputs, num_queries: int) -> torch.Tensor:
    """Attention each key gets from the last ``num_queries`` queries (Eq. 3): ``(B, Hs, Nk)`` float32."""
    layout = inputs.layout
    k = inputs.k if inputs.k.stride(-1) == 1 else inputs.k.contiguous()
    queries = _proxy_queries(inputs, num_queries)
    b, hs, m, d = queries.shape
    nk = layout.seq_len_k
    m_pad = max(16, triton.next_power_of_2(m))
    d_pad = max(16, triton.next_power_of_2(d))
    block_n = max(16, min(128, 16384 // max(m_pad, d_pad)))
    chunks = triton.cdiv(nk, block_n)
    group = hs // layout.heads_kv
    qk_scale = inputs.scale * LOG2_E
    first_query_pos = nk - m
    common = (
        queries.stride(0), queries.stride(1), queries.stride(2), k.stride(0), k.stride(1), k.stride(2),
        hs, group, m, nk, first_query_pos,
    )
    meta = dict(M_PAD=m_pad, BLOCK_N=block_n, HEAD_DIM=d, D_PAD=d_pad, CAUSAL=layout.causal,
                DOT_PRECISION="ieee" if queries.dtype == torch.float32 else None, num_warps=8 if m_pad >= 128 else 4)
    part_max = torch.empty(b * hs, chunks, m_pad, dtype=torch.float32, device=k.device)
    part_sum = torch.empty_like(part_max)
    _row_stats[(chunks, b * hs)](queries, k, part_max, part_sum, *common, chunks, qk_scale, **meta)
    row_max = part_max.amax(1, keepdim=True)
    safe = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    total = (part_sum * torch.exp2(part_max - safe)).sum(1)
    # Padded rows see no key: +inf makes their probabilities 0.
    lse = torch.where(total > 0, safe.squeeze(1) + torch.log2(total), torch.full_like(total, float("inf"))).contiguous()
    scores = torch.empty(b, hs, nk, dtype=torch.float32, device=k.device)
    _key_scores[(chunks, b * hs)](queries, k, lse, scores, *common, qk_scale, **meta)
    return scores


def sort_segments(scores: torch.Tensor, segment_size: int, num_segments: int) -> Permutation:
    """Descending stable sort of ``scores (B, H, N)`` inside each of the first ``num_segments`` segments."""
    b, h, n = scores.shape
    indices = torch.arange(n, device=scores.device).repeat(b, h, 1)
    inverse = indices.clone()
    if num_segments:
        s_pad = triton.next_power_of_2(segment_size)
        _sort_segments[(num_segments, b * h)](
            scores.contiguous(), indices, inverse, n, SEGMENT=segment_size, S_PAD=s_pad,
            num_warps=max(1, min(8, s_pad // 128)),
        )
    return Permutation(indices=indices, inverse=inverse)


def last_block_permute(config, inputs: PermutationInputs) -> Permutations:
    """``triton`` implementation of :class:`~pbs.permuters.last_block.LastBlockPermuter`."""
    layout = inputs.layout
    m = min(layout.seq_len_q, config.num_queries or layout.block_size)
    scores = last_block_key_scores(inputs, m)
    return Permutations(keys=sort_segments(scores, layout.segment_size, layout.num_full_segments))
