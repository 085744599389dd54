"""Pooled key blocks on the planners' device: the Triton kernel on CUDA, the eager twin elsewhere
(for callers that pool outside a planner, as context parallelism pools each rank's keys)."""

from __future__ import annotations

import torch

from pbs.backends.eligibility import triton_installed
from pbs.reference.block_means import block_means as block_means_eager
from pbs.types import Permutation


def block_means(x: torch.Tensor, block_size: int, indices: torch.Tensor | None = None) -> torch.Tensor:
    """Pooled key blocks of ``x`` (through the permutation ``indices`` when given): the same pooling
    as the planners of this device, the Triton kernel on CUDA and the eager twin elsewhere.

    ``x``: ``(B, H, n, D)``; ``indices``: ``(B, H, n)`` or None; returns ``(B, H, ceil(n / block_size),
    D)`` float32.
    """
    if x.is_cuda and triton_installed():
        from pbs.kernels.block_means import block_means as block_means_kernel

        return block_means_kernel(x, block_size, indices)
    if indices is not None:
        x = Permutation(indices, indices).apply(x)  # only the indices are read
    return block_means_eager(x.contiguous(), block_size)
