"""``random``: a seeded random order inside each segment (the paper's Sec. 2.2 control)."""

from __future__ import annotations

from typing import Literal

import torch

from pbs.components import PermutationInputs, PermuterConfig, Permutations, register_permuter
from pbs.permuters._segments import seeded_generator, sort_within_segments, to_key_permutation


@register_permuter
class RandomPermuter(PermuterConfig):
    """Shuffles keys uniformly inside each full segment.

    Attributes:
        seed: generator seed; the same seed gives the same order on every device.
    """

    name: Literal["random"] = "random"
    seed: int = 0

    def permute(self, inputs: PermutationInputs) -> Permutations:
        layout = inputs.layout
        shape = (layout.batch, inputs.key_heads, layout.seq_len_k)
        scores = torch.rand(shape, generator=seeded_generator(self.seed)).to(inputs.k.device)
        indices = sort_within_segments(scores, 0, layout.permutable_key_len, layout.segment_size)
        return Permutations(keys=to_key_permutation(indices))
