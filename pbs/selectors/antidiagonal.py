"""``antidiagonal``: XAttention's strided antidiagonal block scoring, with the same threshold rule.

Inside every ``stride x stride`` tile of the attention logits, the antidiagonal sum is one dot
product of a reshaped query (``stride`` consecutive queries concatenated in reverse order) with a
reshaped key (``stride`` consecutive keys in order). A softmax over these strided scores, summed per
block, estimates each key block's share of a query block's attention; the fewest blocks reaching
``threshold`` are kept.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from pbs.components import SelectionInputs, SelectorConfig, register_selector
from pbs.permuters._segments import grouped_logits
from pbs.selectors._threshold import select_by_cumulative_threshold

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
    """Block shares of attention from strided antidiagonal scores: ``(B, Hq, Tq, Tk)`` float32."""
    layout = inputs.layout
    bs, tq, tk = layout.block_size, layout.num_query_blocks, layout.num_key_blocks
    per_block = bs // stride
    q_r = _strided(inputs.q, tq * bs, stride, reverse=True)
    k_r = _strided(inputs.k, tk * bs, stride, reverse=False)
    allowed = inputs.allowed_blocks()
    # Strided keys that lie past Nk are padding and get no attention.
    key_valid = (torch.arange(tk * per_block, device=k_r.device) * stride) < layout.seq_len_k
    q_valid = (torch.arange(tq * per_block, device=q_r.device) * stride) < layout.seq_len_q
    b, hq = q_r.shape[:2]
    out = torch.empty(b, hq, tq, tk, dtype=torch.float32, device=q_r.device)
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // max(1, b * hq * per_block * tk * per_block))
    for i0 in range(0, tq, rows_per_chunk):
        i1 = min(tq, i0 + rows_per_chunk)
        logits = grouped_logits(q_r[:, :, i0 * per_block : i1 * per_block], k_r) * (inputs.scale / stride)
        mask = allowed[i0:i1].repeat_interleave(per_block, 0).repeat_interleave(per_block, 1) & key_valid
        probs = logits.masked_fill(~mask, float("-inf")).softmax(-1).nan_to_num_(0.0)
        probs = probs * q_valid[i0 * per_block : i1 * per_block, None]
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
    threshold: float = Field(0.9, gt=0.0, le=1.0)

    def check_compatible(self, config) -> None:
        if config.block_size % self.stride:
            raise ValueError(
                f"antidiagonal stride ({self.stride}) must divide block_size ({config.block_size})"
            )

    def select(self, inputs: SelectionInputs) -> torch.Tensor:
        scores = antidiagonal_block_scores(inputs, self.stride)
        return select_by_cumulative_threshold(scores, inputs.allowed_blocks(), self.threshold)
