"""Gathering keys and values into a plan's key order: the fused Triton gather on CUDA, else
``torch.gather``."""

from __future__ import annotations

import torch

from pbs.backends.eligibility import triton_installed
from pbs.types import Permutation


def permute_keys_and_values(
    perm: Permutation, k: torch.Tensor, v: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(perm.apply(k), perm.apply(v))``, in one fused launch on CUDA when Triton is there.

    The fused gather reads one index per row instead of one per element (docs/notes.md has its
    measurement against ``torch.gather``).
    """
    if perm.is_identity and k.shape[1] == perm.heads:
        return k, v
    if v is not None and k.is_cuda and triton_installed():
        from pbs.kernels.gather import gather_kv

        return gather_kv(perm.indices, k, v)
    return perm.apply(k), (perm.apply(v) if v is not None else None)
