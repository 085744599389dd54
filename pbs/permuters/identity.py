"""``identity``: no permutation (plain block-sparse attention; the MeanPooling baseline)."""

from __future__ import annotations

from typing import Literal

from pbs.components import PermutationInputs, PermuterConfig, Permutations, register_permuter


@register_permuter
class IdentityPermuter(PermuterConfig):
    """Leaves every token in place."""

    name: Literal["identity"] = "identity"

    def permute(self, inputs: PermutationInputs) -> Permutations:
        return Permutations(keys=None, queries=None)
