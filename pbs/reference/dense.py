"""Dense attention in fp32: the oracle every other path is judged against."""

from __future__ import annotations

import torch

from pbs.validation import check_attention_shapes

_CHUNK_ELEMENTS = 1 << 26
_SHAPES = {"q": "(B, Hq, Nq, D)", "k": "(B, Hkv, Nk, D)", "v": "(B, Hkv, Nk, Dv)"}


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

    Raises:
        TypeError: a non-tensor.
        ValueError: shapes that break the rules of `pbs.validation.check_qkv` (e.g. ``Nq > Nk``,
            which would leave the first queries with no key, or ``Hq % Hkv != 0``).
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions {_SHAPES[name]}, got shape {tuple(x.shape)}")
    check_attention_shapes(q, k, v)
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
