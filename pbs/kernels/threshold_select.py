"""Cumulative-threshold block selection straight to a `BlockMask`, one row per program.

The fast twin of `pbs.reference.threshold_select.select_by_cumulative_threshold` followed by
`pbs.planning.finalize_selection` and `BlockMask.from_dense`: softmax (for logits),
sort, cumulative sum, threshold, forced blocks and the compaction to a sorted list all happen in
registers, so no ``(B, Hq, Tq, Tk)`` bool or float mask is ever written.

Semantics (the paper's Algorithm 2 and XAttention's estimator, as the reference selectors):

* only the *candidate* blocks (`pbs.kernels.block_sets.block_sets`) are ranked: the softmax of
  logits is taken over them, and the fewest highest-scoring ones whose scores reach ``tau`` are
  kept; a row without candidates keeps nothing here;
* the *forced* blocks, the diagonal set and (optionally) the sink block, are then added, limited to
  the allowed blocks (``candidates | diagonal``);
* ``forced_first`` (XAttention's rule, used by the unsegmented ``antidiagonal`` selector): the
  forced blocks that are candidates rank ahead of every other candidate and their mass counts first
  towards ``tau``, as ``ranked_first`` does in the reference.

Ties: a score and its block index are packed into one int64 key (a forced-first flag at bit 62,
the score's bits from bit 32, the reversed index low), so a descending sort ranks equal scores by
ascending block index, as the reference's stable sort does, and the kept set is exactly the first
``needed`` keys. The reference ranks forced-first blocks by ``score + 2`` in fp32, which can merge
two of their scores into a tie; that only reorders blocks that are all kept anyway.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pbs.kernels._common import COMPILE_OPTIONS, LOG2_E
from pbs.layout import Layout
from pbs.types import block_index_dtype


@triton.jit
def _threshold_select_kernel(
    scores_ptr,
    candidates_ptr,
    diagonal_ptr,
    stride_sets_b,
    row_limit_ptr,
    key_limit_ptr,
    narrower_than,
    inverse_ptr,
    stride_inv_b,
    stride_inv_h,
    key_group,
    counts_ptr,
    indices_ptr,
    heads_chunk,
    head_offset,
    heads_total,
    num_query_blocks,
    num_key_blocks,
    threshold,
    logit_scale,
    block_size,
    TK_PAD: tl.constexpr,
    FROM_LOGITS: tl.constexpr,
    FORCE_SINK: tl.constexpr,
    FORCED_FIRST: tl.constexpr,
    ROW_LIMIT: tl.constexpr,
    KEY_LIMIT: tl.constexpr,
):
    i_row = tl.program_id(0)  # (b, local head, query block) of this chunk, row-major
    i_q = i_row % num_query_blocks
    i_bh = i_row // num_query_blocks
    i_h = i_bh % heads_chunk + head_offset
    i_b = i_bh // heads_chunk
    o_j = tl.arange(0, TK_PAD)
    m_j = o_j < num_key_blocks
    out_row = (i_b.to(tl.int64) * heads_total + i_h) * num_query_blocks + i_q
    p_list = indices_ptr + out_row * num_key_blocks
    if KEY_LIMIT:
        # A padded batch ranked in width classes: this launch takes the entries whose own key
        # blocks number in (narrower_than, TK_PAD], and writes the rest of each row's list (-1).
        own = tl.load(key_limit_ptr + i_b)
        if (own > TK_PAD) | (own <= narrower_than):
            return
        for j0 in range(TK_PAD, num_key_blocks, TK_PAD):
            tl.store(p_list + j0 + o_j, tl.full([TK_PAD], -1, indices_ptr.dtype.element_ty),
                     mask=j0 + o_j < num_key_blocks)
    if ROW_LIMIT:
        # A padded batch: rows past the entry's own query blocks (or of an entry that is not
        # planned) get an empty list without ranking a padded row of scores.
        if i_q >= tl.load(row_limit_ptr + i_b):
            tl.store(p_list + o_j, tl.full([TK_PAD], -1, indices_ptr.dtype.element_ty), mask=m_j)
            tl.store(counts_ptr + out_row, 0)
            return

    p_sets = i_b.to(tl.int64) * stride_sets_b + i_q.to(tl.int64) * num_key_blocks + o_j
    candidates = tl.load(candidates_ptr + p_sets, mask=m_j, other=0) != 0
    diagonal = tl.load(diagonal_ptr + p_sets, mask=m_j, other=0) != 0
    allowed = candidates | diagonal  # block_sets guarantees it: no third load
    forced = diagonal
    if FORCE_SINK:
        # The sink is the block of the slot that original position 0 moved to.
        sink_slot = tl.load(inverse_ptr + i_b.to(tl.int64) * stride_inv_b + (i_h // key_group).to(tl.int64) * stride_inv_h)
        forced = forced | (o_j == sink_slot // block_size)
    forced = forced & allowed

    x = tl.load(scores_ptr + i_row.to(tl.int64) * num_key_blocks + o_j, mask=m_j, other=0.0)
    if FROM_LOGITS:
        x = tl.where(candidates, x * logit_scale, float("-inf"))
        row_max = tl.max(x, 0)
        row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
        p = tl.math.exp2(x - row_max)
        total = tl.sum(p, 0)
        p = p / tl.where(total > 0.0, total, 1.0)
    else:
        p = tl.where(candidates, x, 0.0)
    p = tl.maximum(p, 0.0)  # -0.0 and tiny negatives would break the bit-order of the key

    # Non-negative floats order like their bit patterns (below 2**30 for p <= 1); -1 sorts every
    # non-candidate last; bit 62 ranks the forced blocks first in forced-first mode.
    key = (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (TK_PAD - 1 - o_j).to(tl.int64)
    if FORCED_FIRST:
        key = tl.where(forced, key | (1 << 62), key)
    key = tl.where(candidates, key, -1)
    ranked = tl.sort(key, 0, descending=True)
    ranked_bits = ((ranked >> 32) & 0x3FFFFFFF).to(tl.int32)
    ranked_p = tl.where(ranked >= 0, ranked_bits.to(tl.float32, bitcast=True), 0.0)
    cumulative = tl.cumsum(ranked_p, 0)
    num_candidates = tl.sum(candidates.to(tl.int32), 0)
    needed = tl.sum((cumulative < threshold).to(tl.int32), 0) + 1
    needed = tl.minimum(needed, num_candidates)
    if FORCED_FIRST:
        needed = tl.maximum(needed, tl.sum((forced & candidates).to(tl.int32), 0))
    o_rank = tl.arange(0, TK_PAD)
    cutoff = tl.max(tl.where(o_rank == needed - 1, ranked, -1), 0)
    selected = candidates & (key >= cutoff) & (needed > 0)
    selected = selected | forced

    taken = selected.to(tl.int32)
    count = tl.sum(taken, 0)
    slot = tl.cumsum(taken, 0) - 1
    tl.store(p_list + slot, o_j.to(indices_ptr.dtype.element_ty), mask=taken != 0)
    tl.store(p_list + o_j, tl.full([TK_PAD], -1, indices_ptr.dtype.element_ty), mask=m_j & (o_j >= count))
    tl.store(counts_ptr + out_row, count)


def empty_block_mask_tensors(layout: Layout, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised ``counts (B, Hq, Tq)`` int32 and ``indices (B, Hq, Tq, Tk)`` for a BlockMask."""
    b, hq, tq, tk = layout.batch, layout.heads_q, layout.num_query_blocks, layout.num_key_blocks
    counts = torch.empty(b, hq, tq, dtype=torch.int32, device=device)
    indices = torch.empty(b, hq, tq, tk, dtype=block_index_dtype(tk), device=device)
    return counts, indices


def threshold_select_rows(
    scores: torch.Tensor,
    layout: Layout,
    threshold: float,
    counts: torch.Tensor,
    indices: torch.Tensor,
    *,
    head_offset: int,
    key_inverse: torch.Tensor | None,
    from_logits: bool,
    candidates: torch.Tensor,
    diagonal: torch.Tensor,
    logit_scale: float = 1.0,
    forced_first: bool = False,
    row_limits: torch.Tensor | None = None,
    key_limits: torch.Tensor | None = None,
) -> None:
    """Selects the blocks of query heads ``[head_offset, head_offset + hc)`` into ``counts``/``indices``.

    Args:
        scores: ``(B, hc, Tq, Tk)`` float32, contiguous: logits (``from_logits``: the softmax over
            the candidate blocks is taken here after multiplying by ``logit_scale``) or shares that
            already sum to 1 over the candidate blocks of each row (or are all zero).
        layout: geometry of the call.
        threshold: ``tau`` in ``(0, 1]``.
        counts, indices: the BlockMask tensors of all ``Hq`` heads (see
            `empty_block_mask_tensors`); rows of this chunk are written.
        head_offset: first query head of the chunk.
        key_inverse: ``(B, Hk, Nk)`` inverse key permutation (original index -> slot), whose
            entry for position 0 gives the sink block; None to not force the sink.
        from_logits: whether ``scores`` are logits or shares.
        candidates, diagonal: ``(Tq, Tk)`` bool block sets of the layout
            (`pbs.kernels.block_sets.block_sets`), or ``(B, Tq, Tk)``, one per batch entry (a
            padded batch of sequences, `pbs.serving.ragged`); the allowed set is their union.
        logit_scale: factor of the logits before the softmax.
        forced_first: rank the forced candidates (diagonal and sink) first and count their mass
            first towards ``threshold`` (XAttention's rule; see the module docstring).
        row_limits: ``(B,)`` int32 or int64: batch entry ``b`` selects in its first
            ``row_limits[b]`` query blocks only; its later rows get empty lists (a padded batch,
            whose rows past a sequence's queries, or of a sequence that is not planned, are not
            ranked). None: every row.
        key_limits: ``(B,)`` int32: batch entry ``b``'s own key blocks (a padded batch, whose
            candidates past them are all false). Its rows are then sorted at the power-of-two
            width that holds them rather than at ``Tk``'s (one launch per width class, from
            ``Tk``'s down to an eighth of it), as the eager path sorts each sequence alone.
            None: every row at ``Tk``'s width.
    """
    b, hc, tq, tk = scores.shape
    if b * hc * tq == 0 or tk == 0:
        return
    scores = scores.contiguous()
    inverse = key_inverse if key_inverse is not None else counts
    key_group = layout.heads_q // key_inverse.shape[1] if key_inverse is not None else 1
    tk_pad = max(16, triton.next_power_of_2(tk))
    widths = [tk_pad]
    if key_limits is not None:
        widths = [w for w in (tk_pad, tk_pad // 2, tk_pad // 4, tk_pad // 8) if w >= 16]
    sets_stride = tq * tk if candidates.dim() == 3 else 0
    candidates, diagonal = candidates.contiguous().view(torch.int8), diagonal.contiguous().view(torch.int8)
    for width, narrower in zip(widths, [*widths[1:], -1]):  # -1: the narrowest takes entries of no keys too
        _threshold_select_kernel[(b * hc * tq,)](
            scores, candidates, diagonal, sets_stride,
            row_limits if row_limits is not None else counts,
            key_limits if key_limits is not None else counts, narrower,
            inverse, inverse.stride(0) if key_inverse is not None else 0,
            inverse.stride(1) if key_inverse is not None else 0, key_group,
            counts, indices,
            hc, head_offset, layout.heads_q, tq, tk,
            float(threshold), float(logit_scale) * LOG2_E if from_logits else 1.0, layout.block_size,
            TK_PAD=width,
            FROM_LOGITS=from_logits,
            FORCE_SINK=key_inverse is not None,
            FORCED_FIRST=forced_first,
            ROW_LIMIT=row_limits is not None,
            KEY_LIMIT=key_limits is not None,
            num_warps=max(1, min(8, width // 256)),
            **COMPILE_OPTIONS,
        )
