"""Padding a packed or paged batch into token-major buffers in one launch per tensor: the fast
twin of `pbs.reference.pad_rows`.

The eager twin zero-fills the buffer and then scatters the tokens into it (two passes over the
padded rows, the scatter writing through an index per row). Here every program owns a tile of
slots of one sequence and writes each slot exactly once: the token row it holds, loaded from the
packed tensor or through the block table, or zeros past the sequence's length. Reads are gathers
of whole token rows (``H * D`` contiguous elements), writes are contiguous. Lengths are read on
the device, so a CUDA graph can capture the launch and replay it with new lengths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pbs.reference.pad_rows import padded_buffer
from pbs.kernels._common import COMPILE_OPTIONS


@triton.jit
def _pad_rows_kernel(
    x_ptr,
    out_ptr,
    cu_seq_ptr,
    table_ptr,
    lengths_ptr,
    stride_xn,
    stride_xp,
    stride_cu,
    stride_tn,
    stride_tp,
    stride_len,
    rows,
    row_tiles,
    row_elements,
    page_size,
    max_pages,
    PAGED: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # One program per (row tile, sequence), folded into axis 0 so that no grid axis limits N.
    i_pid = tl.program_id(0)
    i_n = i_pid // row_tiles
    i_t = i_pid % row_tiles
    o_slot = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    m_slot = o_slot < rows
    if PAGED:
        length = tl.load(lengths_ptr + i_n.to(tl.int64) * stride_len).to(tl.int32)
        # A page slot past the table reads its last entry, as the eager twin does; an empty table
        # has none to read, so every slot is padding.
        length = tl.where(max_pages > 0, length, 0)
        o_page = tl.minimum(o_slot // page_size, max_pages - 1)
        m_row = m_slot & (o_slot < length)
        b_page = tl.load(table_ptr + i_n.to(tl.int64) * stride_tn + o_page * stride_tp, mask=m_row, other=0)
        o_src = b_page.to(tl.int64) * stride_xp + (o_slot % page_size).to(tl.int64) * stride_xn
    else:
        start = tl.load(cu_seq_ptr + i_n.to(tl.int64) * stride_cu).to(tl.int64)
        length = (tl.load(cu_seq_ptr + (i_n + 1).to(tl.int64) * stride_cu).to(tl.int64) - start).to(tl.int32)
        m_row = m_slot & (o_slot < length)
        o_src = (start + o_slot.to(tl.int64)) * stride_xn
    o_dst = (i_n.to(tl.int64) * rows + o_slot.to(tl.int64)) * row_elements
    for c in range(0, row_elements, BLOCK_C):
        o_col = c + tl.arange(0, BLOCK_C)
        m_col = o_col < row_elements
        b_x = tl.load(x_ptr + o_src[:, None] + o_col[None, :], mask=m_row[:, None] & m_col[None, :], other=0)
        tl.store(out_ptr + o_dst[:, None] + o_col[None, :], b_x, mask=m_slot[:, None] & m_col[None, :])


def rows_are_contiguous(x: torch.Tensor) -> bool:
    """Whether each token row of ``x (..., H, D)`` is ``H * D`` contiguous elements, whatever the
    strides of the dims before them (what the kernel reads)."""
    h, d = x.shape[-2:]
    return (x.stride(-1) == 1 or d == 1) and (x.stride(-2) == d or h == 1)


def pad_packed(x: torch.Tensor, cu_seq: torch.Tensor, rows: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Sequences of packed ``x (T, H, D)`` as ``(N, H, rows, D)``, zeros past each length, in one launch.

    Sequence ``i`` is ``x[cu_seq[i] : cu_seq[i + 1]]``, read on the device; the caller guarantees
    ``cu_seq[0] = 0``, ``cu_seq[N] = T`` and lengths of at most ``rows`` (a longer sequence keeps
    its first ``rows`` tokens).

    Args:
        x: ``(T, H, D)`` whose token rows are contiguous (any stride along ``T``; `rows_are_contiguous`).
        cu_seq: ``(N + 1,)`` int32 or int64 sequence boundaries.
        rows: the padded length of every sequence.
        out: an optional token-major ``(N, rows, H, D)`` buffer to write (every element is written).

    Returns:
        ``(N, H, rows, D)``, a view of ``out`` (or of a new buffer).
    """
    _check_rows("x", x, "(T, H, D)")
    tokens = padded_buffer(x, cu_seq.shape[0] - 1, rows, out)
    _launch(x, tokens, rows, cu_seq=cu_seq, stride_xn=x.stride(0))
    return tokens.transpose(1, 2)


def pad_paged(cache: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor, rows: int, *,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Sequences of a paged cache as ``(N, H, rows, D)``, zeros past each length, in one launch.

    Key ``t`` of sequence ``i`` is row ``t % page_size`` of page ``block_table[i, t // page_size]``;
    rows past ``lengths[i]`` are zeros and read no page entry. A length past the table's last page
    reads that page again, as the eager twin does: the caller bounds the lengths.

    Args:
        cache: ``(num_pages, page_size, H, D)`` whose token rows are contiguous (any page and row
            strides; `rows_are_contiguous`).
        block_table: ``(N, max_pages)`` int32 or int64 page numbers.
        lengths: ``(N,)`` key lengths, int32 or int64.
        rows: the padded length of every sequence.
        out: an optional token-major ``(N, rows, H, D)`` buffer to write (every element is written).

    Returns:
        ``(N, H, rows, D)``, a view of ``out`` (or of a new buffer).
    """
    _check_rows("cache", cache, "(num_pages, page_size, H, D)")
    n, max_pages = block_table.shape
    if lengths.shape != (n,):
        raise ValueError(f"lengths must have shape (N,) = ({n},) to match block_table {tuple(block_table.shape)}; "
                         f"got {tuple(lengths.shape)}")
    tokens = padded_buffer(cache, n, rows, out)
    _launch(cache, tokens, rows, block_table=block_table, lengths=lengths, stride_xn=cache.stride(1),
            stride_xp=cache.stride(0), page_size=cache.shape[1], max_pages=max_pages)
    return tokens.transpose(1, 2)


def _check_rows(name: str, x: torch.Tensor, shape: str) -> None:
    if x.dim() != shape.count(",") + 1:
        raise ValueError(f"{name} must be {shape}; got shape {tuple(x.shape)}")
    if not rows_are_contiguous(x):
        raise ValueError(f"{name} must have contiguous token rows (stride 1 along D and D along H); got strides "
                         f"{tuple(x.stride())} for shape {tuple(x.shape)}: pass {name}.contiguous(), or pad with "
                         "pbs.reference.pad_rows")


def _launch(x: torch.Tensor, tokens: torch.Tensor, rows: int, *, stride_xn: int, cu_seq: torch.Tensor | None = None,
            block_table: torch.Tensor | None = None, lengths: torch.Tensor | None = None, stride_xp: int = 0,
            page_size: int = 1, max_pages: int = 0) -> None:
    n = tokens.shape[0]
    row_elements = tokens.shape[2] * tokens.shape[3]
    if n == 0 or rows == 0 or row_elements == 0:
        return
    block_c = min(triton.next_power_of_2(row_elements), 2048)
    # About 8K elements per program: enough bytes in flight per SM to stream at HBM speed, while
    # sequences of a few rows still leave most of a tile to other programs.
    block_t = max(1, 8192 // block_c)
    row_tiles = triton.cdiv(rows, block_t)
    dummy = tokens  # a pointer for the arguments the other mode never reads
    _pad_rows_kernel[(n * row_tiles,)](
        x, tokens,
        cu_seq if cu_seq is not None else dummy,
        block_table if block_table is not None else dummy,
        lengths if lengths is not None else dummy,
        stride_xn, stride_xp,
        cu_seq.stride(0) if cu_seq is not None else 0,
        block_table.stride(0) if block_table is not None else 0,
        block_table.stride(1) if block_table is not None else 0,
        lengths.stride(0) if lengths is not None else 0,
        rows, row_tiles, row_elements, page_size, max_pages,
        PAGED=block_table is not None, BLOCK_T=block_t, BLOCK_C=block_c,
        num_warps=4,
        **COMPILE_OPTIONS,
    )
