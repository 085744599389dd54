"""Applying a key permutation to K and V: the eager twin of `pbs.kernels.gather.gather_kv`."""

from __future__ import annotations

import torch


def gather_kv(indices: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k, v)`` rows reordered by ``indices``: slot ``t`` of head ``h`` takes row ``indices[b, h, t]``
    of KV head ``h * Hkv // H``.

    Args:
        indices: ``(B, H, Nk)`` int64 with ``H % Hkv == 0`` (``H > Hkv`` in ``per_head`` mode).
        k: ``(B, Hkv, Nk, D)``; v: ``(B, Hkv, Nk, Dv)``.

    Returns:
        ``(B, H, Nk, D)`` and ``(B, H, Nk, Dv)``.
    """
    heads = indices.shape[1]
    group = heads // k.shape[1]

    def take(x: torch.Tensor) -> torch.Tensor:
        x = x.repeat_interleave(group, dim=1) if group > 1 else x
        return torch.gather(x, 2, indices[..., None].expand(*indices.shape, x.shape[-1]))

    return take(k), take(v)
