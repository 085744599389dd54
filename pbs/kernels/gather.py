"""Applying a key permutation to K and V in one pass: the fast twin of `pbs.types.Permutation.apply`.

``torch.gather`` with an index expanded over the head dim reads an int64 index per element; this
kernel reads one index per row and copies whole rows of K and V together.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from pbs.kernels._common import COMPILE_OPTIONS


@triton.jit
def _gather_rows_kernel(
    idx_ptr,
    k_ptr,
    v_ptr,
    k_out_ptr,
    v_out_ptr,
    stride_ib,
    stride_ih,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    heads,
    group,
    seq_len,
    dim_k,
    dim_v,
    BLOCK_T: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // heads
    i_h = i_bh % heads
    i_hx = i_h // group  # input head of this output head (per-head GQA replicates K/V)
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    m_t = o_t < seq_len
    b_src = tl.load(idx_ptr + i_b.to(tl.int64) * stride_ib + i_h.to(tl.int64) * stride_ih + o_t, mask=m_t, other=0)

    o_dk = tl.arange(0, BLOCK_DK)
    m_k = m_t[:, None] & (o_dk[None, :] < dim_k)
    p_k = k_ptr + i_b.to(tl.int64) * stride_kb + i_hx.to(tl.int64) * stride_kh + b_src[:, None] * stride_kn + o_dk[None, :]
    p_k_out = k_out_ptr + i_bh.to(tl.int64) * seq_len * dim_k + o_t[:, None].to(tl.int64) * dim_k + o_dk[None, :]
    tl.store(p_k_out, tl.load(p_k, mask=m_k), mask=m_k)

    o_dv = tl.arange(0, BLOCK_DV)
    m_v = m_t[:, None] & (o_dv[None, :] < dim_v)
    p_v = v_ptr + i_b.to(tl.int64) * stride_vb + i_hx.to(tl.int64) * stride_vh + b_src[:, None] * stride_vn + o_dv[None, :]
    p_v_out = v_out_ptr + i_bh.to(tl.int64) * seq_len * dim_v + o_t[:, None].to(tl.int64) * dim_v + o_dv[None, :]
    tl.store(p_v_out, tl.load(p_v, mask=m_v), mask=m_v)


def gather_kv(indices: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Permutes K and V rows in one launch.

    Args:
        indices: ``(B, H, N)`` int64, slot ``t`` of head ``h`` takes original row ``indices[b, h, t]``.
        k: ``(B, Hx, N, D)`` with ``H % Hx == 0`` (unit stride along D).
        v: ``(B, Hx, N, Dv)`` (unit stride along Dv).

    Returns:
        ``(k_perm, v_perm)``, contiguous ``(B, H, N, D)`` and ``(B, H, N, Dv)``:
        ``k_perm[b, h, t] = k[b, h * Hx // H, indices[b, h, t]]`` (the same for ``v``).
    """
    b, h, n = indices.shape
    hx, d, dv = k.shape[1], k.shape[-1], v.shape[-1]
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if indices.stride(-1) != 1:
        indices = indices.contiguous()
    k_out = torch.empty(b, h, n, d, dtype=k.dtype, device=k.device)
    v_out = torch.empty(b, h, n, dv, dtype=v.dtype, device=v.device)
    block_dk, block_dv = triton.next_power_of_2(d), triton.next_power_of_2(dv)
    # About 16 KB of each tensor per program: enough bytes in flight per SM to stream at HBM speed.
    block_t = max(8, min(128, 8192 // max(block_dk, block_dv)))
    grid = (triton.cdiv(n, block_t), b * h)
    _gather_rows_kernel[grid](
        indices, k, v, k_out, v_out,
        indices.stride(0), indices.stride(1),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        h, h // hx, n, d, dv,
        BLOCK_T=block_t, BLOCK_DK=block_dk, BLOCK_DV=block_dv,
        num_warps=4,
        **COMPILE_OPTIONS,
    )
    return k_out, v_out
