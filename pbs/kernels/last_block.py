"""GPU ``last_block`` key permutation: the fast twin of `pbs.permuters.last_block`.

Scoring follows the reference. By default (Eq. 3 and the paper's code) the proxy queries see every
key with no causal mask, and the softmax is normalised over the keys of the full segments,
``[0, G * S)``, only: those are the only keys read (the last ``Nk mod S`` keys never move). With
``causal_scoring=True`` (and a causal layout) each proxy query's future keys are masked and the
softmax is normalised over all ``Nk`` keys. Without a full segment nothing moves: no launch, and
the identity permutation, as the reference.

Three launches, none of which holds more than one tile of scores:

1. ``_row_stats``: each proxy query's running max and sum of ``exp2`` over one split of the keys
   (about two waves of programs, each walking its split with an online softmax);
2. ``_key_scores``: merges the splits into one log-sum-exp per query, then computes
   ``s[n] = mean_rows(softmax)[n]`` for a tile of keys (Eq. 3);
3. ``_sort_segments``: one program per segment sorts the packed ``(score, reversed index)`` keys,
   which gives the reference's stable descending order, and writes the permutation and its inverse.

The proxy queries (the last block, averaged over the GQA group in shared mode) are read inside the
kernels, so the host issues three launches and two allocations: planning time at 16K is host time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pbs.kernels._common import COMPILE_OPTIONS, LOG2_E
from pbs.layout import Layout
from pbs.types import Permutation


@triton.jit
def _load_proxy_queries(
    q_ptr, stride_qb, stride_qh, stride_qm, i_b, i_h, first_row, num_queries,
    GROUP_Q: tl.constexpr, M_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
):
    """The last ``num_queries`` queries of scoring head ``i_h``: ``(M_PAD, D_PAD)`` in q's dtype.

    In shared GQA mode (``GROUP_Q > 1``) the ``GROUP_Q`` query heads of the group are averaged in
    fp32 and rounded back, as the reference does.
    """
    o_m = tl.arange(0, M_PAD)
    o_d = tl.arange(0, D_PAD)
    m_q = (o_m[:, None] < num_queries) & (o_d[None, :] < HEAD_DIM)
    p_q = q_ptr + i_b.to(tl.int64) * stride_qb + (first_row + o_m[:, None]).to(tl.int64) * stride_qm + o_d[None, :]
    if GROUP_Q == 1:
        return tl.load(p_q + i_h.to(tl.int64) * stride_qh, mask=m_q, other=0.0)
    acc = tl.zeros([M_PAD, D_PAD], dtype=tl.float32)
    for g in range(GROUP_Q):
        acc += tl.load(p_q + (i_h * GROUP_Q + g).to(tl.int64) * stride_qh, mask=m_q, other=0.0).to(tl.float32)
    return (acc / GROUP_Q).to(q_ptr.dtype.element_ty)


@triton.jit
def _proxy_logits(b_q, k_ptr, stride_kb, stride_kh, stride_kn, i_b, i_kh, start_n, seq_len_k, first_query_pos,
                  num_queries, qk_scale, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                  D_PAD: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``log2``-scaled logits of the proxy queries against keys ``[start_n, start_n + BLOCK_N)``; -inf where masked."""
    o_m = tl.arange(0, M_PAD)
    o_n = start_n + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, D_PAD)
    b_k = tl.load(
        k_ptr + i_b.to(tl.int64) * stride_kb + i_kh.to(tl.int64) * stride_kh
        + o_n[:, None].to(tl.int64) * stride_kn + o_d[None, :],
        mask=(o_n[:, None] < seq_len_k) & (o_d[None, :] < HEAD_DIM), other=0.0,
    )
    b_s = tl.dot(b_q, b_k.T, input_precision=DOT_PRECISION) * qk_scale
    keep = (o_n[None, :] < seq_len_k) & (o_m[:, None] < num_queries)
    if CAUSAL:
        keep = keep & (o_n[None, :] <= first_query_pos + o_m[:, None])
    return tl.where(keep, b_s, float("-inf"))


@triton.jit
def _row_stats(
    q_ptr, k_ptr, max_ptr, sum_ptr,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    heads, group, num_queries, seq_len_q, seq_len_k, first_query_pos, chunks_per_split, num_splits, qk_scale,
    GROUP_Q: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Per split of the keys: each proxy query's running max and sum of ``exp2`` (online softmax)."""
    i_s = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // heads
    i_h = i_bh % heads
    b_q = _load_proxy_queries(q_ptr, stride_qb, stride_qh, stride_qm, i_b, i_h, seq_len_q - num_queries,
                              num_queries, GROUP_Q, M_PAD, HEAD_DIM, D_PAD)
    m_i = tl.full([M_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([M_PAD], dtype=tl.float32)
    for c in range(i_s * chunks_per_split, tl.minimum((i_s + 1) * chunks_per_split, tl.cdiv(seq_len_k, BLOCK_N))):
        b_s = _proxy_logits(b_q, k_ptr, stride_kb, stride_kh, stride_kn, i_b, i_h // group, c * BLOCK_N, seq_len_k,
                            first_query_pos, num_queries, qk_scale, M_PAD, BLOCK_N, HEAD_DIM, D_PAD, CAUSAL,
                            DOT_PRECISION)
        m_new = tl.maximum(m_i, tl.max(b_s, 1))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.math.exp2(m_i - safe) + tl.sum(tl.math.exp2(b_s - safe[:, None]), 1)
        m_i = m_new
    p_out = (i_bh.to(tl.int64) * num_splits + i_s) * M_PAD + tl.arange(0, M_PAD)
    tl.store(max_ptr + p_out, m_i)
    tl.store(sum_ptr + p_out, l_i)


@triton.jit
def _key_scores(
    q_ptr, k_ptr, max_ptr, sum_ptr, out_ptr,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    heads, group, num_queries, seq_len_q, seq_len_k, first_query_pos, num_splits, qk_scale,
    GROUP_Q: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    """Merges the splits' statistics into one log-sum-exp per query, then ``s[n]`` for a tile of keys."""
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // heads
    i_h = i_bh % heads
    o_sp = tl.arange(0, SPLITS_PAD)
    p_stats = (i_bh.to(tl.int64) * num_splits + o_sp[:, None]) * M_PAD + tl.arange(0, M_PAD)[None, :]
    m_sp = o_sp[:, None] < num_splits
    part_max = tl.load(max_ptr + p_stats, mask=m_sp, other=float("-inf"))
    part_sum = tl.load(sum_ptr + p_stats, mask=m_sp, other=0.0)
    row_max = tl.max(part_max, 0)
    safe = tl.where(row_max == float("-inf"), 0.0, row_max)
    total = tl.sum(part_sum * tl.math.exp2(part_max - safe[None, :]), 0)
    # Padded rows see no key: +inf makes their probabilities 0.
    lse = tl.where(total > 0.0, safe + tl.math.log2(total), float("inf"))

    b_q = _load_proxy_queries(q_ptr, stride_qb, stride_qh, stride_qm, i_b, i_h, seq_len_q - num_queries,
                              num_queries, GROUP_Q, M_PAD, HEAD_DIM, D_PAD)
    b_s = _proxy_logits(b_q, k_ptr, stride_kb, stride_kh, stride_kn, i_b, i_h // group, i_c * BLOCK_N, seq_len_k,
                        first_query_pos, num_queries, qk_scale, M_PAD, BLOCK_N, HEAD_DIM, D_PAD, CAUSAL,
                        DOT_PRECISION)
    b_p = tl.math.exp2(b_s - lse[:, None])  # -inf - finite = -inf -> 0; padded rows -inf - inf -> 0
    scores = tl.sum(b_p, 0) / num_queries
    o_n = i_c * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + i_bh.to(tl.int64) * seq_len_k + o_n, scores, mask=o_n < seq_len_k)


@triton.jit
def _sort_segments(
    scores_ptr, indices_ptr, inverse_ptr, score_len, seq_len,
    SEGMENT: tl.constexpr, S_PAD: tl.constexpr,
):
    """One segment per program: sorted when it is full and scored, left in place (the tail) otherwise."""
    i_g = tl.program_id(0)
    i_bh = tl.program_id(1)
    o_s = tl.arange(0, S_PAD)
    first = i_g * SEGMENT
    base = i_bh.to(tl.int64) * seq_len + first
    if first + SEGMENT <= score_len:
        m_s = o_s < SEGMENT
        score = tl.load(scores_ptr + i_bh.to(tl.int64) * score_len + first + o_s, mask=m_s, other=0.0)
        score = tl.maximum(score, 0.0)  # non-negative floats order like their bits
        key = (score.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (S_PAD - 1 - o_s).to(tl.int64)
        key = tl.where(m_s, key, -1)
        ranked = tl.sort(key, 0, descending=True)
        local = (S_PAD - 1 - (ranked & 0xFFFFFFFF)).to(tl.int32)
        tl.store(indices_ptr + base + o_s, (first + local).to(tl.int64), mask=m_s)
        tl.store(inverse_ptr + base + local, (first + o_s).to(tl.int64), mask=m_s)
    else:
        m_s = first + o_s < seq_len
        tl.store(indices_ptr + base + o_s, (first + o_s).to(tl.int64), mask=m_s)
        tl.store(inverse_ptr + base + o_s, (first + o_s).to(tl.int64), mask=m_s)


def last_block_key_scores(
    q: torch.Tensor, k: torch.Tensor, layout: Layout, gqa: str, scale: float, num_queries: int,
    causal: bool | None = None,
) -> torch.Tensor:
    """Attention each key gets from the last ``num_queries`` queries (Eq. 3): ``(B, Hs, L)`` float32.

    Args:
        q: ``(B, Hq, Nq, D)`` queries, k: ``(B, Hkv, Nk, D)`` keys, both in original order.
        layout: the call's geometry.
        gqa: ``"per_head"`` (a score row per query head) or ``"shared"`` (per KV head, the group's
            queries averaged).
        scale: softmax scale.
        num_queries: how many of the last queries score the keys.
        causal: mask each proxy query's future keys and normalise over all keys (``L = Nk``);
            False (Eq. 3): no mask, softmax over the full-segment keys only
            (``L = layout.permutable_key_len``). None follows ``layout.causal``; True on a
            non-causal layout is False.

    ``Hs`` is ``Hkv`` in shared GQA mode (the group's queries averaged) and ``Hq`` in per-head mode.
    """
    causal = layout.causal if causal is None else bool(causal) and layout.causal
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    b, hq, nq, d = q.shape
    hs = hq if gqa == "per_head" else layout.heads_kv
    # Keys that are read and normalised over; the proxy queries' positions use the true Nk.
    nk = layout.seq_len_k if causal else layout.permutable_key_len
    first_query_pos = layout.seq_len_k - num_queries
    m = num_queries
    if nk == 0:
        return torch.zeros(b, hs, 0, dtype=torch.float32, device=k.device)
    m_pad = max(16, triton.next_power_of_2(m))
    d_pad = max(16, triton.next_power_of_2(d))
    block_n = max(16, min(128, 16384 // max(m_pad, d_pad)))
    chunks = triton.cdiv(nk, block_n)
    # About two waves of programs over the SMs for the statistics pass, each walking its split.
    target = 264 if q.is_cuda else 4
    chunks_per_split = max(1, triton.cdiv(chunks * b * hs, target))
    splits = triton.cdiv(chunks, chunks_per_split)
    common = (
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        hs, hs // layout.heads_kv, m, nq, nk, first_query_pos,
    )
    meta = dict(
        GROUP_Q=hq // hs, M_PAD=m_pad, BLOCK_N=block_n, HEAD_DIM=d, D_PAD=d_pad, CAUSAL=causal,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None, num_warps=8 if m_pad >= 128 else 4,
    )
    part_max = torch.empty(b * hs, splits, m_pad, dtype=torch.float32, device=k.device)
    part_sum = torch.empty_like(part_max)
    qk_scale = scale * LOG2_E
    _row_stats[(splits, b * hs)](q, k, part_max, part_sum, *common, chunks_per_split, splits, qk_scale, **meta,
                                 **COMPILE_OPTIONS)
    scores = torch.empty(b, hs, nk, dtype=torch.float32, device=k.device)
    _key_scores[(chunks, b * hs)](
        q, k, part_max, part_sum, scores, *common, splits, qk_scale,
        SPLITS_PAD=max(2, triton.next_power_of_2(splits)), **meta,
        **COMPILE_OPTIONS,
    )
    return scores


def sort_segments(scores: torch.Tensor, segment_size: int, total_len: int | None = None) -> Permutation:
    """Descending stable sort of ``scores (B, H, L)`` inside each full segment; the rest stays in place.

    Args:
        scores: ``(B, H, L)`` key scores.
        segment_size: ``S``.
        total_len: length ``N >= L`` of the permutation (default ``L``); slots at or past the last
            full segment of ``scores`` keep their place.

    Returns:
        ``(B, H, N)`` permutation with its inverse.
    """
    b, h, score_len = scores.shape
    n = score_len if total_len is None else total_len
    if n < score_len:
        raise ValueError(f"total_len ({n}) is shorter than the scores ({score_len})")
    indices = torch.empty(b, h, n, dtype=torch.int64, device=scores.device)
    inverse = torch.empty_like(indices)
    s_pad = triton.next_power_of_2(segment_size)
    if b * h * n:
        _sort_segments[(triton.cdiv(n, segment_size), b * h)](
            scores.contiguous(), indices, inverse, score_len, n, SEGMENT=segment_size, S_PAD=s_pad,
            num_warps=max(1, min(8, s_pad // 128)),
            **COMPILE_OPTIONS,
        )
    return Permutation(indices=indices, inverse=inverse)
