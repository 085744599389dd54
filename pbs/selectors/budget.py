"""``budget``: a fixed fraction of the allowed blocks, for benchmarking at a chosen density.

Every query block keeps ``round(density * allowed)`` key blocks (at least its forced ones): its forced blocks (sink, on-diagonal
segment) first, then a seeded random choice of the other allowed blocks. Which blocks does not
matter for speed, only how many, so this gives kernels a mask of known density.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from pbs.components import SelectionInputs, SelectorConfig, register_selector
from pbs.reference.seeded import Seed, seeded_rand
from pbs.reference.block_sets import forced_blocks


@register_selector
class BudgetSelector(SelectorConfig):
    """Random blocks up to a fixed share of the causally allowed blocks.

    Attributes:
        density: share of the allowed blocks per query block, in ``(0, 1]``; forced blocks count
            towards it and are kept even where they alone exceed it.
        seed: generator seed for the random choice (the same seed gives the same choice on one
            device type; CPU and CUDA generators differ).
    """

    name: Literal["budget"] = "budget"
    knob: ClassVar[str | None] = "density"
    sequence_summaries: ClassVar[frozenset[str] | None] = frozenset()
    knob_is_mass_share: ClassVar[bool] = False
    density: float = Field(0.3, gt=0.0, le=1.0)
    seed: Seed = 0

    def select(self, inputs: SelectionInputs) -> torch.Tensor:
        layout = inputs.layout
        allowed = inputs.allowed_blocks()
        forced = forced_blocks(layout, inputs.key_positions, force_sink_block=True)
        shape = (layout.batch, layout.heads_q, layout.num_query_blocks, layout.num_key_blocks)
        # Drawn where the mask lives: a CPU draw plus copy costs ~0.2 s per layer at 128K tokens.
        # seeded_rand: under tensor parallelism a rank's heads get the draws they have in the whole layer.
        priority = seeded_rand(shape, self.seed, allowed.device)
        priority = priority.masked_fill(forced, 2.0).masked_fill(~allowed, -1.0)
        order = priority.argsort(dim=-1, descending=True, stable=True)
        budget = torch.round(self.density * allowed.sum(-1).double()).long()  # (Tq,)
        rank = torch.arange(shape[-1], device=allowed.device)
        keep_sorted = rank < budget[:, None]
        selected = torch.zeros(shape, dtype=torch.bool, device=allowed.device)
        selected.scatter_(-1, order, keep_sorted.expand(shape))
        return selected
