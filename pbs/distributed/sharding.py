"""The load-balanced (zigzag) split of one causal sequence over the ranks of a group.

A causal sequence cut into ``P`` contiguous pieces gives the last rank ``2P - 1`` times the work of
the first. Cut into ``2P`` chunks instead, rank ``r`` holding chunks ``r`` and ``2P - 1 - r`` (a
cheap early chunk with an expensive late one: torch's ``_HeadTailLoadBalancer``,
ring-flash-attention's zigzag), every rank has the same share of the causal triangle.

PBS adds one rule: a chunk boundary never cuts a permutation segment, so every chunk is a whole
number of segments (``segment_size`` tokens, a multiple of the block size) and permutation and
block geometry stay local to a rank:

* the ``G = N // S`` whole segments are dealt into ``2P`` chunks of ``G // (2P)`` segments;
* the ``G mod 2P`` segments left over go one per rank, from rank ``P - 1`` down to rank 0, to
  the ranks' early chunks first and then (more than ``P`` left over) to their late chunks, so
  ranks differ by at most one segment;
* the last ``N mod S`` tokens (a partial segment, never permuted) end the last chunk, held by
  rank 0, which is why rank 0 is the last to receive a leftover segment.

A sequence needs at least ``2P`` whole segments.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

DEFAULT_SEGMENT = 256


def chunk_bounds(seq_len: int, world_size: int, segment_size: int = DEFAULT_SEGMENT) -> list[tuple[int, int]]:
    """The ``2P`` chunks of the zigzag split, in sequence order: ``[(start, end), ...]``.

    Args:
        seq_len: ``N``, tokens of the whole sequence.
        world_size: ``P``, ranks the sequence is split over.
        segment_size: ``S``; chunk boundaries fall on multiples of it.

    Raises:
        ValueError: ``N`` holds fewer than ``2P`` whole segments.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if segment_size < 1:
        raise ValueError(f"segment_size must be at least 1, got {segment_size}")
    chunks = 2 * world_size
    segments = seq_len // segment_size
    if segments < chunks:
        raise ValueError(
            f"a sequence of {seq_len} tokens is too short to split over {world_size} ranks: the zigzag "
            f"split needs 2 x {world_size} chunks of at least one segment of {segment_size} tokens, "
            f"i.e. at least {chunks * segment_size} tokens (use fewer ranks, or one process below that)"
        )
    base, extra = divmod(segments, chunks)
    sizes = [base] * chunks
    for i in range(extra):
        rank = world_size - 1 - (i % world_size)
        sizes[rank if i < world_size else chunks - 1 - rank] += 1
    bounds, start = [], 0
    for c, size in enumerate(sizes):
        end = start + size * segment_size
        if c == chunks - 1:
            end = seq_len
        bounds.append((start, end))
        start = end
    return bounds


def rank_chunks(seq_len: int, rank: int, world_size: int, segment_size: int = DEFAULT_SEGMENT) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two chunks rank ``rank`` holds, ``((start, end), (start, end))``: chunk ``rank`` then
    chunk ``2P - 1 - rank``, the order of its shard."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
    bounds = chunk_bounds(seq_len, world_size, segment_size)
    return bounds[rank], bounds[2 * world_size - 1 - rank]


def shard_length(seq_len: int, rank: int, world_size: int, segment_size: int = DEFAULT_SEGMENT) -> int:
    """Tokens of rank ``rank``'s shard."""
    (a0, a1), (b0, b1) = rank_chunks(seq_len, rank, world_size, segment_size)
    return (a1 - a0) + (b1 - b0)


def shard_sequence(
    x: torch.Tensor, rank: int, world_size: int, dim: int = 2, segment_size: int = DEFAULT_SEGMENT
) -> torch.Tensor:
    """Rank ``rank``'s shard of the whole sequence ``x``: its two zigzag chunks along ``dim``, joined.

    Args:
        x: the whole sequence, e.g. ``(B, H, N, D)`` with ``dim=2``.
        rank, world_size: the rank and the group size ``P``.
        dim: the sequence axis.
        segment_size: the config's ``segment_size`` (default 256).

    Returns:
        ``x`` narrowed to chunk ``rank`` followed by chunk ``2P - 1 - rank`` (a new tensor).

    Example:
        ```python
        import torch
        from pbs.distributed import shard_sequence, unshard_sequence

        x = torch.arange(2048).view(1, 1, 2048, 1)
        shards = [shard_sequence(x, r, 2) for r in range(2)]
        assert shards[0].shape[2] == 1024  # chunks 0 and 3 of 512 tokens each
        assert torch.equal(unshard_sequence(shards), x)
        ```
    """
    (a0, a1), (b0, b1) = rank_chunks(x.shape[dim], rank, world_size, segment_size)
    return torch.cat([x.narrow(dim, a0, a1 - a0), x.narrow(dim, b0, b1 - b0)], dim=dim)


def unshard_sequence(
    shards: Sequence[torch.Tensor], dim: int = 2, segment_size: int = DEFAULT_SEGMENT
) -> torch.Tensor:
    """The whole sequence from every rank's shard (in rank order): the inverse of `shard_sequence`.

    Args:
        shards: ``P`` tensors, rank ``r``'s shard at index ``r`` (e.g. the outputs of
            `context_parallel_attention` collected with ``torch.distributed.all_gather_object``
            or saved per rank).
        dim: the sequence axis.
        segment_size: the ``segment_size`` the shards were made with.

    Raises:
        ValueError: a shard's length is not the one the zigzag split gives its rank.
    """
    world_size = len(shards)
    seq_len = sum(s.shape[dim] for s in shards)
    bounds = chunk_bounds(seq_len, world_size, segment_size)
    pieces: list[torch.Tensor | None] = [None] * (2 * world_size)
    for rank, shard in enumerate(shards):
        (a0, a1), (b0, b1) = bounds[rank], bounds[2 * world_size - 1 - rank]
        if shard.shape[dim] != (a1 - a0) + (b1 - b0):
            raise ValueError(
                f"shards[{rank}] has {shard.shape[dim]} tokens along dim {dim}; the zigzag split of "
                f"{seq_len} tokens over {world_size} ranks gives rank {rank} {(a1 - a0) + (b1 - b0)}"
            )
        pieces[rank] = shard.narrow(dim, 0, a1 - a0)
        pieces[2 * world_size - 1 - rank] = shard.narrow(dim, a1 - a0, b1 - b0)
    return torch.cat(pieces, dim=dim)  # type: ignore[arg-type]
