"""``avg_query``: keys scored by the mean-pooled query of every query block."""

from __future__ import annotations

from typing import Literal

import torch

from pbs.components import PermutationInputs, PermuterConfig, Permutations, register_permuter
from pbs.reference.block_means import block_means
from pbs.permuters._segments import (
    mean_attention_over_queries,
    scoring_queries,
    sort_within_segments,
    to_key_permutation,
)


@register_permuter
class AvgQueryPermuter(PermuterConfig):
    """Keys sorted by the attention of the block-averaged queries (one centroid per query block)."""

    name: Literal["avg_query"] = "avg_query"

    def permute(self, inputs: PermutationInputs) -> Permutations:
        layout = inputs.layout
        bs = layout.block_size
        centroids = block_means(scoring_queries(inputs), bs)
        # A centroid stands for its whole block: it may see keys up to the block's last position.
        last_slot = torch.arange(layout.num_query_blocks, device=inputs.q.device) * bs + bs - 1
        positions = last_slot.clamp(max=layout.seq_len_q - 1) + layout.query_offset
        scores = mean_attention_over_queries(centroids, positions, inputs.k, inputs.scale, layout.causal)
        indices = sort_within_segments(scores, 0, layout.permutable_key_len, layout.segment_size)
        return Permutations(keys=to_key_permutation(indices))
