"""``avg_query``: keys scored by the mean-pooled query of every query block."""

from __future__ import annotations

from typing import Literal

import torch

from pbs.components import PermutationInputs, PermuterConfig, Permutations, register_permuter
from pbs.layout import cdiv
from pbs.permuters._segments import (
    mean_attention_over_queries,
    scoring_queries,
    sort_within_segments,
    to_key_permutation,
)


def block_means(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Mean over blocks of ``block_size`` tokens along dim -2 (a partial last block averages what it has).

    Args:
        x: ``(B, H, N, D)``.

    Returns:
        ``(B, H, ceil(N / block_size), D)`` float32.
    """
    b, h, n, d = x.shape
    nb = cdiv(n, block_size)
    pad = nb * block_size - n
    xf = x.float()
    if pad:
        xf = torch.nn.functional.pad(xf, (0, 0, 0, pad))
    sums = xf.view(b, h, nb, block_size, d).sum(3)
    counts = torch.full((nb,), float(block_size), device=x.device)
    counts[-1] = block_size - pad
    return sums / counts[:, None]


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
