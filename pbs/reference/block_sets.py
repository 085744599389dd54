"""Forced blocks (the on-diagonal segment and the sink): the eager side of
`pbs.kernels.block_sets`. The allowed, diagonal and candidate sets themselves are `pbs.layout.Layout`
methods (`allowed_blocks`, `diagonal_blocks`, `candidate_blocks`)."""

from __future__ import annotations

import torch

from pbs.layout import Layout
from pbs.types import BlockMask


def sink_blocks(layout: Layout, key_positions: torch.Tensor) -> torch.Tensor:
    """Key block that holds original position 0, per (batch, query head): ``(B, Hq)`` int64."""
    slot = (key_positions == 0).to(torch.int8).argmax(-1)  # (B, Hk)
    group = layout.heads_q // key_positions.shape[1]
    if group > 1:
        slot = slot.repeat_interleave(group, dim=1)
    return slot // layout.block_size


def forced_blocks(layout: Layout, key_positions: torch.Tensor, force_sink_block: bool = True) -> torch.Tensor:
    """Blocks every selection keeps: the on-diagonal segment(s) and, optionally, the sink block.

    Args:
        layout: geometry of the call.
        key_positions: ``(B, Hk, Nk)`` original position of every permuted key slot.
        force_sink_block: include the block holding position 0.

    Returns:
        ``(B, Hq, Tq, Tk)`` bool.
    """
    device = key_positions.device
    shape = (layout.batch, layout.heads_q, layout.num_query_blocks, layout.num_key_blocks)
    forced = layout.diagonal_blocks(device).expand(shape).clone()
    if force_sink_block:
        sink = sink_blocks(layout, key_positions)
        forced.scatter_(-1, sink[:, :, None, None].expand(*shape[:3], 1), True)
    return forced & layout.allowed_blocks(device)


def finalize_selection(
    selected: torch.Tensor, layout: Layout, key_positions: torch.Tensor, force_sink_block: bool
) -> BlockMask:
    """A selector's bool selection as the `BlockMask` that runs: forced blocks added, blocks wholly
    in the future dropped.

    Args:
        selected: ``(B, Hq, Tq, Tk)`` bool from a selector.
        layout: geometry of the call.
        key_positions: ``(B, Hk, Nk)`` original position of every permuted key slot.
        force_sink_block: keep the block holding position 0.
    """
    expected = (layout.batch, layout.heads_q, layout.num_query_blocks, layout.num_key_blocks)
    if selected.dtype != torch.bool or tuple(selected.shape) != expected:
        raise ValueError(
            f"a selector must return a bool tensor of shape (B, Hq, Tq, Tk) = {expected}, "
            f"got {selected.dtype} {tuple(selected.shape)}"
        )
    allowed = layout.allowed_blocks(selected.device)
    dense = (selected | forced_blocks(layout, key_positions, force_sink_block)) & allowed
    return BlockMask.from_dense(dense, layout)
