"""A batch of sequences padded to fixed maxima, with their lengths on the device.

The capturable varlen path (`pbs.serving.capturable`) pads every sequence of a packed or paged
batch to ``(max_q, max_k)`` rows, rounded up to whole blocks, so that every launch has a shape fixed
by the maxima alone and a CUDA graph captured at those maxima replays at any lengths below them.
The lengths stay on the device: `RaggedGeometry` turns them into the block sets that `pbs.Layout`
gives a single sequence (allowed, diagonal, first masked block), batched over sequences, and every
stage reads them from there. Nothing here reads a tensor on the host.

Sequence ``i`` keeps its own block grid: its query slot ``t`` is row ``t`` of its padded queries
(original position ``len_k[i] - len_q[i] + t``) and its key ``t`` is row ``t`` of its padded keys,
so query block ``a`` and key block ``b`` hold the tokens they hold when the sequence runs alone.
Only the unpermuted layout is described (`PBSConfig.permuter` ``"none"``, one-block segments).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from pbs.layout import Layout, cdiv, first_masked_key_blocks


@dataclass(frozen=True, eq=False)
class RaggedGeometry:
    """Block geometry of ``N`` causal sequences padded to ``Tq`` query and ``Tk`` key blocks.

    Attributes:
        len_q: ``(N,)`` int64 query lengths, on the device.
        len_k: ``(N,)`` int64 key lengths, ``len_q <= len_k``.
        num_query_blocks: ``Tq``, blocks of the padded queries (``ceil(max_q / block_size)``).
        num_key_blocks: ``Tk``, blocks of the padded keys.
        block_size: tokens per block.
    """

    len_q: torch.Tensor
    len_k: torch.Tensor
    num_query_blocks: int
    num_key_blocks: int
    block_size: int

    @property
    def batch(self) -> int:
        return self.len_q.shape[0]

    @property
    def device(self) -> torch.device:
        return self.len_q.device

    @property
    def padded_len_q(self) -> int:
        """Rows of the padded queries, ``Tq * block_size``."""
        return self.num_query_blocks * self.block_size

    @property
    def padded_len_k(self) -> int:
        """Rows of the padded keys, ``Tk * block_size``."""
        return self.num_key_blocks * self.block_size

    @cached_property
    def query_offset(self) -> torch.Tensor:
        """``(N,)`` original position of each sequence's query slot 0 (``len_k - len_q``)."""
        return self.len_k - self.len_q

    def query_positions(self) -> torch.Tensor:
        """``(N, Tq * block_size)`` int32 original position of every padded query slot (slots past a
        sequence's queries continue the count; their rows are dropped)."""
        slots = torch.arange(self.padded_len_q, device=self.device)
        return (slots[None, :] + self.query_offset[:, None]).to(torch.int32)

    @cached_property
    def query_blocks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(lo, hi, valid)``, each ``(N, Tq)``: smallest and largest original position of each
        query block's real queries, and whether it holds any."""
        first = torch.arange(self.num_query_blocks, device=self.device) * self.block_size
        valid = first[None, :] < self.len_q[:, None]
        last_slot = torch.minimum(first[None, :] + self.block_size, self.len_q[:, None]) - 1
        offset = self.query_offset[:, None]
        return offset + first[None, :], offset + last_slot, valid

    @cached_property
    def key_blocks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(lo, hi, valid)``, each ``(N, Tk)``: first and last key position of each key block,
        and whether it holds any key."""
        first = torch.arange(self.num_key_blocks, device=self.device) * self.block_size
        valid = first[None, :] < self.len_k[:, None]
        hi = torch.minimum(first[None, :] + self.block_size, self.len_k[:, None]) - 1
        return first[None, :].expand_as(hi), hi, valid

    @cached_property
    def allowed(self) -> torch.Tensor:
        """``(N, Tq, Tk)`` bool: key blocks not wholly in the future of a query block, both real
        (`pbs.Layout.allowed_blocks` per sequence, zero outside its own grid)."""
        q_lo, q_hi, q_valid = self.query_blocks
        k_lo, _, k_valid = self.key_blocks
        return q_valid[:, :, None] & k_valid[:, None, :] & (k_lo[:, None, :] <= q_hi[:, :, None])

    @cached_property
    def diagonal(self) -> torch.Tensor:
        """``(N, Tq, Tk)`` bool: the allowed key blocks the query block's positions fall in
        (`pbs.Layout.diagonal_blocks` with one-block segments)."""
        q_lo, q_hi, _ = self.query_blocks
        block = torch.arange(self.num_key_blocks, device=self.device)
        first, last = q_lo // self.block_size, q_hi // self.block_size
        same = (block[None, None, :] >= first[:, :, None]) & (block[None, None, :] <= last[:, :, None])
        return same & self.allowed

    def forced(self, force_sink_block: bool) -> torch.Tensor:
        """``(N, Tq, Tk)`` bool: the blocks every selection keeps (the diagonal, and the sink block 0)."""
        if not force_sink_block:
            return self.diagonal
        # A comparison, not ``sink[0] = True``: writing a Python scalar is a host-to-device copy,
        # which a capture refuses.
        sink = torch.arange(self.num_key_blocks, device=self.device) == 0
        return self.diagonal | (self.allowed & sink)

    def layout(self, heads_q: int, heads_kv: int) -> Layout:
        """The `pbs.Layout` of the padded batch (shapes only; the block sets come from here)."""
        return Layout(self.batch, heads_q, heads_kv, self.padded_len_q, self.padded_len_k, self.block_size,
                      self.block_size, causal=True, segmented=False)

    def full_counts(self, counts: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """`pbs.BlockMask.full_counts` of lists ``indices (N, Hq, Tq, Tk)`` with ``counts``: the
        leading entries before each query block's first masked key block (the one rule,
        `pbs.layout.first_masked_key_blocks`, per sequence; the ``-1`` padding is below it too
        and is taken off again)."""
        q_lo, _, _ = self.query_blocks
        _, k_hi, k_valid = self.key_blocks
        past_the_keys = torch.where(k_valid, k_hi, torch.iinfo(torch.int64).max)
        key_blocks = (self.len_k + self.block_size - 1) // self.block_size
        partial = torch.where(self.len_k % self.block_size != 0, key_blocks - 1, self.num_key_blocks)
        first = first_masked_key_blocks(past_the_keys, q_lo, partial).to(indices.dtype)[:, None, :, None]
        below = (indices < first).sum(-1, dtype=torch.int32)
        return below - (indices.shape[-1] - counts.to(torch.int32))


def ragged_geometry(len_q: torch.Tensor, len_k: torch.Tensor, max_q: int, max_k: int, block_size: int) -> RaggedGeometry:
    """The geometry of sequences of ``len_q``/``len_k`` tokens padded to ``max_q``/``max_k``."""
    return RaggedGeometry(len_q.long(), len_k.long(), cdiv(max(max_q, 1), block_size), cdiv(max(max_k, 1), block_size),
                          block_size)


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
