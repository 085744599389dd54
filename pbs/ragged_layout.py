"""The block geometry of a batch of sequences padded to fixed maxima, with their lengths on the
device: the batched form of `pbs.Layout`.

A padded batch (`pbs.serving.ragged` pads the packed or paged sequences of `pbs.varlen_attention`
with ``capturable=True``) has launch shapes fixed by the maxima alone, so that a CUDA graph captured
at those maxima replays at any lengths below them. `RaggedGeometry` turns the device lengths into
the block sets that `pbs.Layout` gives a single sequence (allowed, diagonal, first masked block),
batched over sequences; nothing here reads a tensor on the host.

Sequence ``i`` keeps its own block grid: its query slot ``t`` is row ``t`` of its padded queries
(original position ``len_k[i] - len_q[i] + t``) and its key ``t`` is row ``t`` of its padded keys,
so query block ``a`` and key block ``b`` hold the tokens they hold when the sequence runs alone.
Only the unpermuted layout is described (one-block segments).
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

    @cached_property
    def mask_starts(self) -> torch.Tensor:
        """``(N, Tq)`` int64: each query block's first key block that needs the per-token mask
        (the one rule, `pbs.layout.first_masked_key_blocks`, per sequence); the blocks before it
        lie wholly in the block's past."""
        q_lo, _, _ = self.query_blocks
        _, k_hi, k_valid = self.key_blocks
        past_the_keys = torch.where(k_valid, k_hi, torch.iinfo(torch.int64).max)
        key_blocks = (self.len_k + self.block_size - 1) // self.block_size
        partial = torch.where(self.len_k % self.block_size != 0, key_blocks - 1, self.num_key_blocks)
        return first_masked_key_blocks(past_the_keys, q_lo, partial)

    @cached_property
    def allowed_counts(self) -> torch.Tensor:
        """``(N, Tq)`` int32: allowed key blocks per query block; they are its first ones
        (blocks ``0 .. count - 1``: causal rows are prefixes)."""
        return self.allowed.sum(-1, dtype=torch.int32)

    def full_counts(self, counts: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """`pbs.BlockMask.full_counts` of lists ``indices (N, Hq, Tq, Tk)`` with ``counts``: the
        leading entries before each query block's first masked key block (`mask_starts`; the
        ``-1`` padding is below it too and is taken off again)."""
        first = self.mask_starts.to(indices.dtype)[:, None, :, None]
        below = (indices < first).sum(-1, dtype=torch.int32)
        return below - (indices.shape[-1] - counts.to(torch.int32))

    def every_allowed_block(self, index_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The lists of dense attention, ``(counts (N, 1, Tq), indices (N, 1, Tq, Tk), full_counts
        (N, 1, Tq))``, to broadcast over the query heads: every allowed block of each row, ``-1``
        after them."""
        block = torch.arange(self.num_key_blocks, device=self.device)
        counts = self.allowed_counts
        indices = torch.where(block < counts[..., None], block, -1).to(index_dtype)
        full = torch.minimum(self.mask_starts, counts.long()).to(torch.int32)
        return counts[:, None], indices[:, None], full[:, None]


def ragged_geometry(len_q: torch.Tensor, len_k: torch.Tensor, max_q: int, max_k: int, block_size: int) -> RaggedGeometry:
    """The geometry of sequences of ``len_q``/``len_k`` tokens padded to ``max_q``/``max_k``."""
    return RaggedGeometry(len_q.long(), len_k.long(), cdiv(max(max_q, 1), block_size), cdiv(max(max_k, 1), block_size),
                          block_size)
