"""Building blocks shared by the reference permuters: GQA-aware scoring and in-segment sorting."""

from __future__ import annotations

import torch

from pbs.components import PermutationInputs
from pbs.reference.logits import grouped_logits
from pbs.types import Permutation

# Bounds the fp32 score buffer of one chunk (elements) so that scoring long sequences on the
# reference path does not materialise every head's scores at once.
_SCORE_CHUNK_ELEMENTS = 1 << 26


def scoring_queries(inputs: PermutationInputs) -> torch.Tensor:
    """Queries that decide the key order: ``(B, Hk, Nq, D)``.

    Per-head mode keeps every query head; shared mode averages the queries of each GQA group
    (the paper's "GQA Handling" appendix), so one key order serves the whole group.
    """
    q, layout = inputs.q, inputs.layout
    if inputs.gqa == "per_head":
        return q
    b, _, n, d = q.shape
    return q.view(b, layout.heads_kv, layout.group_size, n, d).float().mean(2).to(q.dtype)


def mean_attention_over_queries(
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    causal: bool,
) -> torch.Tensor:
    """Row-mean of ``softmax(queries k^T * scale)``: how much attention each key receives (Eq. 3).

    Args:
        queries: ``(B, Hs, M, D)`` proxy queries (e.g. the last query block).
        query_positions: ``(M,)`` original positions of those queries (for the causal mask).
        k: ``(B, Hkv, N, D)`` keys in original order.
        scale: softmax scale.
        causal: mask keys after each query.

    Returns:
        ``(B, Hs, N)`` float32 scores.
    """
    b, hs, m, _ = queries.shape
    n = k.shape[2]
    hkv = k.shape[1]
    group = hs // hkv
    key_pos = torch.arange(n, device=k.device)
    future = key_pos[None, :] > query_positions[:, None]  # (M, N)
    out = torch.empty(b, hs, n, dtype=torch.float32, device=k.device)
    # Chunk over KV heads so that one chunk's (group, M, N) fp32 buffer stays bounded.
    per_kv_head = max(1, b * group * m * n)
    step = max(1, _SCORE_CHUNK_ELEMENTS // per_kv_head)
    for h0 in range(0, hkv, step):
        h1 = min(hkv, h0 + step)
        logits = grouped_logits(queries[:, h0 * group : h1 * group], k[:, h0:h1]) * scale
        if causal:
            logits = logits.masked_fill(future, float("-inf"))
        out[:, h0 * group : h1 * group] = logits.softmax(-1).nan_to_num_(0.0).mean(-2)
    return out


def sort_within_segments(
    scores: torch.Tensor,
    lo: int,
    hi: int,
    segment_size: int,
    descending: bool = True,
    total_len: int | None = None,
) -> torch.Tensor:
    """Slot-to-original indices that sort ``scores`` inside each segment of ``[lo, hi)`` (Eq. 4).

    Args:
        scores: ``(B, H, N)``; ``hi - lo`` must be a multiple of ``segment_size``.
        lo, hi: the permutable slot range; slots outside it keep their place.
        segment_size: ``S``.
        descending: highest score first (the paper's order).
        total_len: length of the result when ``scores`` covers only a prefix of the slots
            (default ``N``); slots past ``scores`` keep their place.

    Returns:
        ``(B, H, total_len)`` int64 indices (a bijection that moves tokens only inside their segment).
    """
    b, h, n = scores.shape
    n = n if total_len is None else total_len
    indices = torch.arange(n, device=scores.device).repeat(b, h, 1)
    if hi <= lo:
        return indices
    seg = scores[..., lo:hi].reshape(b, h, -1, segment_size)
    # Stable sort so that ties keep their original order and results do not depend on the device.
    order = seg.argsort(dim=-1, descending=descending, stable=True)
    base = lo + torch.arange(seg.shape[2], device=scores.device)[:, None] * segment_size
    indices[..., lo:hi] = (order + base).reshape(b, h, -1)
    return indices


def greedy_assign(similarity: torch.Tensor, block_size: int) -> torch.Tensor:
    """Greedy block filling: block ``j`` takes the ``block_size`` free tokens most similar to centroid ``j``.

    Args:
        similarity: ``(..., nb, S)`` similarity of ``nb = S / block_size`` centroids to ``S`` tokens.
        block_size: tokens per block.

    Returns:
        ``(..., S)`` int64 order of the segment's tokens (block 0's tokens first).
    """
    nb, s = similarity.shape[-2:]
    taken = torch.zeros(similarity.shape[:-2] + (s,), dtype=torch.bool, device=similarity.device)
    picks = []
    for j in range(nb):
        sim = similarity[..., j, :].masked_fill(taken, float("-inf"))
        if j == nb - 1:
            # The last block takes whatever is left; sorting keeps that deterministic.
            pick = sim.argsort(dim=-1, descending=True, stable=True)[..., : s - j * block_size]
        else:
            pick = sim.argsort(dim=-1, descending=True, stable=True)[..., :block_size]
        taken.scatter_(-1, pick, True)
        picks.append(pick)
    return torch.cat(picks, dim=-1)


def to_key_permutation(indices: torch.Tensor) -> Permutation:
    """Wraps slot-to-original indices as a `Permutation`."""
    return Permutation.from_indices(indices)
