"""Block means of rows, optionally read through a permutation: the fast twin of
`pbs.reference.block_means.block_means` applied to ``Permutation.apply(x)``.

Reading the rows through the permutation's indices means the selectors never need a permuted copy
of K to pool it, which keeps `pbs.plan`'s memory small.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from pbs.kernels._common import COMPILE_OPTIONS


@triton.jit
def _block_means_kernel(
    x_ptr,
    idx_ptr,
    table_ptr,
    lengths_ptr,
    starts_ptr,
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
    PAGE_SIZE: tl.constexpr,
    LENGTHS: tl.constexpr,
    ROW_STARTS: tl.constexpr,
):
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // heads
    if LENGTHS:
        seq_len = tl.load(lengths_ptr + i_b).to(tl.int32)  # a padded batch: this entry's own rows
    i_h = i_bh % heads
    i_hx = i_h // group  # input head of this output head (per-head GQA keys)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < dim
    first = i_t * BLOCK_SIZE
    p_out = out_ptr + (i_bh.to(tl.int64) * num_blocks + i_t) * dim + o_d
    if LENGTHS:
        if first >= seq_len:  # a padded block past this entry's rows: nothing to read
            tl.store(p_out, tl.zeros([BLOCK_D], dtype=tl.float32), mask=m_d)
            return
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    p_x = x_ptr + i_hx.to(tl.int64) * stride_xh
    if ROW_STARTS:
        p_x += tl.load(starts_ptr + i_b).to(tl.int64) * stride_xn  # a packed batch: this entry's first row
    elif PAGE_SIZE == 0:
        p_x += i_b.to(tl.int64) * stride_xb
    for r0 in range(0, BLOCK_SIZE, ROWS):
        o_r = first + r0 + tl.arange(0, ROWS)
        m_r = o_r < seq_len
        if GATHER:
            src = tl.load(idx_ptr + i_b.to(tl.int64) * stride_ib + i_h.to(tl.int64) * stride_ih + o_r, mask=m_r, other=0)
        else:
            src = o_r
        if PAGE_SIZE > 0:
            # A paged cache (batch 1): row t is row t % PAGE_SIZE of page table[t // PAGE_SIZE].
            page = tl.load(table_ptr + src // PAGE_SIZE, mask=m_r, other=0)
            row_offset = page.to(tl.int64) * stride_xb + (src % PAGE_SIZE).to(tl.int64) * stride_xn
        else:
            row_offset = src.to(tl.int64) * stride_xn
        rows = tl.load(p_x + row_offset[:, None] + o_d[None, :], mask=m_r[:, None] & m_d[None, :], other=0.0)
        acc += tl.sum(rows.to(tl.float32), 0)
    count = tl.minimum(seq_len - first, BLOCK_SIZE)
    tl.store(p_out, tl.where(count > 0, acc / tl.maximum(count, 1), 0.0), mask=m_d)


def block_means(x: torch.Tensor, block_size: int, indices: torch.Tensor | None = None, *,
                block_table: torch.Tensor | None = None, seq_len: int | None = None,
                lengths: torch.Tensor | None = None, row_starts: torch.Tensor | None = None,
                padded_rows: int | None = None) -> torch.Tensor:
    """Mean of every ``block_size`` rows (a partial last block averages what it has), in fp32.

    Args:
        x: ``(B, Hx, N, D)`` (unit stride along D).
        block_size: rows per block.
        indices: optional ``(B, H, N)`` int64 permutation with ``H % Hx == 0``: row ``t`` of output
            head ``h`` is ``x[b, h * Hx // H, indices[b, h, t]]``. None reads ``x`` as it is.
        block_table: ``(max_pages,)`` int32: ``x`` is then a paged cache
            ``(num_pages, page_size, Hx, D)`` read in place (row ``t`` at row ``t % page_size`` of
            page ``block_table[t // page_size]``), holding one sequence (``B = 1``) of ``seq_len``
            rows.
        seq_len: the rows of a paged ``x`` (only with ``block_table``).
        lengths: ``(B,)`` integer rows of each batch entry, on the device: ``x`` is then a padded
            batch (`pbs.serving.ragged`) whose entry ``b`` averages only its first ``lengths[b]``
            rows (its partial last block what it has, blocks past it 0). No host read.
        row_starts: ``(B + 1,)`` int32 on the device, with ``lengths`` and ``padded_rows``: ``x`` is
            then the packed ``(T, Hx, D)`` batch read in place, entry ``b`` from row
            ``row_starts[b]`` (``cu_seq``), and the result is that of the padded batch of
            ``padded_rows`` rows per entry, with no padded copy made.

    Returns:
        ``(B, H, ceil(N / block_size), D)`` float32 (``H = Hx`` without ``indices``).
    """
    page_size, table = 0, None
    if block_table is not None:
        if seq_len is None:
            raise ValueError("block_means of a paged cache needs seq_len, the sequence's rows")
        page_size, table = x.shape[1], block_table
        x = x.permute(0, 2, 1, 3)  # (num_pages, Hx, page_size, D): strides (page, head, row)
        b, hx, n, d = 1, x.shape[1], seq_len, x.shape[3]
    elif row_starts is not None:
        if lengths is None or padded_rows is None:
            raise ValueError("block_means of a packed batch (row_starts) needs lengths and padded_rows")
        x = x.transpose(0, 1)[None]  # (1, Hx, T, D): the row stride is the token's
        b, hx, n, d = lengths.shape[0], x.shape[1], padded_rows, x.shape[3]
    else:
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
        x, idx, out if table is None else table, lengths if lengths is not None else out,
        row_starts if row_starts is not None else out, out,
        x.stride(0), x.stride(1), x.stride(2),
        idx.stride(0) if indices is not None else 0, idx.stride(1) if indices is not None else 0,
        heads, heads // hx, n, d, num_blocks,
        BLOCK_SIZE=block_size, ROWS=rows, BLOCK_D=block_d, GATHER=indices is not None, PAGE_SIZE=page_size,
        LENGTHS=lengths is not None, ROW_STARTS=row_starts is not None, num_warps=4,
        **COMPILE_OPTIONS,
    )
    return out
