"""Padding a packed or paged batch into token-major buffers: the eager twin of `pbs.kernels.pad_rows`.

Both functions return the ``(N, H, rows, D)`` view of a token-major ``(N, rows, H, D)`` buffer
(the layout of a packed tensor itself, so that padding and unpadding copy whole token rows), with
zeros past each sequence's length. Shapes depend on ``N``, ``rows`` and the inputs' shapes only,
and no tensor is read on the host, so a CUDA graph can capture either.
"""

from __future__ import annotations

import torch


def pad_packed(x: torch.Tensor, cu_seq: torch.Tensor, rows: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Sequences of packed ``x (T, H, D)`` as ``(N, H, rows, D)``, zeros past each length.

    Sequence ``i`` is ``x[cu_seq[i] : cu_seq[i + 1]]``; each token row is copied to its slot
    (`flat_slots`, worked out on the device). The caller guarantees ``cu_seq[0] = 0``,
    ``cu_seq[N] = T`` and lengths of at most ``rows``: a longer sequence is not cut cleanly (its
    extra rows land on its last slot).

    Args:
        x: ``(T, H, D)``.
        cu_seq: ``(N + 1,)`` int32 or int64 sequence boundaries.
        rows: the padded length of every sequence.
        out: an optional token-major ``(N, rows, H, D)`` buffer to write (every element is written).

    Returns:
        ``(N, H, rows, D)``, a view of ``out`` (or of a new buffer).
    """
    n = cu_seq.shape[0] - 1
    tokens = padded_buffer(x, n, rows, out)
    tokens.zero_()
    if x.shape[0] > 0:
        tokens.view(n * rows, *x.shape[1:]).index_copy_(0, flat_slots(cu_seq, x.shape[0], rows), x)
    return tokens.transpose(1, 2)


def pad_paged(cache: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor, rows: int, *,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Sequences of a paged cache as ``(N, H, rows, D)``, zeros past each length.

    Key ``t`` of sequence ``i`` is row ``t % page_size`` of page ``block_table[i, t // page_size]``;
    rows past ``lengths[i]`` are zeros and read no page entry. A length past the table's last page
    reads that page again: the caller bounds the lengths.

    Args:
        cache: ``(num_pages, page_size, H, D)``.
        block_table: ``(N, max_pages)`` int32 or int64 page numbers.
        lengths: ``(N,)`` key lengths.
        rows: the padded length of every sequence.
        out: an optional token-major ``(N, rows, H, D)`` buffer to write (every element is written).

    Returns:
        ``(N, H, rows, D)``, a view of ``out`` (or of a new buffer).
    """
    n, max_pages = block_table.shape
    page_size = cache.shape[1]
    if out is not None:
        padded_buffer(cache, n, rows, out)
    if max_pages == 0:
        return padded_buffer(cache, n, rows, out).zero_().transpose(1, 2)
    slot = torch.arange(rows, device=cache.device)
    valid = slot[None, :] < lengths[:, None]
    page_slot = (slot // page_size).clamp(max=max_pages - 1)
    pages = block_table.long().gather(1, page_slot[None, :].expand(n, rows))
    pages = torch.where(valid, pages, 0)
    gathered = cache[pages, (slot % page_size)[None, :].expand(n, rows)]  # (N, rows, H, D)
    padded = torch.where(valid[:, :, None, None], gathered, 0)
    return (padded if out is None else out.copy_(padded)).transpose(1, 2)


def padded_buffer(x: torch.Tensor, n: int, rows: int, out: torch.Tensor | None) -> torch.Tensor:
    """``out`` checked as the token-major ``(n, rows, H, D)`` buffer of ``x (..., H, D)``'s rows, or
    a new (unwritten) one; raises a ``ValueError`` naming what of ``out`` does not fit."""
    shape = (n, rows, *x.shape[-2:])
    if out is None:
        return torch.empty(shape, dtype=x.dtype, device=x.device)
    if tuple(out.shape) != shape or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {x.dtype} tensor of shape {shape} on {x.device} "
                         f"(token-major: N, rows, H, D); got {out.dtype} {tuple(out.shape)} on {out.device}"
                         f"{'' if out.is_contiguous() else ', not contiguous'}")
    return out


def flat_slots(cu_seq: torch.Tensor, total: int, rows: int) -> torch.Tensor:
    """``(total,)`` int64: each packed token's row in a token-major ``(N * rows, ...)`` buffer."""
    sequence, row = sequence_slots(cu_seq, total, rows)
    return sequence * rows + row


def sequence_slots(cu_seq: torch.Tensor, total: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sequence, row)`` of each of the ``total`` packed tokens, ``(total,)`` int64 each: token
    ``t`` is row ``t - cu_seq[i]`` of the sequence ``i`` whose range holds it (rows clamped to
    ``rows - 1``)."""
    token = torch.arange(total, device=cu_seq.device)
    bounds = cu_seq.long()
    sequence = torch.searchsorted(bounds[1:], token, right=True).clamp(max=bounds.shape[0] - 2)
    return sequence, (token - bounds[sequence]).clamp(0, rows - 1)
