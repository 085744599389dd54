"""``mean_pool``: MeanPooling block selection (the paper's "Block Selection" appendix, Algorithm 2).

Queries and keys are mean-pooled per block (a partial last block averages the tokens it has); a
softmax over the pooled scores estimates each key block's share of a query block's attention, and
the fewest blocks reaching ``threshold`` of that share are kept.

The softmax and the threshold range over the *candidate* blocks, Algorithm 2's causal mask ``C``:
with segmented permutation, the causally allowed blocks minus the query block's on-diagonal
segment ("If segmented permutation is applied, this mask also includes the on-diagonal segments"),
which is always computed anyway; with the ``none`` permuter (the paper's unpermuted MeanPooling
baseline), every causally allowed block, the diagonal block included. The sink block stays in the
softmax. A query block without candidates (the first segment) selects nothing here; the forced
blocks are added afterwards by planning.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from pbs.components import SelectionInputs, SelectorConfig, register_selector
from pbs.reference.logits import grouped_logits
from pbs.reference.block_means import block_means
from pbs.reference.threshold_select import select_by_cumulative_threshold


def pooled_keys(inputs: SelectionInputs) -> torch.Tensor | None:
    """The whole sequence's pooled keys for the call's ``Tk`` key blocks, ``(B, Hk, Tk, D)``, when
    the call plans part of a sequence (`pbs.components.SequenceSummaries`); else None."""
    summaries = inputs.summaries
    if summaries is None or summaries.key_block_means is None:
        return None
    return summaries.key_block_means[:, :, : inputs.layout.num_key_blocks]


def mean_pool_block_scores(inputs: SelectionInputs) -> torch.Tensor:
    """``softmax(Q_bar K_bar^T * scale + C)``: ``(B, Hq, Tq, Tk)`` float32.

    Rows sum to 1 over the candidate blocks; a row without candidates is all zero.
    """
    bs = inputs.layout.block_size
    q_bar = block_means(inputs.q, bs)
    k_bar = pooled_keys(inputs)
    if k_bar is None:
        k_bar = block_means(inputs.k, bs)
    logits = grouped_logits(q_bar, k_bar) * inputs.scale
    candidates = inputs.candidate_blocks()
    return logits.masked_fill(~candidates, float("-inf")).softmax(-1).nan_to_num(0.0)


@register_selector
class MeanPoolSelector(SelectorConfig):
    """Cumulative-threshold selection on mean-pooled block attention.

    Attributes:
        threshold: attention share ``tau`` in ``(0, 1]`` the selected blocks must reach (paper: 0.9).
    """

    name: Literal["mean_pool"] = "mean_pool"
    knob: ClassVar[str | None] = "threshold"
    sequence_summaries: ClassVar[frozenset[str] | None] = frozenset({"key_block_means"})
    threshold: float = Field(0.9, gt=0.0, le=1.0)

    def select(self, inputs: SelectionInputs) -> torch.Tensor:
        scores = mean_pool_block_scores(inputs)
        return select_by_cumulative_threshold(scores, inputs.candidate_blocks(), self.threshold)
