"""The density probe of ``dense_fallback``: a cheap estimate of how dense attention is.

Before planning, `pbs.attention` asks whether the input is clearly too dense for sparse attention
to win (flat attention, e.g. random q and k), so that it can run cuDNN at once instead of paying
for the key permutation and the full selection first. This is the eager twin of
`pbs.kernels.density_probe.probe_density_triton`, which CUDA inputs use.
"""

from __future__ import annotations

import torch


def sampled_query_blocks(num_query_blocks: int, num_samples: int) -> torch.Tensor:
    """``min(num_samples, Tq)`` query blocks evenly spaced from the first to the last (int64).

    ``round(i * (Tq - 1) / (P - 1))`` with halves rounded up, in integers so that the Triton twin
    picks the same blocks; the step is at least 1, so the blocks are distinct.
    """
    p = min(num_samples, num_query_blocks)
    if p <= 1:
        return torch.tensor([num_query_blocks - 1])
    i = torch.arange(p)
    return (2 * i * (num_query_blocks - 1) + (p - 1)) // (2 * (p - 1))


def probe_density(
    q: torch.Tensor, k: torch.Tensor, *, block_size: int, num_blocks: int, threshold: float, scale: float,
    causal: bool = True,
) -> torch.Tensor:
    """A cheap estimate of how dense attention is, from ``num_blocks`` sampled query blocks.

    Each sampled query block (evenly spaced, the last one included) and every key block, in their
    original order, are mean-pooled; a row's softmax runs over its causally visible key blocks,
    and the row keeps, after its sink and diagonal blocks, the fewest other blocks that bring the
    kept pooled mass to ``threshold``. The estimate is the share of visible blocks kept, weighted
    by visible blocks per row: for flat attention (random q, k) about 0.9, for structured
    attention well below. ``threshold >= 1`` keeps every visible block (estimate 1). No K/V copy
    (GQA groups share their key head).

    Args:
        q: ``(B, Hq, Nq, D)``; k: ``(B, Hkv, Nk, D)``.

    Returns:
        A 0-d float32 tensor on ``q``'s device, in ``(0, 1]``.
    """
    if threshold >= 1.0:
        return torch.ones((), dtype=torch.float32, device=q.device)
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    tq, tk = -(-nq // block_size), -(-nk // block_size)
    device = q.device
    rows = sampled_query_blocks(tq, num_blocks)
    p = rows.numel()
    slots = (rows[:, None] * block_size + torch.arange(block_size)).clamp(max=nq - 1)
    counts = (nq - rows * block_size).clamp(max=block_size).to(device)  # rows in each sampled block
    q_rows = q.index_select(2, slots.flatten().to(device)).view(b, hq, p, block_size, d)
    valid = (torch.arange(block_size, device=device)[None, :] < counts[:, None])[..., None]
    q_pooled = (q_rows.float() * valid).sum(3) / counts[:, None]
    full = nk // block_size
    k_pooled = k[:, :, : full * block_size].reshape(b, hkv, full, block_size, d).mean(3, dtype=torch.float32)
    if full < tk:
        k_pooled = torch.cat([k_pooled, k[:, :, full * block_size :].mean(2, keepdim=True, dtype=torch.float32)], 2)
    return probe_density_of_pooled(q_pooled, k_pooled, rows, nq, nk, block_size=block_size, threshold=threshold,
                                   scale=scale, causal=causal)


def probe_density_of_pooled(
    q_pooled: torch.Tensor, k_pooled: torch.Tensor, rows: torch.Tensor, seq_len_q: int, seq_len_k: int, *,
    block_size: int, threshold: float, scale: float, causal: bool = True,
) -> torch.Tensor:
    """`probe_density` from its pooled inputs, for callers that pool elsewhere (context parallelism
    gathers the pooled blocks from the ranks that hold them).

    Args:
        q_pooled: ``(B, Hq, P, D)`` float32 means of the sampled query blocks ``rows``
            (`sampled_query_blocks`).
        k_pooled: ``(B, Hkv, Tk, D)`` float32 means of every key block.
        rows: ``(P,)`` int64 sampled query blocks, on the CPU.
        seq_len_q, seq_len_k: ``Nq`` and ``Nk`` of the call.

    Returns:
        A 0-d float32 tensor on ``q_pooled``'s device.
    """
    if threshold >= 1.0:
        return torch.ones((), dtype=torch.float32, device=q_pooled.device)
    b, hq, p, d = q_pooled.shape
    hkv, tk = k_pooled.shape[1], k_pooled.shape[2]
    group = hq // hkv
    nq, nk, device = seq_len_q, seq_len_k, q_pooled.device
    logits = q_pooled.reshape(b, hkv, group * p, d) @ k_pooled.transpose(-1, -2)
    logits = logits.view(b, hq, p, tk) * scale

    # Block geometry on the host (tiny), then one copy to the device.
    offset = nk - nq
    first_q = offset + rows * block_size
    last_q = offset + (rows * block_size + block_size - 1).clamp(max=nq - 1)
    key_block = torch.arange(tk)
    if causal:
        visible = key_block[None, :] * block_size <= last_q[:, None]
        diagonal = visible & ((key_block[None, :] + 1) * block_size > first_q[:, None])
    else:
        visible = torch.ones(p, tk, dtype=torch.bool)
        diagonal = torch.zeros(p, tk, dtype=torch.bool)
    forced = diagonal | (visible & (key_block[None, :] == 0))
    visible, forced = visible.to(device), forced.to(device)

    probs = logits.masked_fill(~visible, float("-inf")).softmax(-1)
    ranked = (probs + 2.0 * forced).sort(-1, descending=True).values
    ranked = ranked - 2.0 * (ranked >= 2.0)  # the forced blocks' own mass, still first
    mass_before = ranked.cumsum(-1) - ranked
    kept = ((mass_before < threshold) | (torch.arange(tk, device=device) < forced.sum(-1)[:, None]))
    kept = (kept & (torch.arange(tk, device=device) < visible.sum(-1)[:, None])).sum(-1)
    return kept.sum(dtype=torch.float32) / (visible.sum() * b * hq)


