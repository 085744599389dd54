"""``identity``: tokens stay in place, but segments still count (PBS-Attn with a trivial permutation).

The whole on-diagonal segment is forced and left out of the selectors' softmax, as for any
permuter. The paper's unpermuted MeanPooling baseline is ``none``, not this.
"""

from __future__ import annotations

from typing import Literal

from pbs.components import PermutationInputs, PermuterConfig, Permutations, register_permuter


@register_permuter
class IdentityPermuter(PermuterConfig):
    """Leaves every token in place; the segment rule of selection still applies."""

    name: Literal["identity"] = "identity"

    def permute(self, inputs: PermutationInputs) -> Permutations:
        return Permutations(keys=None, queries=None)
