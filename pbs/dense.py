"""Dense attention through SDPA, and the policy that decides when ``auto`` should use it instead of PBS.

Sparse attention only pays when the skipped blocks cost more than planning: at short lengths and at
high selected densities cuDNN's dense kernel wins (docs/benchmarks.md has the measured crossover).
`DenseFallback` says where the line is; this module applies it.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from pbs.config import PBSConfig
from pbs.types import Plan

logger = logging.getLogger("pbs")

_LOGGED: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.info(message)


def _preferred_backends() -> list:
    from torch.nn.attention import SDPBackend

    # cuDNN first: the fastest dense causal prefill on Hopper (ARCHITECTURE.md, docs/benchmarks.md).
    return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def dense_attention_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool = True
) -> torch.Tensor:
    """Dense attention with PBS's conventions, through ``scaled_dot_product_attention``.

    Queries are the last ``Nq`` of the ``Nk`` positions (bottom-right causal alignment), and GQA is
    handled by SDPA's ``enable_gqa`` (no copy of K/V).

    Args:
        q: ``(B, Hq, Nq, D)``; k: ``(B, Hkv, Nk, D)``; v: ``(B, Hkv, Nk, Dv)``.

    Returns:
        ``(B, Hq, Nq, Dv)`` in ``q``'s dtype.
    """
    nq, nk = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    mask = None
    is_causal = causal and nq == nk
    if causal and nq != nk:
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(nq, nk)
    if q.is_cuda:
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(_preferred_backends(), set_priority=True):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa)


def policy_applies(config: PBSConfig, device: torch.device) -> bool:
    """Whether ``config.dense_fallback`` may replace PBS on ``device`` (``backend="auto"`` only)."""
    return config.backend == "auto" and device.type in config.dense_fallback.devices


def length_fallback_reason(config: PBSConfig, q: torch.Tensor, k: torch.Tensor) -> str | None:
    """Why dense attention should run before any planning (too few keys), or None."""
    if not policy_applies(config, q.device):
        return None
    limit = config.dense_fallback.min_seq_len
    if k.shape[2] < limit:
        return f"Nk = {k.shape[2]} is below dense_fallback.min_seq_len = {limit}"
    return None


def density_fallback_reason(config: PBSConfig, plan: Plan) -> str | None:
    """Why dense attention should run although a plan exists (density too high), or None.

    Reads the plan's density on the host (one sync); while a CUDA graph is being captured that is
    impossible, so the rule is skipped then (logged once) and the graph always runs sparse.
    """
    limit = config.dense_fallback.max_density
    device = plan.mask.counts.device
    if limit is None or not policy_applies(config, device):
        return None
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        _log_once("pbs: dense_fallback.max_density is not applied inside a CUDA graph capture (it needs a host sync)")
        return None
    # One reduction and one read on the host (Plan.density would take several small ops).
    layout = plan.layout
    selected = int(plan.mask.counts.sum(dtype=torch.int64))
    density = selected / (layout.batch * layout.heads_q * layout.total_allowed_blocks)
    if density > limit:
        return f"density {density:.3f} is above dense_fallback.max_density = {limit}"
    return None
