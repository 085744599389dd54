"""The dense policy's launches (`pbs.dense`): which implementation estimates a call's density,
the gated dense kernel queued behind the probe, and the Gluon kernel in dense mode for the calls
that SDPA serves slowly.

The rules that read these numbers (``kept / visible > max_density``) live in `pbs.dense`; this
module only decides where the numbers are computed, so that no floor above the dispatch layer
launches a kernel.
"""

from __future__ import annotations

from typing import Any

import torch

from pbs.backends.eligibility import dense_kernel_reasons, gated_dense_reasons, probe_kernel_reasons
from pbs.backends.registry import CallSpec
from pbs.reference.density_probe import probe_density
from pbs.types import is_paged


def probe_estimate(q: torch.Tensor, k: Any, args: dict[str, Any]) -> torch.Tensor | float:
    """The probe's estimate over ``q (B, Hq, Nq, D)`` and ``k (B, Hkv, Nk, D)`` (or a paged
    sequence, `pbs.types.PagedTensor`): a float from the Triton kernel on CUDA (it reads its two
    counters), else a 0-d tensor not yet read (`pbs.reference.density_probe.probe_density`).

    Args:
        args: `pbs.dense.DensePolicy.probe_arguments`.
    """
    if q.is_cuda and not probe_kernel_reasons(q.device, q.shape[-1]):
        from pbs.kernels.density_probe import probe_density_triton

        if is_paged(k):  # pooled in place, from the pages
            return probe_density_triton(q, k.cache, **args, block_table=k.block_table, seq_len_k=k.length)
        return probe_density_triton(q, k, **args)
    return probe_density(q, k.gather() if is_paged(k) else k, **args)


def dense_kernel_available(q: torch.Tensor, head_dim_v: int) -> bool:
    """Whether `dense_kernel_attention` can run ``q (B, Hq, Nq, D)`` (a Hopper GPU, contiguous
    keys) and fills every SM at least once (``B * Hq * ceil(Nq / 128)`` tiles): with fewer query
    tiles, a decode step for instance, each program would walk every key alone."""
    if not q.is_cuda:
        return False
    from pbs.kernels._common import sm_count
    from pbs.kernels.hopper_attn import BLOCK_SIZE

    tiles = q.shape[0] * q.shape[1] * -(-q.shape[2] // BLOCK_SIZE)
    return tiles >= sm_count(q.device) and not dense_kernel_reasons(CallSpec.of(q, head_dim_v, BLOCK_SIZE))


def dense_kernel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool) -> torch.Tensor:
    """Dense attention by the Gluon kernel in dense mode (`pbs.kernels.hopper_attn.launch_hopper_dense`):
    every visible key, queries the last ``Nq`` of the ``Nk`` positions.

    Args:
        q: ``(B, Hq, Nq, D)``; k: ``(B, Hkv, Nk, D)``; v: ``(B, Hkv, Nk, D)``, where
            `dense_kernel_available` holds.

    Returns:
        ``(B, Hq, Nq, D)`` in ``q``'s dtype.
    """
    from pbs.kernels._common import descriptor_ready, sm_count
    from pbs.kernels.hopper_attn import launch_hopper_dense

    out = torch.empty(*q.shape[:3], v.shape[-1], dtype=q.dtype, device=q.device)
    with torch.cuda.device(q.device):  # Triton launches on the current GPU; q may be on another
        launch_hopper_dense(*(descriptor_ready(x) for x in (q, k, v)), out, scale=scale, causal=causal,
                            sm_count=sm_count(q.device))
    return out


def gated_dense_available(q: torch.Tensor, head_dim_v: int, block_size: int, page_size: int | None) -> bool:
    """Whether `probe_then_gated_dense` can run this call (a Hopper GPU, contiguous keys)."""
    return q.is_cuda and not gated_dense_reasons(CallSpec.of(q, head_dim_v, block_size, page_size=page_size))


def probe_then_gated_dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: dict[str, Any], *, causal: bool, gate_limit: int
) -> tuple[torch.Tensor, tuple[int, int]]:
    """The probe's counters, and the Gluon kernel in dense mode queued behind them, gated on the
    GPU by ``kept * 2**20 > gate_limit * visible``: ``(out (B, Hq, Nq, Dv), (kept, visible))``.

    The host waits for the counters' copy only, not for the dense kernel; ``out`` holds dense
    attention where the gate opened and is unwritten otherwise.
    """
    from pbs.kernels._common import descriptor_ready, sm_count
    from pbs.kernels.density_probe import probe_counters_triton
    from pbs.kernels.hopper_attn import launch_hopper_dense

    counters = probe_counters_triton(q, k, **args)
    host_counters = torch.empty(2, dtype=torch.int32, pin_memory=True)
    host_counters.copy_(counters[:2], non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    out = torch.empty(*q.shape[:3], v.shape[-1], dtype=q.dtype, device=q.device)
    launch_hopper_dense(*(descriptor_ready(x) for x in (q, k, v)), out, scale=args["scale"], causal=causal,
                        sm_count=sm_count(q.device), gate=counters, gate_limit=gate_limit)
    copied.synchronize()
    kept, visible = host_counters.tolist()
    return out, (kept, visible)
