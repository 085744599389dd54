"""Dense attention in fp32: the oracle every other path is judged against."""

from __future__ import annotations

import torch

_CHUNK_ELEMENTS = 1 << 26


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Exact softmax attention computed in fp32, GQA by grouping (K/V are never copied per head).

    Queries are the last ``Nq`` positions of the ``Nk`` keys (query ``i`` sits at position
    ``Nk - Nq + i``), so ``causal`` also covers a chunk that continues a cached prefix.

    Args:
        q: ``(B, Hq, Nq, D)``.
        k: ``(B, Hkv, Nk, D)`` with ``Hq % Hkv == 0`` and ``Nq <= Nk``.
        v: ``(B, Hkv, Nk, Dv)``.
        causal: mask keys after each query's position.
        scale: softmax scale, default ``D ** -0.5``.

    Returns:
        ``(B, Hq, Nq, Dv)`` float32.
    """
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    group = hq // hkv
    scale = d**-0.5 if scale is None else scale
    qf = q.float().view(b, hkv, group, nq, d)
    kf, vf = k.float(), v.float()
    out = torch.empty(b, hkv, group, nq, v.shape[-1], dtype=torch.float32, device=q.device)
    key_pos = torch.arange(nk, device=q.device)
    rows = max(1, _CHUNK_ELEMENTS // max(1, b * hq * nk))
    for r0 in range(0, nq, rows):
        r1 = min(nq, r0 + rows)
        logits = torch.einsum("bhgqd,bhkd->bhgqk", qf[:, :, :, r0:r1], kf) * scale
        if causal:
            query_pos = torch.arange(r0, r1, device=q.device) + (nk - nq)
            logits = logits.masked_fill(key_pos[None, :] > query_pos[:, None], float("-inf"))
        probs = logits.softmax(-1)
        out[:, :, :, r0:r1] = torch.einsum("bhgqk,bhkd->bhgqd", probs, vf)
    return out.view(b, hq, nq, v.shape[-1])
