"""True attention mass per (query block, key block): the ground truth for coverage and the oracle."""

from __future__ import annotations

import torch

from pbs.layout import Layout
from pbs.reference.block_means import sum_per_key_block
from pbs.reference.logits import grouped_logits

_CHUNK_ELEMENTS = 1 << 22


def block_attention_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    layout: Layout,
    scale: float | None = None,
) -> torch.Tensor:
    """Share of each query block's exact attention that falls in each key block.

    Every query's softmax row (causal on original positions) is summed per key block and the rows
    of a query block are averaged, so each row of the result sums to 1.

    Args:
        q: ``(B, Hq, Nq, D)`` queries in permuted order.
        k: ``(B, Hk, Nk, D)`` keys in permuted order.
        query_positions: ``(B, Hq, Nq)`` original positions of the query slots.
        key_positions: ``(B, Hk, Nk)`` original positions of the key slots.
        layout: geometry of the call.
        scale: softmax scale, default ``D ** -0.5``.

    Returns:
        ``(B, Hq, Tq, Tk)`` float32.
    """
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    bs, tq, tk = layout.block_size, layout.num_query_blocks, layout.num_key_blocks
    scale = d**-0.5 if scale is None else scale
    group = hq // hk
    kpos = key_positions.repeat_interleave(group, dim=1) if group > 1 else key_positions
    out = torch.zeros(b, hq, tq, tk, dtype=torch.float32, device=q.device)
    rows = max(bs, (_CHUNK_ELEMENTS // max(1, b * hq * nk)) // bs * bs)
    for r0 in range(0, nq, rows):
        r1 = min(nq, r0 + rows)
        logits = grouped_logits(q[:, :, r0:r1], k) * scale
        if layout.causal:
            future = kpos[:, :, None, :] > query_positions[:, :, r0:r1, None]
            logits = logits.masked_fill(future, float("-inf"))
        probs = logits.softmax(-1)
        probs = sum_per_key_block(probs, bs)
        block_of_row = torch.arange(r0, r1, device=q.device) // bs
        out.index_add_(2, block_of_row, probs)
    rows_per_block = torch.full((tq,), float(bs), dtype=torch.float32, device=q.device)
    rows_per_block[-1] = nq - (tq - 1) * bs
    return out / rows_per_block[:, None]


def attention_coverage(mass: torch.Tensor, dense_mask: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Fraction of the exact attention mass that the selected blocks capture, per (batch, head).

    Args:
        mass: ``(B, Hq, Tq, Tk)`` from `block_attention_mass`.
        dense_mask: ``(B, Hq, Tq, Tk)`` bool selected blocks.
        layout: geometry (weights each query block by its number of queries).

    Returns:
        ``(B, Hq)`` float32 in ``[0, 1]``.
    """
    per_block = (mass * dense_mask).sum(-1)
    bs, tq, nq = layout.block_size, layout.num_query_blocks, layout.seq_len_q
    weights = torch.full((tq,), float(bs), dtype=torch.float32, device=mass.device)
    weights[-1] = nq - (tq - 1) * bs
    return (per_block * weights).sum(-1) / nq
