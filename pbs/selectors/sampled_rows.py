"""``sampled_rows``: block mass estimated from the exact attention of a few real query rows per block.

Mean pooling compares block *averages*, so a key block whose one useful key is diluted by the rest
(a copied passage, a retrieved fact, keys mixed by a permutation) looks unimportant. This selector
instead computes the exact softmax row of ``rows_per_block`` real queries of every query block,
spread evenly over the block (the last row included), sums each row per key block and averages
the rows: an unbiased sample of the block's true attention mass, the quantity the ``oracle``
thresholds. The forced blocks (sink and on-diagonal segment) are ranked first and their estimated
mass counts towards ``threshold``, so ``threshold`` reads as the estimated coverage of the true mass.

Cost: ``rows_per_block / block_size`` of the query-key product of dense attention (no P·V), e.g.
1/16 of it for 8 rows of a 128-token block.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from pbs.components import SelectionInputs, SelectorConfig, register_selector
from pbs.reference.block_means import sum_per_key_block
from pbs.reference.logits import grouped_logits
from pbs.reference.block_sets import forced_blocks
from pbs.reference.threshold_select import select_by_cumulative_threshold

_CHUNK_ELEMENTS = 1 << 24


def sampled_row_slots(num_query_blocks: int, block_size: int, seq_len_q: int, rows_per_block: int) -> torch.Tensor:
    """Query slots sampled in every block: ``(Tq, R)`` int64, evenly spaced, ending at the block's last row.

    Rows past ``Nq`` (in a partial last block) are clamped to the last query, so they repeat it.
    """
    step = block_size / rows_per_block
    offsets = torch.tensor([round(step * (r + 1)) - 1 for r in range(rows_per_block)])
    starts = torch.arange(num_query_blocks)[:, None] * block_size
    return (starts + offsets[None, :]).clamp(max=seq_len_q - 1)


def sampled_block_mass(inputs: SelectionInputs, rows_per_block: int) -> torch.Tensor:
    """Average over sampled rows of each query block of the exact attention mass per key block.

    Returns:
        ``(B, Hq, Tq, Tk)`` float32; each row sums to 1 over the allowed blocks.
    """
    layout = inputs.layout
    bs, tq, tk, nk = layout.block_size, layout.num_query_blocks, layout.num_key_blocks, layout.seq_len_k
    q, k = inputs.q, inputs.k
    b, hq = q.shape[:2]
    hk = k.shape[1]
    group = hq // hk
    slots = sampled_row_slots(tq, bs, layout.seq_len_q, rows_per_block).to(q.device)  # (Tq, R)
    key_pos = inputs.key_positions.repeat_interleave(group, dim=1) if group > 1 else inputs.key_positions
    out = torch.empty(b, hq, tq, tk, dtype=torch.float32, device=q.device)
    blocks_per_chunk = max(1, _CHUNK_ELEMENTS // max(1, b * hq * rows_per_block * nk))
    for i0 in range(0, tq, blocks_per_chunk):
        i1 = min(tq, i0 + blocks_per_chunk)
        rows = slots[i0:i1].reshape(-1)
        logits = grouped_logits(q[:, :, rows], k) * inputs.scale  # (B, Hq, M, Nk)
        if layout.causal:
            q_pos = inputs.query_positions[:, :, rows]
            logits = logits.masked_fill(key_pos[:, :, None, :] > q_pos[..., None], float("-inf"))
        probs = logits.softmax(-1)
        per_block = sum_per_key_block(probs, bs)  # (B, Hq, m * R, Tk)
        out[:, :, i0:i1] = per_block.view(b, hq, i1 - i0, rows_per_block, tk).mean(3)
    return out


@register_selector
class SampledRowsSelector(SelectorConfig):
    """Cumulative threshold on the exact block mass of ``rows_per_block`` sampled queries per block.

    Attributes:
        rows_per_block: sampled query rows per query block (1 to ``block_size``).
        threshold: estimated share of the true attention mass to keep, in ``(0, 1]``; the forced
            blocks count towards it.
    """

    name: Literal["sampled_rows"] = "sampled_rows"
    rows_per_block: int = Field(8, ge=1)
    knob: ClassVar[str | None] = "threshold"
    threshold: float = Field(0.9, gt=0.0, le=1.0)

    def check_compatible(self, config) -> None:
        if self.rows_per_block > config.block_size:
            raise ValueError(
                f"sampled_rows.rows_per_block ({self.rows_per_block}) must be at most block_size ({config.block_size})"
            )

    def select(self, inputs: SelectionInputs) -> torch.Tensor:
        mass = sampled_block_mass(inputs, self.rows_per_block)
        forced = forced_blocks(inputs.layout, inputs.key_positions, inputs.force_sink_block)
        return select_by_cumulative_threshold(mass, inputs.allowed_blocks(), self.threshold, ranked_first=forced)
