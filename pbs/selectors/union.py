"""``union``: every block that any of several selectors keeps.

Estimators miss different things: a pooled score (``mean_pool``) follows what each query block's
*average* query reads, the lines of ``vertical_slash`` follow what the last queries read at a
fixed key or a fixed distance. Their union keeps both, at the sum of their densities minus the
overlap. Each member runs its own reference ``select`` on the same inputs (on the GPU, each its
planner: `pbs.backends.composition`).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, SerializeAsAny, field_validator

from pbs.components import SelectionInputs, SelectorConfig, register_selector, selector_registry
from pbs.types import BlockMask


def _default_members() -> tuple[SelectorConfig, ...]:
    # The measured combination: the preset vertical_slash_pooled, the library's default selection.
    return (selector_registry.parse({"name": "vertical_slash", "threshold": 0.75}),
            selector_registry.parse({"name": "mean_pool", "threshold": 0.9}))


@register_selector
class UnionSelector(SelectorConfig):
    """Keeps the blocks any member keeps.

    Attributes:
        selectors: two or more selector configs (names, dicts or instances), run in order.
    """

    name: Literal["union"] = "union"
    selectors: tuple[SerializeAsAny[SelectorConfig], ...] = Field(default_factory=_default_members, min_length=2)

    @field_validator("selectors", mode="before")
    @classmethod
    def _parse_members(cls, value):
        if isinstance(value, (str, dict)) or not hasattr(value, "__iter__"):
            raise ValueError("union.selectors must be a list of selector configs (names or dicts)")
        return tuple(selector_registry.parse(member) for member in value)

    def check_compatible(self, config) -> None:
        for member in self.selectors:
            member.check_compatible(config)

    def mass_share(self) -> float | None:
        # The union keeps every block each member keeps, so it covers at least the largest share.
        shares = [share for share in (m.mass_share() for m in self.selectors) if share is not None]
        return max(shares) if shares else None

    def summaries_needed(self) -> frozenset[str] | None:
        needed = [member.summaries_needed() for member in self.selectors]
        return None if any(n is None for n in needed) else frozenset().union(*needed)

    def select(self, inputs: SelectionInputs) -> torch.Tensor:
        selected = None
        for member in self.selectors:
            result = member.select(inputs)
            if isinstance(result, BlockMask):
                result = result.to_dense()
            selected = result if selected is None else selected | result
        return selected
