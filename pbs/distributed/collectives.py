"""The process group and the collectives of context parallelism: rank and size, the K/V
communicator, and all-gathers of zigzag shards whose lengths differ from rank to rank.

A rank's shard along dim 2 is its two chunks ``r`` and ``2P - 1 - r`` back to back
(`pbs.distributed.sharding`); `assemble` puts every rank's gathered shard back in sequence order.
"""

from __future__ import annotations

from typing import Any

import torch


def torch_distributed():
    """``torch.distributed``, imported on first use (``import pbs`` does not load it)."""
    import torch.distributed as dist

    return dist


def group_rank_and_size(group: Any) -> tuple[int, int]:
    """This process's ``(rank, world size)`` in ``group``; RuntimeError if torch.distributed is not initialised."""
    dist = torch_distributed()
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "context_parallel_attention needs an initialised torch.distributed process group: call "
            "torch.distributed.init_process_group (e.g. under torchrun) first, and pass group= for a "
            "group other than the default one"
        )
    return dist.get_rank(group), dist.get_world_size(group)


# A second communicator over the same ranks for the K/V all-gather, per group: the collectives of
# one communicator run in order, so on the group itself the planned-density all-reduce would wait
# behind the whole gather instead of overlapping it.
_KV_GROUPS: dict[Any, Any] = {}


def kv_group(group: Any, world: int) -> Any:
    """The communicator for the K/V all-gather: a second one over ``group``'s ranks, else ``group``."""
    dist = torch_distributed()
    # new_group must be entered by every process of the job: only a group spanning all of them
    # gets its own communicator (a sub-group's ranks cannot make one without the others).
    if world == 1 or world != dist.get_world_size():
        return group
    if group not in _KV_GROUPS:
        _KV_GROUPS[group] = dist.new_group(ranks=list(range(world)))
    return _KV_GROUPS[group]


def global_rank(group: Any, group_rank: int) -> int:
    """The global rank of ``group``'s rank ``group_rank`` (itself for the default group, None)."""
    dist = torch_distributed()
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _pad_to(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    if x.shape[dim] == length:
        return x.contiguous()
    pad_shape = list(x.shape)
    pad_shape[dim] = length - x.shape[dim]
    return torch.cat([x, x.new_zeros(pad_shape)], dim=dim)


def all_gather_shards(x: torch.Tensor, lengths: list[int], group: Any, async_op: bool = False):
    """All-gathers every rank's ``x`` (lengths differ along dim 2: padded to the longest).

    ``x``: ``(B, H, lengths[rank], D)``; returns ``(out, work)``: ``out`` one ``(B, H, max(lengths),
    D)`` tensor per rank (each rank's first ``lengths[r]`` entries are its own), ``work`` the
    collective's handle with ``async_op`` (else None).
    """
    dist = torch_distributed()
    longest = max(lengths)
    padded = _pad_to(x, longest, 2)
    out = [torch.empty_like(padded) for _ in lengths]
    work = dist.all_gather(out, padded, group=group, async_op=async_op)
    return out, work


def assemble(gathered: list[torch.Tensor], bounds: list[tuple[int, int]], unit: int, total: int) -> torch.Tensor:
    """The whole sequence along dim 2 from every rank's gathered shard (``unit`` positions per entry:
    1 for tokens, the block size for pooled blocks).

    ``gathered``: one ``(B, H, _, D)`` per rank (`all_gather_shards`); ``bounds``: the ``2P`` chunks'
    ``(start, end)`` positions (`chunk_bounds`); returns ``(B, H, total, D)``.
    """
    world = len(gathered)
    b, h, _, d = gathered[0].shape
    whole = gathered[0].new_empty(b, h, total, d)
    for r, shard in enumerate(gathered):
        offset = 0
        for c in (r, 2 * world - 1 - r):
            start, end = bounds[c][0] // unit, -(-bounds[c][1] // unit)
            whole[:, :, start:end] = shard[:, :, offset:offset + end - start]
            offset += end - start
    return whole
