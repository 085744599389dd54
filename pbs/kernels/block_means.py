"""Block means of rows, optionally read through a permutation: the fast twin of
`pbs.reference.block_means.block_means` applied to ``Permutation.apply(x)``.

Reading the rows through the permutation's indices means the selectors never need a permuted copy
of K to pool it, which keeps `pbs.plan`'s memory small.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _block_means_kernel(
    x_ptr,
    idx_ptr,
    out_ptr,
    stride_xb,
    stride_xh,
    stride_xn,
    stride_ib,
    stride_ih,
    heads,
    group,
    seq_len,
    dim,
    num_blocks,
    BLOCK_SIZE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GATHER: tl.constexpr,
):
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // heads
    i_h = i_bh % heads
    i_hx = i_h // group  # input head of this output head (per-head GQA keys)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < dim
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    p_x = x_ptr + i_b.to(tl.int64) * stride_xb + i_hx.to(tl.int64) * stride_xh
    first = i_t * BLOCK_SIZE
    for r0 in range(0, BLOCK_SIZE, ROWS):
        o_r = first + r0 + tl.arange(0, ROWS)
        m_r = o_r < seq_len
        if GATHER:
            src = tl.load(idx_ptr + i_b.to(tl.int64) * stride_ib + i_h.to(tl.int64) * stride_ih + o_r, mask=m_r, other=0)
        else:
            src = o_r
        rows = tl.load(p_x + src[:, None].to(tl.int64) * stride_xn + o_d[None, :], mask=m_r[:, None] & m_d[None, :], other=0.0)
        acc += tl.sum(rows.to(tl.float32), 0)
    count = tl.minimum(seq_len - first, BLOCK_SIZE)
    p_out = out_ptr + (i_bh.to(tl.int64) * num_blocks + i_t) * dim + o_d
    tl.store(p_out, acc / count, mask=m_d)


def block_means(x: torch.Tensor, block_size: int, indices: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of every ``block_size`` rows (a partial last block averages what it has), in fp32.

    Args:
        x: ``(B, Hx, N, D)`` (unit stride along D).
        block_size: rows per block.
        indices: optional ``(B, H, N)`` int64 permutation with ``H % Hx == 0``: row ``t`` of output
            head ``h`` is ``x[b, h * Hx // H, indices[b, h, t]]``. None reads ``x`` as it is.

    Returns:
        ``(B, H, ceil(N / block_size), D)`` float32 (``H = Hx`` without ``indices``).
    """
    b, hx, n, d = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    heads = hx if indices is None else indices.shape[1]
    if indices is not None and indices.stride(-1) != 1:
        indices = indices.contiguous()
    num_blocks = triton.cdiv(n, block_size)
    out = torch.empty(b, heads, num_blocks, d, dtype=torch.float32, device=x.device)
    block_d = triton.next_power_of_2(d)
    rows = max(1, min(block_size, 4096 // block_d))
    idx = indices if indices is not None else out
    _block_means_kernel[(num_blocks, b * heads)](
        x, idx, out,
        x.stride(0), x.stride(1), x.stride(2),
        idx.stride(0) if indices is not None else 0, idx.stride(1) if indices is not None else 0,
        heads, heads // hx, n, d, num_blocks,
        BLOCK_SIZE=block_size, ROWS=rows, BLOCK_D=block_d, GATHER=indices is not None,
        num_warps=4,
    )
    return out
