"""``last_block``: the paper's default key permutation (Sec. 3.3, Eq. 3-4).

The last block of queries estimates how much attention every key receives,
``s = mean_rows(softmax(Q_last K^T / sqrt(d)))``, and keys are sorted by ``s`` (descending) inside
each segment, which gathers the global heavy hitters into the leading blocks of every segment.

As in Eq. 3 and the paper's code, the proxy queries see every key with no causal mask, and the
softmax is normalised over the keys of the full segments only (the last ``Nk mod S`` keys never
move, so they take no part). ``causal_scoring=True`` instead masks each proxy query's future keys
and normalises over all keys (this library's earlier rule, kept for comparison).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from pbs.components import PermutationInputs, PermuterConfig, Permutations, register_permuter
from pbs.permuters._segments import (
    mean_attention_over_queries,
    scoring_queries,
    sort_within_segments,
    to_key_permutation,
)


def key_permutation_from_proxy_queries(
    inputs: PermutationInputs, slots: torch.Tensor, causal: bool | None = None
) -> Permutations:
    """Sorts keys in each segment by the attention that the queries at ``slots`` give them.

    Args:
        inputs: the permuter's inputs.
        slots: ``(M,)`` query slots of the proxy queries.
        causal: mask each proxy query's future keys and normalise over all keys; False (Eq. 3)
            normalises over the full-segment keys with no mask. ``None`` follows ``layout.causal``.
    """
    layout = inputs.layout
    permutable = layout.permutable_key_len
    if permutable == 0:
        return Permutations(keys=None)
    causal = layout.causal if causal is None else causal and layout.causal
    queries = scoring_queries(inputs)[:, :, slots]
    keys = inputs.k if causal else inputs.k[:, :, :permutable]
    scores = mean_attention_over_queries(queries, slots + layout.query_offset, keys, inputs.scale, causal)
    indices = sort_within_segments(scores, 0, permutable, layout.segment_size, total_len=layout.seq_len_k)
    return Permutations(keys=to_key_permutation(indices))


@register_permuter
class LastBlockPermuter(PermuterConfig):
    """Key order from the attention of the last ``block_size`` queries (paper default).

    Attributes:
        num_queries: how many of the last queries score the keys; ``None`` uses one block
            (``PBSConfig.block_size``).
        causal_scoring: mask the proxy queries' future keys (not the paper's rule; see the module
            docstring).
    """

    name: Literal["last_block"] = "last_block"
    num_queries: int | None = Field(None, ge=1)
    causal_scoring: bool = False

    def permute(self, inputs: PermutationInputs) -> Permutations:
        nq = inputs.layout.seq_len_q
        m = min(nq, self.num_queries or inputs.layout.block_size)
        slots = torch.arange(nq - m, nq, device=inputs.q.device)
        return key_permutation_from_proxy_queries(inputs, slots, causal=self.causal_scoring)
