"""``pooled_query``: block mass from the exact attention of each query block's mean query over every key.

`mean_pool` pools both sides, so a key block whose one useful key is diluted by the others looks
unimportant; `sampled_rows` keeps the keys exact but pays for several real query rows per block.
This selector sits between them: the mean of each query block's rows attends to every key
(token-level, causally up to the block's last query position), and the softmax is summed per key
block. That is one row per query block, the cost of `sampled_rows` with ``rows_per_block=1``
(1/128 of dense attention's query-key product at block 128), while a mixed key block still shows
its best key. The forced blocks (sink and on-diagonal segment) rank first and their estimated
mass counts towards ``threshold``, as in `sampled_rows`.

The softmax of the mean query is not the mean of the rows' softmaxes: where the rows of a block
attend to different keys (a copied passage, say), the mean query spreads its mass more thinly
than they do.

Reference implementation only: on CUDA it runs this PyTorch code (correct, not fast). Its GPU
version would be the `sampled_rows` kernel (`pbs.kernels.sampled_rows`) fed one pooled row per
block; its quality on the real model is in docs/quality.md.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from pbs.components import SelectionInputs, SelectorConfig, register_selector
from pbs.reference.block_means import block_means, sum_per_key_block
from pbs.reference.block_sets import forced_blocks
from pbs.reference.logits import grouped_logits
from pbs.reference.threshold_select import select_by_cumulative_threshold

_CHUNK_ELEMENTS = 1 << 24


def pooled_query_block_mass(inputs: SelectionInputs) -> torch.Tensor:
    """Each query block's mean query, softmax over the keys it may see, summed per key block.

    Returns:
        ``(B, Hq, Tq, Tk)`` float32; each row sums to 1 over the allowed blocks.
    """
    layout = inputs.layout
    bs, tq, tk, nk = layout.block_size, layout.num_query_blocks, layout.num_key_blocks, layout.seq_len_k
    q, k = inputs.q, inputs.k
    b, hq = q.shape[:2]
    group = hq // k.shape[1]
    pooled = block_means(q, bs)  # (B, Hq, Tq, D) fp32
    last_position = block_max_positions(inputs.query_positions, bs)  # (B, Hq or 1, Tq)
    key_pos = inputs.key_positions.repeat_interleave(group, dim=1) if group > 1 else inputs.key_positions
    out = torch.empty(b, hq, tq, tk, dtype=torch.float32, device=q.device)
    blocks_per_chunk = max(1, _CHUNK_ELEMENTS // max(1, b * hq * nk))
    for i0 in range(0, tq, blocks_per_chunk):
        i1 = min(tq, i0 + blocks_per_chunk)
        logits = grouped_logits(pooled[:, :, i0:i1], k) * inputs.scale  # (B, Hq, m, Nk)
        if layout.causal:
            visible_to = last_position[:, :, i0:i1, None]
            logits = logits.masked_fill(key_pos[:, :, None, :] > visible_to, float("-inf"))
        probs = logits.softmax(-1)
        out[:, :, i0:i1] = sum_per_key_block(probs, bs)
    return out


def block_max_positions(positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The largest original position in each block of query slots: ``(B, H, Tq)`` from ``(B, H, Nq)``."""
    b, h, n = positions.shape
    tq = -(-n // block_size)
    padded = torch.nn.functional.pad(positions, (0, tq * block_size - n), value=-1)
    return padded.view(b, h, tq, block_size).amax(-1)


@register_selector
class PooledQuerySelector(SelectorConfig):
    """Cumulative threshold on the block mass of each query block's mean query attending to every key.

    Attributes:
        threshold: estimated share of the attention mass to keep, in ``(0, 1]``; the forced
            blocks count towards it.
    """

    name: Literal["pooled_query"] = "pooled_query"
    knob: ClassVar[str | None] = "threshold"
    threshold: float = Field(0.9, gt=0.0, le=1.0)

    def select(self, inputs: SelectionInputs) -> torch.Tensor:
        mass = pooled_query_block_mass(inputs)
        forced = forced_blocks(inputs.layout, inputs.key_positions, inputs.force_sink_block)
        return select_by_cumulative_threshold(mass, inputs.allowed_blocks(), self.threshold, ranked_first=forced)
