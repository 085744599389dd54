"""``antidiagonal``: XAttention's strided antidiagonal block scoring, with the same threshold rule.

Inside every ``stride x stride`` tile of the attention logits, the antidiagonal sum is one dot
product of a reshaped query (``stride`` consecutive queries concatenated in reverse order) with a
reshaped key (``stride`` consecutive keys in order). A softmax over these strided scores, summed per
block, estimates each key block's share of a query block's attention; the fewest blocks reaching
``threshold`` are kept.

Which strided keys enter the softmax follows the layout:

* unsegmented (the ``none`` permuter): XAttention's own estimator (``xattn_estimate`` in
  mit-han-lab/x-attention): a causal mask at the strided level (strided key ``c`` is visible to
  strided query row ``r`` when ``c * stride <= r * stride + (Nk - Nq)``), and the forced sink and
  diagonal blocks count first towards the threshold, as XAttention's ``find_blocks_chunked`` does;
* segmented (every other permuter): Algorithm 2's segment rule. Only the candidate blocks (allowed
  minus the on-diagonal segment, all wholly in the past) enter the softmax, and the forced blocks
  are added after the threshold.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from pbs.components import READS_PREFIX_KEYS, SelectionInputs, SelectorConfig, register_selector
from pbs.reference.logits import grouped_logits
from pbs.reference.block_sets import forced_blocks
from pbs.reference.threshold_select import select_by_cumulative_threshold

_CHUNK_ELEMENTS = 1 << 26


def _strided(x: torch.Tensor, length: int, stride: int, reverse: bool) -> torch.Tensor:
    """``(B, H, N, D)`` zero-padded to ``length`` -> ``(B, H, length / stride, stride * D)``."""
    b, h, n, d = x.shape
    x = F.pad(x.float(), (0, 0, 0, length - n))
    x = x.view(b, h, length // stride, stride, d)
    if reverse:
        x = x.flip(3)
    return x.reshape(b, h, length // stride, stride * d)


def antidiagonal_block_scores(inputs: SelectionInputs, stride: int) -> torch.Tensor:
    """Block shares of attention from strided antidiagonal scores: ``(B, Hq, Tq, Tk)`` float32.

    Rows sum to 1 (a row with no visible strided key is all zero).
    """
    layout = inputs.layout
    bs, tq, tk = layout.block_size, layout.num_query_blocks, layout.num_key_blocks
    per_block = bs // stride
    q_r = _strided(inputs.q, tq * bs, stride, reverse=True)
    k_r = _strided(inputs.k, tk * bs, stride, reverse=False)
    device = k_r.device
    # Strided keys that lie past Nk are padding and get no attention.
    key_start = torch.arange(tk * per_block, device=device) * stride
    key_valid = key_start < layout.seq_len_k
    q_start = torch.arange(tq * per_block, device=device) * stride
    q_valid = q_start < layout.seq_len_q
    candidates = inputs.candidate_blocks()
    b, hq = q_r.shape[:2]
    out = torch.empty(b, hq, tq, tk, dtype=torch.float32, device=device)
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // max(1, b * hq * per_block * tk * per_block))
    for i0 in range(0, tq, rows_per_chunk):
        i1 = min(tq, i0 + rows_per_chunk)
        rows = slice(i0 * per_block, i1 * per_block)
        logits = grouped_logits(q_r[:, :, rows], k_r) * (inputs.scale / stride)
        if layout.segmented:
            visible = candidates[i0:i1].repeat_interleave(per_block, 0).repeat_interleave(per_block, 1)
        elif layout.causal:
            visible = key_start[None, :] <= q_start[rows, None] + layout.query_offset
        else:
            visible = torch.ones(rows.stop - rows.start, key_start.numel(), dtype=torch.bool, device=device)
        visible = visible & key_valid
        probs = logits.masked_fill(~visible, float("-inf")).softmax(-1).nan_to_num_(0.0)
        probs = probs * q_valid[rows, None]
        blocks = probs.view(b, hq, i1 - i0, per_block, tk, per_block).sum((3, 5))
        out[:, :, i0:i1] = blocks / blocks.sum(-1, keepdim=True).clamp(min=1e-30)
    return out


@register_selector
class AntidiagonalSelector(SelectorConfig):
    """XAttention-style selection (stride 8, threshold 0.9 in the paper's comparisons).

    Attributes:
        stride: antidiagonal stride; must divide ``block_size``.
        threshold: attention share ``tau`` in ``(0, 1]``.
    """

    name: Literal["antidiagonal"] = "antidiagonal"
    stride: int = Field(8, ge=1)
    knob: ClassVar[str | None] = "threshold"
    sequence_summaries: ClassVar[frozenset[str] | None] = frozenset({READS_PREFIX_KEYS})
    threshold: float = Field(0.9, gt=0.0, le=1.0)

    def check_compatible(self, config) -> None:
        if config.block_size % self.stride:
            raise ValueError(
                f"antidiagonal stride ({self.stride}) must divide block_size ({config.block_size})"
            )

    def select(self, inputs: SelectionInputs) -> torch.Tensor:
        scores = antidiagonal_block_scores(inputs, self.stride)
        if inputs.layout.segmented:
            return select_by_cumulative_threshold(scores, inputs.candidate_blocks(), self.threshold)
        forced = forced_blocks(inputs.layout, inputs.key_positions, inputs.force_sink_block)
        return select_by_cumulative_threshold(scores, inputs.candidate_blocks(), self.threshold, ranked_first=forced)
