"""``last_block``: the paper's default key permutation (Sec. 3.3, Eq. 3-4).

The last block of queries estimates how much attention every key receives,
``s = mean_rows(softmax(Q_last K^T / sqrt(d)))``, and keys are sorted by ``s`` (descending) inside
each segment, which gathers the global heavy hitters into the leading blocks of every segment.
"""

from __future__ import annotations

from typing import Literal

import torch

from pbs.components import PermutationInputs, PermuterConfig, Permutations, register_permuter
from pbs.permuters._segments import (
    mean_attention_over_queries,
    scoring_queries,
    sort_within_segments,
    to_key_permutation,
)


def key_permutation_from_proxy_queries(inputs: PermutationInputs, slots: torch.Tensor) -> Permutations:
    """Sorts keys in each segment by the attention that the queries at ``slots`` give them."""
    layout = inputs.layout
    queries = scoring_queries(inputs)[:, :, slots]
    scores = mean_attention_over_queries(
        queries, slots + layout.query_offset, inputs.k, inputs.scale, layout.causal
    )
    indices = sort_within_segments(scores, 0, layout.permutable_key_len, layout.segment_size)
    return Permutations(keys=to_key_permutation(indices))


@register_permuter
class LastBlockPermuter(PermuterConfig):
    """Key order from the attention of the last ``block_size`` queries (paper default).

    Attributes:
        num_queries: how many of the last queries score the keys; ``None`` uses one block
            (``PBSConfig.block_size``).
    """

    name: Literal["last_block"] = "last_block"
    num_queries: int | None = None

    def permute(self, inputs: PermutationInputs) -> Permutations:
        nq = inputs.layout.seq_len_q
        m = min(nq, self.num_queries or inputs.layout.block_size)
        slots = torch.arange(nq - m, nq, device=inputs.q.device)
        return key_permutation_from_proxy_queries(inputs, slots)
