"""Selectors made of selectors (``union``, ``head_choice``), composed from their members' planners.

A member runs its planner of the same family where one is registered, else its reference
method. With a ``vertical_slash`` member on its fast path, the others' selection is merged into
that member's compaction (`pbs.backends.planners.vertical_slash_select`'s ``extra``): no dense
``(B, Hq, Tq, Tk)`` masks are built and compacted again.
"""

from __future__ import annotations

import torch

from pbs.backends.planners import FAMILY, lines_block_mask, lines_fast_path, vertical_slash_select
from pbs.backends.registry import planner_for, register_planner
from pbs.components import SelectionInputs, SelectorConfig
from pbs.reference.block_means import sum_per_key_block
from pbs.reference.block_sets import finalize_selection
from pbs.selectors.head_choice import pooled_coverage
from pbs.types import BlockMask


def member_mask(member: SelectorConfig, inputs: SelectionInputs, family: str = FAMILY) -> BlockMask:
    """One member's selection as a finished `BlockMask`: its planner of ``family``, else its
    reference ``select`` (then finalized)."""
    planner = planner_for("selector", member.name, family)
    result = planner(member, inputs) if planner is not None else member.select(inputs)
    if isinstance(result, BlockMask):
        return result
    return finalize_selection(result, inputs.layout, inputs.key_positions, inputs.force_sink_block)


def union_of_members(members: tuple[SelectorConfig, ...], inputs: SelectionInputs) -> torch.Tensor:
    """OR of the members' selections: ``(B, Hq, Tq, Tk)`` bool."""
    selected = None
    for member in members:
        dense = member_mask(member, inputs).to_dense()
        selected = dense if selected is None else selected | dense
    return selected


def union_select(config, inputs: SelectionInputs) -> BlockMask | torch.Tensor:
    """`UnionSelector`: the lines' compaction takes the other members' blocks in, or the OR of
    the members' planners."""
    lines = next((m for m in config.selectors if m.name == "vertical_slash"), None)
    if lines is None or not lines_fast_path(inputs):
        return union_of_members(config.selectors, inputs)
    others = tuple(m for m in config.selectors if m is not lines)
    if len(others) == 1:
        extra = member_mask(others[0], inputs)
    else:
        extra = finalize_selection(union_of_members(others, inputs), inputs.layout, inputs.key_positions,
                                   inputs.force_sink_block)
    return vertical_slash_select(lines, inputs, extra=extra)


def head_choice_select(config, inputs: SelectionInputs) -> BlockMask | torch.Tensor:
    """`HeadChoiceSelector`: the pooled selector's planner, the lines merged with it in one
    compaction, and per head the one of the two the coverage test picks, chosen on the device
    (no host sync)."""
    if not lines_fast_path(inputs):
        return config.select(inputs)
    layout = inputs.layout
    pooled = member_mask(config.pooled, inputs)
    both, vertical = lines_block_mask(config.lines, inputs, pooled)
    tk = layout.num_key_blocks
    last = pooled.indices[:, :, -1]
    kept_last = torch.zeros(*last.shape[:-1], tk + 1, dtype=torch.bool, device=last.device)
    kept_last.scatter_(-1, torch.where(last < 0, tk, last).long(), True)
    mass = sum_per_key_block(vertical, layout.block_size)
    first = torch.zeros(last.shape[:2], dtype=torch.long, device=last.device)  # kept_last's only row
    trusted = pooled_coverage(mass, kept_last[:, :, None, :tk], first) >= config.min_coverage  # (B, Hq)
    return BlockMask(counts=torch.where(trusted[..., None], pooled.counts, both.counts),
                     indices=torch.where(trusted[..., None, None], pooled.indices, both.indices), layout=layout)


register_planner("selector", "union", FAMILY)(union_select)
register_planner("selector", "head_choice", FAMILY)(head_choice_select)
