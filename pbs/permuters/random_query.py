"""``random_query``: keys scored by a seeded random subset of queries (Sec. 2.2, Figure 1)."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from pbs.components import PermutationInputs, PermuterConfig, Permutations, register_permuter
from pbs.reference.seeded import Seed, seeded_generator
from pbs.permuters.last_block import key_permutation_from_proxy_queries


@register_permuter
class RandomQueryPermuter(PermuterConfig):
    """Like ``last_block`` but the proxy queries are drawn uniformly from the whole query range.

    Attributes:
        num_queries: how many queries score the keys.
        seed: generator seed for the sample.
    """

    name: Literal["random_query"] = "random_query"
    num_queries: int = Field(128, ge=1)
    seed: Seed = 0

    def permute(self, inputs: PermutationInputs) -> Permutations:
        nq = inputs.layout.seq_len_q
        m = min(nq, self.num_queries)
        slots = torch.randperm(nq, generator=seeded_generator(self.seed))[:m].sort().values
        return key_permutation_from_proxy_queries(inputs, slots.to(inputs.q.device))
