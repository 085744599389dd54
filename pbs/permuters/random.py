"""``random``: a seeded random order inside each segment (the paper's Sec. 2.2 control)."""

from __future__ import annotations

from typing import Literal

from pbs.components import PermutationInputs, PermuterConfig, Permutations, register_permuter
from pbs.permuters._segments import sort_within_segments, to_key_permutation
from pbs.reference.seeded import Seed, seeded_rand


@register_permuter
class RandomPermuter(PermuterConfig):
    """Shuffles keys uniformly inside each full segment.

    Attributes:
        seed: generator seed; the same seed gives the same order on every device.
    """

    name: Literal["random"] = "random"
    seed: Seed = 0

    def permute(self, inputs: PermutationInputs) -> Permutations:
        layout = inputs.layout
        shape = (layout.batch, inputs.key_heads, layout.seq_len_k)
        scores = seeded_rand(shape, self.seed).to(inputs.k.device)  # CPU draws: the same on every device
        indices = sort_within_segments(scores, 0, layout.permutable_key_len, layout.segment_size)
        return Permutations(keys=to_key_permutation(indices))
