"""``oracle``: selection from the exact attention mass, for analysis (not for speed).

It computes full attention to find, per query block, the fewest key blocks whose true share of the
attention reaches ``coverage``: the best any selector could do at that coverage, and the tool for
the paper's coverage-density curves (Figure 1).
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from pbs.components import SelectionInputs, SelectorConfig, register_selector
from pbs.reference.block_mass import block_attention_mass
from pbs.reference.threshold_select import select_by_cumulative_threshold


@register_selector
class OracleSelector(SelectorConfig):
    """Fewest blocks whose exact attention mass reaches ``coverage`` (costs a dense pass).

    Attributes:
        coverage: target share of each query block's attention, in ``(0, 1]``.
    """

    name: Literal["oracle"] = "oracle"
    knob: ClassVar[str | None] = "coverage"
    coverage: float = Field(0.9, gt=0.0, le=1.0)

    def select(self, inputs: SelectionInputs) -> torch.Tensor:
        mass = block_attention_mass(
            inputs.q, inputs.k, inputs.query_positions, inputs.key_positions, inputs.layout, inputs.scale
        )
        return select_by_cumulative_threshold(mass, inputs.allowed_blocks(), self.coverage)
