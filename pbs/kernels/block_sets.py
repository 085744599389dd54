"""The layout's allowed, diagonal and candidate block sets, built on the device in one launch.

The fast twin of `pbs.layout.Layout.allowed_blocks`, `diagonal_blocks`
and `candidate_blocks`, in closed form:

* *allowed* (not wholly in the future) compares effective position ranges: a block lies wholly
  inside or wholly outside the permutable prefix because ``S % block_size == 0``, and a slot's
  effective range bounds grow with the slot, so a block's lowest bound is its first slot's and its
  highest its last slot's;
* *diagonal* is the segment rule of the paper: key block ``j`` belongs to segment ``j * B // S``
  (the partial last segment, the last ``Nk mod S`` keys, is a segment too), query block ``i`` spans
  the segments of its first and last original positions, ``(slot + Nk - Nq) // S``, and the allowed
  key blocks of those segments are diagonal;
* *candidates* (the blocks a score-based selector ranks) are the allowed blocks minus the diagonal
  ones when the layout is segmented, every allowed block otherwise (the ``none`` permuter).

So ``allowed == candidates | diagonal`` always (unsegmented: the diagonal blocks are candidates).
One kernel instead of some forty small PyTorch ops keeps the host out of the way of planning.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pbs.layout import Layout
from pbs.kernels._common import COMPILE_OPTIONS


class BlockSets(NamedTuple):
    """``(Tq, Tk)`` bool block sets of a layout (see the module docstring)."""

    allowed: torch.Tensor
    diagonal: torch.Tensor
    candidates: torch.Tensor


@triton.jit
def _block_sets_kernel(
    allowed_ptr,
    diagonal_ptr,
    candidates_ptr,
    seq_len_q,
    seq_len_k,
    query_offset,
    permutable_key_len,
    permutable_q_lo,
    permutable_q_hi,
    num_key_blocks,
    BLOCK_SIZE: tl.constexpr,
    SEGMENT: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CAUSAL: tl.constexpr,
    SEGMENTED: tl.constexpr,
):
    i_q = tl.program_id(0)
    first = i_q * BLOCK_SIZE
    last = tl.minimum(first + BLOCK_SIZE, seq_len_q) - 1
    first_pos = first + query_offset
    last_pos = last + query_offset
    # Latest original position any permutation can put in this query block (allowed set).
    last_perm = (last >= permutable_q_lo) & (last < permutable_q_hi)
    q_hi = tl.where(last_perm, (last_pos // SEGMENT) * SEGMENT + SEGMENT - 1, last_pos)
    # Segments the query block spans (diagonal set); the partial last segment counts as one.
    q_seg_first = first_pos // SEGMENT
    q_seg_last = last_pos // SEGMENT
    for j0 in range(0, num_key_blocks, BLOCK_K):
        o_j = j0 + tl.arange(0, BLOCK_K)
        m_j = o_j < num_key_blocks
        start = o_j * BLOCK_SIZE
        k_perm = start < permutable_key_len
        k_lo = tl.where(k_perm, (start // SEGMENT) * SEGMENT, start)
        if CAUSAL:
            allowed = k_lo <= q_hi
        else:
            allowed = o_j >= 0
        k_seg = start // SEGMENT
        diagonal = (k_seg >= q_seg_first) & (k_seg <= q_seg_last) & allowed
        if SEGMENTED:
            candidates = allowed & (diagonal == 0)
        else:
            candidates = allowed
        row = i_q.to(tl.int64) * num_key_blocks + o_j
        tl.store(allowed_ptr + row, allowed.to(tl.int8), mask=m_j)
        tl.store(diagonal_ptr + row, diagonal.to(tl.int8), mask=m_j)
        tl.store(candidates_ptr + row, candidates.to(tl.int8), mask=m_j)


def block_sets(layout: Layout, device: torch.device | str) -> BlockSets:
    """``(allowed, diagonal, candidates)``, each ``(Tq, Tk)`` bool on ``device``, equal to the Layout's own."""
    tq, tk = layout.num_query_blocks, layout.num_key_blocks
    out = torch.empty(3, tq, tk, dtype=torch.int8, device=device)
    perm_lo, perm_hi = layout.permutable_query_range
    block_k = min(1024, max(16, triton.next_power_of_2(tk)))
    if tq and tk:
        _block_sets_kernel[(tq,)](
            out[0], out[1], out[2], layout.seq_len_q, layout.seq_len_k, layout.query_offset,
            layout.permutable_key_len, perm_lo, perm_hi, tk,
            BLOCK_SIZE=layout.block_size, SEGMENT=layout.segment_size, BLOCK_K=block_k, CAUSAL=layout.causal,
            SEGMENTED=layout.segmented, num_warps=4,
            **COMPILE_OPTIONS,
        )
    sets = out.view(torch.bool)
    return BlockSets(allowed=sets[0], diagonal=sets[1], candidates=sets[2])
