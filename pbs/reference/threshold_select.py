"""Cumulative-threshold selection shared by the score-based selectors (Algorithm 2, lines 8-13):
the eager twin of `pbs.kernels.threshold_select`."""

from __future__ import annotations

import torch


def select_by_cumulative_threshold(
    scores: torch.Tensor,
    candidates: torch.Tensor,
    threshold: float,
    ranked_first: torch.Tensor | None = None,
) -> torch.Tensor:
    """Keeps, per row, the fewest highest-scoring candidate blocks whose scores sum to ``threshold``.

    Args:
        scores: ``(..., Tq, Tk)`` non-negative block scores; each row sums to 1 over its candidates
            (or is all zero when a row has none).
        candidates: ``(Tq, Tk)`` bool, or broadcastable to ``scores``: the blocks that may be kept.
        threshold: ``tau`` in ``(0, 1]``.
        ranked_first: optional bool broadcastable to ``scores``: candidate blocks that are kept
            whatever their score and whose mass counts first towards ``tau`` (XAttention's rule for
            its forced sink and diagonal blocks). Algorithm 2 has none: its forced blocks are
            added after the threshold and their mass does not count.

    Returns:
        ``(..., Tq, Tk)`` bool. Ties are broken towards the lower block index. When rounding keeps the
        cumulative sum just under ``tau``, every candidate is kept (the ``{i}`` of Algorithm 2);
        a row without candidates keeps nothing.
    """
    ranking = scores.masked_fill(~candidates, float("-inf"))
    if ranked_first is not None:
        # Scores lie in [0, 1], so +2 moves the forced blocks ahead without reordering them.
        ranking = torch.where(ranked_first & candidates, ranking + 2.0, ranking)
    _, order = ranking.sort(dim=-1, descending=True, stable=True)
    ranked = scores.masked_fill(~candidates, 0.0).gather(-1, order)
    cumulative = cumsum_long_rows(ranked.clamp(min=0), ranked.dtype)
    needed = (cumulative < threshold).sum(-1, keepdim=True) + 1
    num_candidates = candidates.expand_as(scores).sum(-1, keepdim=True)
    needed = torch.minimum(needed, num_candidates)
    if ranked_first is not None:
        num_first = (ranked_first & candidates).expand_as(scores).sum(-1, keepdim=True)
        needed = torch.maximum(needed, num_first)
    rank = torch.arange(scores.shape[-1], device=scores.device)
    keep_sorted = rank < needed
    selected = torch.zeros_like(keep_sorted)
    selected.scatter_(-1, order, keep_sorted)
    return selected


def cumsum_long_rows(values: torch.Tensor, dtype: torch.dtype, chunk: int = 1024) -> torch.Tensor:
    """``values.cumsum(-1, dtype=dtype)`` as a two-level scan: PyTorch scans a few very long rows
    (one per head, ``Nk`` long) slowly on the GPU, and many short rows fast."""
    n = values.shape[-1]
    if n <= 4 * chunk:
        return values.cumsum(-1, dtype=dtype)
    pad = -n % chunk
    inner = torch.nn.functional.pad(values.to(dtype), (0, pad)).view(*values.shape[:-1], -1, chunk).cumsum(-1)
    totals = inner[..., -1]
    carry = totals.cumsum(-1) - totals
    return (inner + carry[..., None]).view(*values.shape[:-1], -1)[..., :n]
