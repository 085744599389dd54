"""Padding a packed or paged batch to fixed maxima on the device, and back.

The capturable varlen path (`pbs.serving.capturable`) pads every sequence of a packed or paged
batch to ``(max_q, max_k)`` rows, rounded up to whole blocks, so that every launch has a shape fixed
by the maxima alone (`pbs.ragged_layout.RaggedGeometry` describes the padded grid). Nothing here
reads a tensor on the host.
"""

from __future__ import annotations

import torch


def pad_packed(x: torch.Tensor, cu_seq: torch.Tensor, rows: int) -> torch.Tensor:
    """Sequences of packed ``x (T, H, D)`` as ``(N, H, rows, D)``, zeros past each length.

    Sequence ``i`` is ``x[cu_seq[i] : cu_seq[i + 1]]``. The result is a view of a token-major
    ``(N, rows, H, D)`` buffer, the layout of the packed tensor itself, so padding is one copy of
    whole token rows to their slots (`sequence_slots`, worked out on the device: no host read) and
    the kernels read it as they read the packed strided views of the eager path. A sequence longer
    than ``rows`` is not cut cleanly (its extra rows land on its last slot): the caller bounds the
    lengths.
    """
    n = cu_seq.shape[0] - 1
    tokens = x.new_zeros(n * rows, x.shape[1], x.shape[2])
    if x.shape[0] > 0:
        tokens.index_copy_(0, flat_slots(cu_seq, x.shape[0], rows), x)
    return tokens.view(n, rows, x.shape[1], x.shape[2]).transpose(1, 2)


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


def pad_paged(cache: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor, rows: int) -> torch.Tensor:
    """Sequences of a paged cache ``(num_pages, page_size, H, D)`` as ``(N, H, rows, D)``.

    Key ``t`` of sequence ``i`` is row ``t % page_size`` of page ``block_table[i, t // page_size]``;
    rows past ``lengths[i]`` are zeros and read no page entry.
    """
    n, max_pages = block_table.shape
    page_size = cache.shape[1]
    slot = torch.arange(rows, device=cache.device)
    valid = slot[None, :] < lengths[:, None]
    page_slot = (slot // page_size).clamp(max=max(max_pages - 1, 0))
    if max_pages == 0:
        return cache.new_zeros(n, cache.shape[2], rows, cache.shape[3])
    pages = block_table.long().gather(1, page_slot[None, :].expand(n, rows))
    pages = torch.where(valid, pages, 0)
    gathered = cache[pages, (slot % page_size)[None, :].expand(n, rows)]  # (N, rows, H, D)
    gathered = torch.where(valid[:, :, None, None], gathered, 0)
    return gathered.transpose(1, 2)  # token-major, as pad_packed's


def unpad_rows(padded: torch.Tensor, cu_seq_q: torch.Tensor, total: int) -> torch.Tensor:
    """The packed rows of ``padded (N, H, rows, ...)``: ``(total, H, ...)``, token ``t`` of the
    packing taken from its slot (`sequence_slots`)."""
    sequence, row = sequence_slots(cu_seq_q, total, padded.shape[2])
    return padded.transpose(1, 2)[sequence, row]
