"""Padding a packed or paged batch into token-major buffers (the capturable varlen path): the Triton
kernel on CUDA, else the eager twin.

Both return the same ``(N, H, rows, D)`` view of a token-major ``(N, rows, H, D)`` buffer with zeros
past each length (`pbs.reference.pad_rows` says how each sequence is found); neither reads a tensor
on the host. The kernel writes every padded row once, in one launch per tensor; the eager twin
zero-fills and then scatters. This module is the one place that picks between them.
"""

from __future__ import annotations

import torch

from pbs.backends.eligibility import triton_installed
from pbs.reference import pad_rows as eager


def pad_packed(x: torch.Tensor, cu_seq: torch.Tensor, rows: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Sequences ``x[cu_seq[i] : cu_seq[i + 1]]`` of packed ``x (T, H, D)`` as ``(N, H, rows, D)``,
    zeros past each length, written into the token-major ``(N, rows, H, D)`` ``out`` when given
    (`pbs.reference.pad_rows.pad_packed` has the arguments)."""
    if _kernel_runs(x):
        from pbs.kernels.pad_rows import pad_packed as kernel

        return kernel(x, cu_seq, rows, out=out)
    return eager.pad_packed(x, cu_seq, rows, out=out)


def pad_paged(cache: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor, rows: int, *,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """The first ``lengths[i]`` keys of each sequence of a paged ``cache (num_pages, page_size, H, D)``,
    through ``block_table (N, max_pages)``, as ``(N, H, rows, D)`` with zeros past each length
    (`pbs.reference.pad_rows.pad_paged` has the arguments)."""
    if _kernel_runs(cache):
        from pbs.kernels.pad_rows import pad_paged as kernel

        return kernel(cache, block_table, lengths, rows, out=out)
    return eager.pad_paged(cache, block_table, lengths, rows, out=out)


def _kernel_runs(x: torch.Tensor) -> bool:
    """The kernel runs on CUDA with Triton, for inputs whose token rows are contiguous (a cache
    view with another layout takes the eager twin rather than a copy of the whole cache)."""
    if not (x.is_cuda and triton_installed()):
        return False
    from pbs.kernels.pad_rows import rows_are_contiguous

    return rows_are_contiguous(x)
