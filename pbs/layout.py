"""Where every query and key slot sits: block and segment geometry of one attention call.

A `Layout` is the shape-only description that the permuters, selectors, masks and kernels
share. It knows nothing about values, only about positions:

* keys occupy original positions ``0 .. Nk-1``; queries are the *last* ``Nq`` positions
  (``Nk - Nq .. Nk-1``), which covers both prefill (``Nq == Nk``) and a chunk that continues a
  cached prefix (``Nq < Nk``);
* the first ``floor(Nk / S) * S`` positions form full segments of ``S`` tokens; a permutation may
  reorder tokens only inside one full segment (queries: only inside a full segment that lies wholly
  in the query range), so a slot's *effective* position range is its whole segment when it may have
  been permuted and the exact position otherwise;
* blocks are ``block_size`` slots wide; ``S % block_size == 0`` so a key block never straddles two
  segments. The last ``Nk mod S`` positions form a partial segment whose tokens never move.

From those effective ranges follow, with no knowledge of the actual permutation, the block sets that
the rest of the library uses: *allowed* blocks (not wholly in the future), *diagonal* blocks (the
blocks of the query block's own segment(s), the partial last segment included: they may hold a
future token, so they are always computed) and the *candidates* a selector scores (the paper's
Algorithm 2 leaves the on-diagonal segments out of the pooled softmax and the threshold, since they
are computed anyway). One more rule says which selected blocks need the per-token causal check:
`Layout.first_masked_blocks`, the first key block per query block that may hold a future (or
padded) key; a `pbs.types.BlockMask` stores the resulting split of each list (``full_counts``)
and every attention backend reads it from there. The blocks it masks are diagonal ones, plus the
partial last key block.

``segmented=False`` describes attention with no segmented permutation at all (the paper's
unpermuted MeanPooling and XAttention baselines): the geometry is that of one-block segments, so
only the block on the diagonal is forced, and the candidates are all allowed blocks, the diagonal
block included, as in a plain causal block softmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


@dataclass(frozen=True)
class Layout:
    """Shape-only geometry of one attention call.

    Attributes:
        batch: ``B``.
        heads_q: query heads ``Hq``.
        heads_kv: key/value heads ``Hkv`` of the inputs (``Hq % Hkv == 0``).
        seq_len_q: ``Nq``, the number of queries (the last ``Nq`` positions).
        seq_len_k: ``Nk``, the number of keys (``Nq <= Nk``).
        block_size: tokens per block ``B``.
        segment_size: tokens per permutation segment ``S`` (a multiple of ``block_size``).
        causal: whether query position ``p`` may only see key positions ``<= p``.
        segmented: whether segmented permutation applies (see the module docstring); when False,
            ``segment_size`` must equal ``block_size``.
    """

    batch: int
    heads_q: int
    heads_kv: int
    seq_len_q: int
    seq_len_k: int
    block_size: int
    segment_size: int
    causal: bool = True
    segmented: bool = True

    def __post_init__(self) -> None:
        if not self.segmented and self.segment_size != self.block_size:
            raise ValueError(
                f"an unsegmented Layout has one-block segments: segment_size ({self.segment_size}) "
                f"must equal block_size ({self.block_size})"
            )

    @property
    def query_offset(self) -> int:
        """Original position of query slot 0 (``Nk - Nq``)."""
        return self.seq_len_k - self.seq_len_q

    @property
    def group_size(self) -> int:
        """Query heads per key/value head."""
        return self.heads_q // self.heads_kv

    @property
    def num_query_blocks(self) -> int:
        """``Tq = ceil(Nq / block_size)``."""
        return cdiv(self.seq_len_q, self.block_size)

    @property
    def num_key_blocks(self) -> int:
        """``Tk = ceil(Nk / block_size)``."""
        return cdiv(self.seq_len_k, self.block_size)

    @property
    def num_full_segments(self) -> int:
        """``G = floor(Nk / S)``: segments in which tokens may be permuted."""
        return self.seq_len_k // self.segment_size

    @property
    def permutable_key_len(self) -> int:
        """Keys at positions below this (``G * S``) may be permuted; the rest never move."""
        return self.num_full_segments * self.segment_size

    @property
    def permutable_query_range(self) -> tuple[int, int]:
        """Slot range ``[lo, hi)`` of queries that lies in full segments wholly inside the query range."""
        s = self.segment_size
        first_pos = cdiv(self.query_offset, s) * s
        end_pos = self.permutable_key_len
        if end_pos <= first_pos:
            return (0, 0)
        return (first_pos - self.query_offset, end_pos - self.query_offset)

    # -- effective position ranges -------------------------------------------------------------
    def _effective_ranges(self, positions: torch.Tensor, permutable: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.segment_size
        seg_lo = (positions // s) * s
        lo = torch.where(permutable, seg_lo, positions)
        hi = torch.where(permutable, seg_lo + s - 1, positions)
        return lo, hi

    def key_block_ranges(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Smallest and largest original key position any permutation can put in each key block.

        Returns:
            ``(lo, hi)``, each ``(Tk,)`` int64.
        """
        pos = torch.arange(self.seq_len_k, device=device)
        lo, hi = self._effective_ranges(pos, pos < self.permutable_key_len)
        return _block_reduce(lo, self.block_size, "amin"), _block_reduce(hi, self.block_size, "amax")

    def query_block_ranges(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Smallest and largest original query position any permutation can put in each query block.

        Returns:
            ``(lo, hi)``, each ``(Tq,)`` int64.
        """
        slots = torch.arange(self.seq_len_q, device=device)
        a, b = self.permutable_query_range
        lo, hi = self._effective_ranges(slots + self.query_offset, (slots >= a) & (slots < b))
        return _block_reduce(lo, self.block_size, "amin"), _block_reduce(hi, self.block_size, "amax")

    # -- block sets ----------------------------------------------------------------------------
    def allowed_blocks(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Key blocks not wholly in the future of a query block: ``(Tq, Tk)`` bool."""
        tq, tk = self.num_query_blocks, self.num_key_blocks
        if not self.causal:
            return torch.ones(tq, tk, dtype=torch.bool, device=device)
        k_lo, _ = self.key_block_ranges(device)
        _, q_hi = self.query_block_ranges(device)
        return k_lo[None, :] <= q_hi[:, None]

    def diagonal_blocks(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Allowed key blocks of the query block's own segment(s): ``(Tq, Tk)`` bool.

        These are the on-diagonal segment blocks of the paper: they may hold a future token, and
        selection always computes them. The partial last segment (the last ``Nk mod S`` keys)
        counts as a segment, as in the paper's code. Which of them get the per-token causal check
        is `first_masked_blocks`' rule (in the partial last segment, only the blocks from the
        query block's own on).
        """
        s, bs = self.segment_size, self.block_size
        key_segment = torch.arange(self.num_key_blocks, device=device) * bs // s
        first_slot = torch.arange(self.num_query_blocks, device=device) * bs
        last_slot = (first_slot + bs).clamp(max=self.seq_len_q) - 1
        q_first = (first_slot + self.query_offset) // s
        q_last = (last_slot + self.query_offset) // s
        same = (key_segment[None, :] >= q_first[:, None]) & (key_segment[None, :] <= q_last[:, None])
        return same & self.allowed_blocks(device)

    def first_masked_blocks(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Per query block, the first key block that needs a per-token check: ``(Tq,)`` int64.

        The one masking rule of the library. Key blocks below it are *full*: their effective
        position ranges end before the query block's begins, so every key is in the past of every
        query the block can hold, whatever the permutation. From it on a block may hold a future
        key (the on-diagonal segment) or, for the partial last key block (``Nk`` not a multiple of
        the block size), padded slots past ``Nk``, which the per-token check drops. Without
        causality only that partial block needs it. `pbs.types.full_block_counts` turns it into
        `BlockMask.full_counts`, which every attention backend reads instead of working the split
        out again. All on ``device``, no host sync.
        """
        tk = self.num_key_blocks
        partial = tk - 1 if self.seq_len_k % self.block_size else None
        if self.causal:
            _, k_hi = self.key_block_ranges(device)
            q_lo, _ = self.query_block_ranges(device)
            return first_masked_key_blocks(k_hi, q_lo, partial)
        first = torch.full((self.num_query_blocks,), tk, dtype=torch.int64, device=device)
        return first if partial is None else first.clamp(max=partial)

    def candidate_blocks(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Blocks a score-based selector ranks: ``(Tq, Tk)`` bool (Algorithm 2's causal mask ``C``).

        With segmented permutation: the allowed blocks minus the on-diagonal segment blocks, which
        are computed anyway. Without (``segmented=False``): every allowed block.
        """
        allowed = self.allowed_blocks(device)
        return allowed & ~self.diagonal_blocks(device) if self.segmented else allowed

    def allowed_counts(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Number of allowed key blocks per query block: ``(Tq,)`` int64."""
        return self.allowed_blocks(device).sum(-1)

    @property
    def total_allowed_blocks(self) -> int:
        """Allowed (query block, key block) pairs of one head: the denominator of density.

        Cached per geometry: every call builds a new Layout, and building the ``(Tq, Tk)`` set on
        the CPU costs about a millisecond at 128K, which the dense-fallback check would pay per call.
        """
        return _total_allowed_blocks(
            self.seq_len_q, self.seq_len_k, self.block_size, self.segment_size, self.causal
        )


def first_masked_key_blocks(key_hi: torch.Tensor, query_lo: torch.Tensor,
                            partial_block: int | torch.Tensor | None) -> torch.Tensor:
    """The causal masking rule of `Layout.first_masked_blocks`, from block position ranges.

    Key blocks whose last effective position precedes the query block's first are full (``key_hi``
    grows with the block index, so they are a prefix); from the first other one on, the per-token
    check runs, and from a partial last key block on at the latest.

    Args:
        key_hi: ``(..., Tk)`` last effective key position of each key block (blocks past the keys:
            any value at least every ``query_lo``).
        query_lo: ``(..., Tq)`` first effective query position of each query block.
        partial_block: the index of a partial last key block (an int, or ``(...,)`` per batch
            entry for a padded batch of sequences, `pbs.serving.ragged`), or None.

    Returns:
        ``(..., Tq)`` int64.
    """
    first = (key_hi[..., None, :] < query_lo[..., :, None]).sum(-1)
    if partial_block is None:
        return first
    if isinstance(partial_block, int):
        return first.clamp(max=partial_block)
    return torch.minimum(first, partial_block[..., None])


@lru_cache(maxsize=1024)
def _total_allowed_blocks(seq_len_q: int, seq_len_k: int, block_size: int, segment_size: int, causal: bool) -> int:
    layout = Layout(1, 1, 1, seq_len_q, seq_len_k, block_size, segment_size, causal)
    return int(layout.allowed_blocks().sum())


def _block_reduce(values: torch.Tensor, block_size: int, how: str) -> torch.Tensor:
    n = values.shape[-1]
    pad = cdiv(n, block_size) * block_size - n
    if pad:
        fill = values[-1:].expand(pad)
        values = torch.cat([values, fill])
    blocks = values.view(-1, block_size)
    return blocks.amin(-1) if how == "amin" else blocks.amax(-1)
