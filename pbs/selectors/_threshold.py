"""Cumulative-threshold selection shared by the score-based selectors (Algorithm 2, lines 8-13)."""

from __future__ import annotations

import torch


def select_by_cumulative_threshold(scores: torch.Tensor, allowed: torch.Tensor, threshold: float) -> torch.Tensor:
    """Keeps, per row, the fewest highest-scoring allowed blocks whose scores sum to ``threshold``.

    Args:
        scores: ``(..., Tq, Tk)`` non-negative block scores, each row summing to 1 over allowed blocks.
        allowed: ``(Tq, Tk)`` bool, or broadcastable to ``scores``.
        threshold: ``tau`` in ``(0, 1]``.

    Returns:
        ``(..., Tq, Tk)`` bool. Ties are broken towards the lower block index. When rounding keeps the
        cumulative sum just under ``tau``, every allowed block is kept (the ``{i}`` of Algorithm 2).
    """
    scores = scores.masked_fill(~allowed, float("-inf"))
    ranked, order = scores.sort(dim=-1, descending=True, stable=True)
    cumulative = ranked.clamp(min=0).cumsum(-1)
    needed = (cumulative < threshold).sum(-1, keepdim=True) + 1
    num_allowed = allowed.sum(-1, keepdim=True).expand_as(needed)
    needed = torch.minimum(needed, num_allowed)
    rank = torch.arange(scores.shape[-1], device=scores.device)
    keep_sorted = rank < needed
    selected = torch.zeros_like(keep_sorted)
    selected.scatter_(-1, order, keep_sorted)
    return selected
