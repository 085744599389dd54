"""``greedy``: query-aware key permutation by local alignment (Sec. 2.2, strategy 3).

For every key block ``j`` of a segment, the centroid (mean) of the query block at the same
positions picks, greedily and in block order, the ``block_size`` still-free keys of the segment
with the highest cosine similarity. Where the queries at those positions are not part of the call
(a cached prefix, ``Nq < Nk``), the centroid of the last query block stands in.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from pbs.components import PermutationInputs, PermuterConfig, Permutations, register_permuter
from pbs.permuters._segments import greedy_assign, scoring_queries, to_key_permutation


def aligned_query_centroids(inputs: PermutationInputs) -> torch.Tensor:
    """Mean query of every block of the permutable key range, by original position.

    Returns:
        ``(B, Hk, G * S / block_size, D)`` float32; blocks with no query take the last block's mean.
    """
    layout = inputs.layout
    bs, offset, nq = layout.block_size, layout.query_offset, layout.seq_len_q
    qs = scoring_queries(inputs).float()
    b, h, _, d = qs.shape
    cumsum = torch.cat([qs.new_zeros(b, h, 1, d), qs.cumsum(2)], dim=2)
    starts = torch.arange(layout.permutable_key_len // bs, device=qs.device) * bs - offset
    lo = starts.clamp(0, nq)
    hi = (starts + bs).clamp(0, nq)
    sums = cumsum[:, :, hi] - cumsum[:, :, lo]
    counts = (hi - lo).float()[:, None]
    m = min(bs, nq)
    fallback = qs[:, :, nq - m :].mean(2, keepdim=True)
    return torch.where(counts > 0, sums / counts.clamp(min=1), fallback)


@register_permuter
class GreedyPermuter(PermuterConfig):
    """Keys assigned block by block to the most cosine-similar query-block centroid."""

    name: Literal["greedy"] = "greedy"

    def permute(self, inputs: PermutationInputs) -> Permutations:
        layout = inputs.layout
        k = inputs.k
        b, hkv, nk, d = k.shape
        s, bs, g = layout.segment_size, layout.block_size, layout.num_full_segments
        indices = torch.arange(nk, device=k.device).repeat(b, inputs.key_heads, 1)
        if g == 0:
            return Permutations(keys=to_key_permutation(indices))
        nb = s // bs
        centroids = F.normalize(aligned_query_centroids(inputs), dim=-1)
        hk = centroids.shape[1]
        centroids = centroids.view(b, hkv, hk // hkv, g, nb, d)
        keys = F.normalize(k[:, :, : g * s].float(), dim=-1).view(b, hkv, g, s, d)
        similarity = torch.einsum("bhxgjd,bhgsd->bhxgjs", centroids, keys).reshape(b, hk, g, nb, s)
        order = greedy_assign(similarity, bs)  # (B, Hk, G, S)
        base = torch.arange(g, device=k.device)[:, None] * s
        indices[..., : g * s] = (order + base).reshape(b, hk, g * s)
        return Permutations(keys=to_key_permutation(indices))
