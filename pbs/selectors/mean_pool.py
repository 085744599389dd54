"""``mean_pool``: MeanPooling block selection (the paper's "Block Selection" appendix, Algorithm 2).

Queries and keys are mean-pooled per block; a softmax over the pooled scores (restricted to the
allowed blocks) estimates each key block's share of a query block's attention, and the fewest
blocks reaching ``threshold`` of that share are kept.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from pbs.components import SelectionInputs, SelectorConfig, register_selector
from pbs.permuters._segments import grouped_logits
from pbs.permuters.avg_query import block_means
from pbs.selectors._threshold import select_by_cumulative_threshold


def mean_pool_block_scores(inputs: SelectionInputs) -> torch.Tensor:
    """``softmax(Q_bar K_bar^T * scale + C)``: ``(B, Hq, Tq, Tk)`` float32, rows sum to 1."""
    bs = inputs.layout.block_size
    q_bar = block_means(inputs.q, bs)
    k_bar = block_means(inputs.k, bs)
    logits = grouped_logits(q_bar, k_bar) * inputs.scale
    allowed = inputs.allowed_blocks()
    return logits.masked_fill(~allowed, float("-inf")).softmax(-1)


@register_selector
class MeanPoolSelector(SelectorConfig):
    """Cumulative-threshold selection on mean-pooled block attention.

    Attributes:
        threshold: attention share ``tau`` in ``(0, 1]`` the selected blocks must reach (paper: 0.9).
    """

    name: Literal["mean_pool"] = "mean_pool"
    threshold: float = Field(0.9, gt=0.0, le=1.0)

    def select(self, inputs: SelectionInputs) -> torch.Tensor:
        scores = mean_pool_block_scores(inputs)
        return select_by_cumulative_threshold(scores, inputs.allowed_blocks(), self.threshold)
