"""``key_aware_query``: permute queries, not keys (Sec. 4.4, "Why permute keys but not queries?").

Key-block centroids ``K_bar_j = mean(K[jB:(j+1)B])`` act as cluster centres. Inside each query
segment, query block ``j`` greedily takes the ``block_size`` free queries most cosine-similar to the
centroid of key block ``j`` of the same segment, so queries that look for similar keys share a
block. Keys keep their order; the output is un-permuted afterwards (Theorem 3.3). Only full
segments that lie wholly inside the query range are permuted.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from pbs.components import PermutationInputs, PermuterConfig, Permutations, register_permuter
from pbs.permuters._segments import greedy_assign
from pbs.reference.block_means import block_means
from pbs.types import Permutation


@register_permuter
class KeyAwareQueryPermuter(PermuterConfig):
    """Queries grouped by cosine similarity to the key-block centroids of their segment."""

    name: Literal["key_aware_query"] = "key_aware_query"

    def permute(self, inputs: PermutationInputs) -> Permutations:
        layout = inputs.layout
        q, k = inputs.q, inputs.k
        b, hq, nq, d = q.shape
        hkv = k.shape[1]
        s, bs = layout.segment_size, layout.block_size
        lo, hi = layout.permutable_query_range
        indices = torch.arange(nq, device=q.device).repeat(b, hq, 1)
        if hi <= lo:
            return Permutations(keys=None, queries=Permutation.from_indices(indices))
        nb = s // bs
        g0 = (lo + layout.query_offset) // s
        gq = (hi - lo) // s
        centroids = block_means(k[:, :, : layout.permutable_key_len], bs)
        centroids = F.normalize(centroids.view(b, hkv, -1, nb, d)[:, :, g0 : g0 + gq], dim=-1)
        queries = F.normalize(q[:, :, lo:hi].float(), dim=-1).view(b, hkv, hq // hkv, gq, s, d)
        similarity = torch.einsum("bhgjd,bhxgsd->bhxgjs", centroids, queries).reshape(b, hq, gq, nb, s)
        order = greedy_assign(similarity, bs)
        base = lo + torch.arange(gq, device=q.device)[:, None] * s
        indices[..., lo:hi] = (order + base).reshape(b, hq, gq * s)
        return Permutations(keys=None, queries=Permutation.from_indices(indices))
