"""The layout's allowed and diagonal block sets, built on the device in one launch.

The fast twin of :meth:`pbs.layout.Layout.allowed_blocks` / :meth:`~pbs.layout.Layout.diagonal_blocks`:
the same effective position ranges in closed form (a block lies wholly inside or wholly outside the
permutable prefix because ``S % block_size == 0``, and a slot's effective range bounds grow with
the slot, so a block's lowest bound is its first slot's and its highest its last slot's). One
kernel instead of some forty small PyTorch ops keeps the host out of the way of planning.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pbs.layout import Layout


@triton.jit
def _block_sets_kernel(
    allowed_ptr,
    diagonal_ptr,
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
):
    i_q = tl.program_id(0)
    first = i_q * BLOCK_SIZE
    last = tl.minimum(first + BLOCK_SIZE, seq_len_q) - 1
    first_pos = first + query_offset
    last_pos = last + query_offset
    first_perm = (first >= permutable_q_lo) & (first < permutable_q_hi)
    last_perm = (last >= permutable_q_lo) & (last < permutable_q_hi)
    q_lo = tl.where(first_perm, (first_pos // SEGMENT) * SEGMENT, first_pos)
    q_hi = tl.where(last_perm, (last_pos // SEGMENT) * SEGMENT + SEGMENT - 1, last_pos)
    for j0 in range(0, num_key_blocks, BLOCK_K):
        o_j = j0 + tl.arange(0, BLOCK_K)
        m_j = o_j < num_key_blocks
        start = o_j * BLOCK_SIZE
        k_perm = start < permutable_key_len
        seg = (start // SEGMENT) * SEGMENT
        k_lo = tl.where(k_perm, seg, start)
        k_hi = tl.where(k_perm, seg + SEGMENT - 1, tl.minimum(start + BLOCK_SIZE, seq_len_k) - 1)
        not_future = k_lo <= q_hi
        if CAUSAL:
            allowed = not_future
        else:
            allowed = o_j >= 0
        diagonal = (k_hi >= q_lo) & not_future
        row = i_q.to(tl.int64) * num_key_blocks + o_j
        tl.store(allowed_ptr + row, allowed.to(tl.int8), mask=m_j)
        tl.store(diagonal_ptr + row, diagonal.to(tl.int8), mask=m_j)


def block_sets(layout: Layout, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(allowed, diagonal)``, each ``(Tq, Tk)`` bool on ``device``, equal to the Layout's own."""
    tq, tk = layout.num_query_blocks, layout.num_key_blocks
    allowed = torch.empty(tq, tk, dtype=torch.int8, device=device)
    diagonal = torch.empty(tq, tk, dtype=torch.int8, device=device)
    perm_lo, perm_hi = layout.permutable_query_range
    block_k = min(1024, max(16, triton.next_power_of_2(tk)))
    _block_sets_kernel[(tq,)](
        allowed, diagonal, layout.seq_len_q, layout.seq_len_k, layout.query_offset,
        layout.permutable_key_len, perm_lo, perm_hi, tk,
        BLOCK_SIZE=layout.block_size, SEGMENT=layout.segment_size, BLOCK_K=block_k, CAUSAL=layout.causal,
        num_warps=4,
    )
    return allowed.view(torch.bool), diagonal.view(torch.bool)
