"""``head_choice``: per head, pooled blocks alone where they hold the last queries' attention,
pooled blocks and lines where they do not.

The union of ``vertical_slash`` and ``mean_pool`` keeps dense quality on a real model, but in
many heads the pooled blocks alone already hold the mass and the lines only add blocks. FlexPrefill
(Lai et al., 2025) chooses a pattern per head from the last queries' exact attention; here the
test is direct: the share of the last ``lines.last_rows`` queries' exact attention that the pooled
selection keeps for the query block of the last query. Where it reaches ``min_coverage``, the head
keeps the pooled blocks alone; elsewhere the lines are added. Those rows are the ones
``vertical_slash`` scores anyway. Permuted layouts work too (the mass follows each key to its
slot); the GPU implementation runs the unpermuted case.

On a real model it loses quality for little density (docs/quality.md, where FlexPrefill's own
Jensen-Shannon test is compared too): the last rows' coverage does not speak for the earlier query
blocks, which the lines also serve. Kept as a building block for per-head choices, not as a
recommendation.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, SerializeAsAny, field_validator

from pbs.components import SelectionInputs, SelectorConfig, register_selector, selector_registry
from pbs.reference.block_means import sum_per_key_block
from pbs.reference.block_sets import forced_blocks
from pbs.selectors.vertical_slash import VerticalSlashSelector, last_rows_attention
from pbs.types import BlockMask


def _default_pooled() -> SelectorConfig:
    return selector_registry.parse({"name": "mean_pool", "threshold": 0.9})


def _default_lines() -> VerticalSlashSelector:
    return VerticalSlashSelector(threshold=0.75)


@register_selector
class HeadChoiceSelector(SelectorConfig):
    """Per head: ``pooled`` alone where its blocks hold at least ``min_coverage`` of the last
    queries' exact attention, else ``pooled`` and ``lines`` together.

    Attributes:
        pooled: the selector kept in every head.
        lines: a ``vertical_slash`` config, added in the heads the pooled blocks do not cover; its
            ``last_rows`` are the rows the coverage is measured on.
        min_coverage: in ``(0, 1]``; above 1 the lines are added to every head (the union).
    """

    name: Literal["head_choice"] = "head_choice"
    pooled: SerializeAsAny[SelectorConfig] = Field(default_factory=_default_pooled)
    lines: VerticalSlashSelector = Field(default_factory=_default_lines)
    min_coverage: float = Field(0.8, gt=0.0, le=1.01)

    @field_validator("pooled", mode="before")
    @classmethod
    def _parse_pooled(cls, value):
        return selector_registry.parse(value)

    def check_compatible(self, config) -> None:
        self.pooled.check_compatible(config)
        self.lines.check_compatible(config)

    def mass_share(self) -> float | None:
        # Every head keeps the pooled blocks; where the lines are added they keep theirs too.
        return self.pooled.mass_share()

    def select(self, inputs: SelectionInputs) -> torch.Tensor:
        pooled = self.pooled.select(inputs)
        if isinstance(pooled, BlockMask):
            pooled = pooled.to_dense()
        forced = forced_blocks(inputs.layout, inputs.key_positions, inputs.force_sink_block)
        trusted = pooled_coverage(last_rows_block_mass(inputs, self.lines.last_rows), pooled | forced,
                                  last_row_query_block(inputs)) >= self.min_coverage  # (B, Hq)
        if bool(trusted.all()):
            return pooled
        lines = self.lines.select(inputs)
        return torch.where(trusted[:, :, None, None], pooled, pooled | lines)


def last_rows_block_mass(inputs: SelectionInputs, last_rows: int) -> torch.Tensor:
    """The last ``last_rows`` queries' mean exact attention, summed per (permuted) key block:
    ``(B, Hq, Tk)`` float32, each row summing to 1."""
    layout = inputs.layout
    if inputs.source_k is None:
        raise ValueError("head_choice needs the keys in their original order (SelectionInputs.source_k)")
    probs, _ = last_rows_attention(inputs, last_rows, slice(0, layout.heads_q), inputs.source_k.flip(2))
    per_key = probs.mean(-2).flip(-1)  # (B, Hq, Nk), keys by original position
    key_pos = inputs.key_positions
    group = layout.heads_q // key_pos.shape[1]
    if group > 1:
        key_pos = key_pos.repeat_interleave(group, dim=1)
    return sum_per_key_block(per_key.gather(-1, key_pos), layout.block_size)


def last_row_query_block(inputs: SelectionInputs) -> torch.Tensor:
    """The query block holding the last query (by original position), per (batch, query head):
    ``(B, Hq)`` int64 (``Tq - 1`` when queries are not permuted)."""
    layout = inputs.layout
    last = inputs.query_positions == layout.query_offset + layout.seq_len_q - 1
    return last.int().argmax(-1) // layout.block_size


def pooled_coverage(last_rows_mass: torch.Tensor, kept: torch.Tensor, rows_block: torch.Tensor) -> torch.Tensor:
    """Share of the last rows' attention that a selection keeps for the query block of the last row.

    Args:
        last_rows_mass: ``(B, Hq, Tk)`` the last rows' mean exact attention per key block
            (`last_rows_block_mass`).
        kept: ``(B, Hq, Tq, Tk)`` bool selection, forced blocks included.
        rows_block: ``(B, Hq)`` int64, the query block whose kept blocks count
            (`last_row_query_block`).

    Returns:
        ``(B, Hq)`` float32 in ``[0, 1]``.
    """
    index = rows_block[:, :, None, None].expand(-1, -1, 1, kept.shape[-1])
    return (last_rows_mass * kept.gather(2, index).squeeze(2)).sum(-1)
