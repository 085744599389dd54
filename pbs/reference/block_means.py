"""Block means: the eager twin of `pbs.kernels.block_means.block_means`."""

from __future__ import annotations

import torch

from pbs.layout import cdiv


def block_means(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Mean over blocks of ``block_size`` tokens along dim -2 (a partial last block averages what it has).

    Args:
        x: ``(B, H, N, D)``.

    Returns:
        ``(B, H, ceil(N / block_size), D)`` float32.
    """
    b, h, n, d = x.shape
    nb = cdiv(n, block_size)
    pad = nb * block_size - n
    xf = x.float()
    if pad:
        xf = torch.nn.functional.pad(xf, (0, 0, 0, pad))
    sums = xf.view(b, h, nb, block_size, d).sum(3)
    counts = torch.full((nb,), float(block_size), dtype=torch.float32, device=x.device)
    counts[-1] = block_size - pad
    return sums / counts[:, None]


def sum_per_key_block(probs: torch.Tensor, block_size: int) -> torch.Tensor:
    """Sums the last axis (keys) over blocks of ``block_size`` keys (a partial last block sums what
    it has): ``(..., Nk)`` to ``(..., ceil(Nk / block_size))``."""
    nk = probs.shape[-1]
    tk = cdiv(nk, block_size)
    padded = torch.nn.functional.pad(probs, (0, tk * block_size - nk))
    return padded.view(*probs.shape[:-1], tk, block_size).sum(-1)
