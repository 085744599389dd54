"""Query-key logits for grouped-query attention, shared by the reference permuters and selectors."""

from __future__ import annotations

import torch


def grouped_logits(queries: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``queries @ k^T`` in fp32 where ``queries`` has a multiple of ``k``'s heads, without copying K.

    Args:
        queries: ``(B, Hs, M, D)``.
        k: ``(B, Hkv, N, D)`` with ``Hs % Hkv == 0``.

    Returns:
        ``(B, Hs, M, N)`` float32.
    """
    b, hs, m, d = queries.shape
    hkv = k.shape[1]
    grouped = queries.float().view(b, hkv, hs // hkv, m, d)
    logits = torch.einsum("bhgmd,bhnd->bhgmn", grouped, k.float())
    return logits.reshape(b, hs, m, k.shape[2])
