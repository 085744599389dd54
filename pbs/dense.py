"""Dense attention through SDPA, and the policy that decides when ``auto`` should use it instead of PBS.

Sparse attention only pays when the skipped blocks cost more than planning: at short lengths and at
high selected densities cuDNN's dense kernel wins (docs/benchmarks.md has the measured crossover).
`DenseFallback` says where the line is; this module applies it.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F

from pbs.config import PBSConfig
from pbs.reference.density_probe import probe_density
from pbs.types import Plan

logger = logging.getLogger("pbs")

_LOGGED: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.info(message)


# The last priority order seen and its cuDNN-first form: the order rarely changes, so most calls
# compare two short lists instead of building a new one.
_LAST_ORDER: tuple[list[int], list[int] | None] = ([], None)


def _cudnn_first(order: list[int]) -> list[int] | None:
    """SDPA's backend priority ``order`` with cuDNN moved first, or None if it is first already.

    cuDNN is the fastest dense causal prefill on Hopper (docs/benchmarks.md), but
    PyTorch does not rank it first. Only the order changes: a backend the user disabled stays
    disabled. (``torch.nn.attention.sdpa_kernel`` would do the same at ~20 us of host time per
    call, which shows at 2K tokens, where cuDNN itself takes ~0.1 ms.)
    """
    global _LAST_ORDER
    seen, cudnn_first = _LAST_ORDER
    if order == seen:
        return cudnn_first
    from torch.nn.attention import SDPBackend

    cudnn = int(SDPBackend.CUDNN_ATTENTION)
    cudnn_first = None if order[0] == cudnn else [cudnn] + [b for b in order if b != cudnn]
    _LAST_ORDER = (order, cudnn_first)
    return cudnn_first


def dense_attention_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool = True
) -> torch.Tensor:
    """Dense attention with PBS's conventions, through ``scaled_dot_product_attention``.

    Queries are the last ``Nq`` of the ``Nk`` positions (bottom-right causal alignment), and GQA is
    handled by SDPA's ``enable_gqa`` (no copy of K/V). On CUDA cuDNN is tried first.

    Args:
        q: ``(B, Hq, Nq, D)``; k: ``(B, Hkv, Nk, D)``; v: ``(B, Hkv, Nk, Dv)``.

    Returns:
        ``(B, Hq, Nq, Dv)`` in ``q``'s dtype.
    """
    _, heads_q, nq, _ = q.shape
    _, heads_kv, nk, _ = k.shape
    mask = None
    if causal and nq != nk:
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(nq, nk)
    is_causal = causal and mask is None
    gqa = heads_q != heads_kv
    if q.is_cuda:
        previous = torch._C._get_sdp_priority_order()
        order = _cudnn_first(previous)
        if order is not None:
            torch._C._set_sdp_priority_order(order)
            try:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                                      enable_gqa=gqa)
            finally:
                torch._C._set_sdp_priority_order(previous)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa)


def policy_applies(config: PBSConfig, device: torch.device) -> bool:
    """Whether ``config.dense_fallback`` may replace PBS on ``device`` (``backend="auto"`` only)."""
    return config.backend == "auto" and device.type in config.dense_fallback.devices


def runs_dense_by_length(config: PBSConfig, q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether dense attention runs before any planning because there are too few keys.

    Decided from shapes alone, in few Python steps: it is the whole decision of every short call.
    """
    return k.shape[2] < config.dense_fallback.min_seq_len and policy_applies(config, q.device)


def length_fallback_reason(config: PBSConfig, q: torch.Tensor, k: torch.Tensor) -> str | None:
    """Why dense attention should run before any planning (too few keys), or None."""
    if not runs_dense_by_length(config, q, k):
        return None
    return f"Nk = {k.shape[2]} is below dense_fallback.min_seq_len = {config.dense_fallback.min_seq_len}"


def _capturing(device: torch.device, rule: str) -> bool:
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        _log_once(f"pbs: dense_fallback.{rule} is not applied inside a CUDA graph capture (it needs a host sync)")
        return True
    return False


def density_fallback_reason(config: PBSConfig, plan: Plan) -> str | None:
    """Why dense attention should run although a plan exists (density too high), or None.

    Reads the plan's density on the host (one sync); while a CUDA graph is being captured that is
    impossible, so the rule is skipped then (logged once) and the graph always runs sparse.
    """
    policy = config.dense_fallback
    limit = policy.max_planned_density
    device = plan.mask.counts.device
    if (policy.max_density is None or limit is None or not policy_applies(config, device)
            or _capturing(device, "max_planned_density")):
        return None
    # One reduction and one read on the host (Plan.density would take several small ops).
    layout = plan.layout
    selected = int(plan.mask.counts.sum(dtype=torch.int64))
    density = selected / (layout.batch * layout.heads_q * layout.total_allowed_blocks)
    if density > limit:
        return f"density {density:.3f} is above dense_fallback.max_planned_density = {limit}"
    return None


# probe_threshold per config object: it walks the selector's fields (~8 us on an H100 host, far
# more right after a host sync), and it runs in every call that reaches the probe. Configs are
# frozen, so an entry stays right; it holds its config so that the id is not reused.
_PROBE_SHARES: dict[int, tuple[PBSConfig, float | None]] = {}


def probe_threshold(config: PBSConfig) -> float | None:
    """The mass share the density probe covers: the selector's ``threshold`` (or ``coverage``).

    A selector made of members (``union``, such as the default selector) takes the largest of its
    members' shares: a union keeps at least every block each member keeps, so where the probe
    finds the member's selection dense, the union's is too. None for a selector with neither, such
    as ``budget``, whose density is fixed by the config rather than by the attention (and for a
    union of such selectors); the probe does not run for it.
    """
    entry = _PROBE_SHARES.get(id(config))
    if entry is not None and entry[0] is config:
        return entry[1]
    share = _selector_probe_threshold(config.selector)
    if len(_PROBE_SHARES) >= 64:
        _PROBE_SHARES.clear()
    _PROBE_SHARES[id(config)] = (config, share)
    return share


def _selector_probe_threshold(selector: Any) -> float | None:
    for name in ("threshold", "coverage"):
        value = getattr(selector, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    members = getattr(selector, "selectors", None)
    if isinstance(members, tuple):
        shares = [share for share in map(_selector_probe_threshold, members) if share is not None]
        return max(shares) if shares else None
    return None


def triton_not_supported_reasons_for_probe(q: torch.Tensor) -> list[str]:
    """Why the probe's Triton kernel cannot run on ``q`` (then the eager twin runs)."""
    reasons = list(_probe_device_reasons(q.device.index if q.device.index is not None else torch.cuda.current_device()))
    if q.shape[-1] > 256:
        reasons.append("head dim above 256")
    return reasons


@functools.lru_cache(maxsize=None)
def _probe_device_reasons(device_index: int) -> tuple[str, ...]:
    # Cached per device: the probe runs in every layer of every call.
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return ("triton is not installed",)
    if torch.cuda.get_device_capability(device_index) < (8, 0):
        return ("compute capability below 8.0",)
    return ()


def _probe_arguments(config: PBSConfig, scale: float) -> dict[str, Any] | None:
    """The probe's keyword arguments for ``config``, or None where it does not run
    (``probe_blocks == 0`` or no `probe_threshold`)."""
    threshold = probe_threshold(config)
    if config.dense_fallback.probe_blocks == 0 or threshold is None:
        return None
    return dict(block_size=config.block_size, num_blocks=config.dense_fallback.probe_blocks, threshold=threshold,
                scale=scale, causal=config.causal)


def probe_estimate(config: PBSConfig, q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor | float | None:
    """The density probe's estimate for ``config`` (`pbs.reference.density_probe.probe_density`),
    or None where it does not run (``probe_blocks == 0`` or no `probe_threshold`).

    A float from the Triton kernel on CUDA (it reads its two counters on the host), else a 0-d
    tensor that the caller reads (or first reduces, as tensor parallelism does over its ranks).
    """
    args = _probe_arguments(config, scale)
    if args is None:
        return None
    if q.is_cuda and not triton_not_supported_reasons_for_probe(q):
        from pbs.kernels.density_probe import probe_density_triton

        return probe_density_triton(q, k, **args)
    return probe_density(q, k, **args)


# The dense-mode kernel's gate compares the probe's counters in integers (a float threshold
# rounded the same way on host and device is harder to guarantee than an integer product).
_GATE_UNIT = 1 << 20


def probe_gate_limit(max_density: float) -> int:
    """``max_density`` in units of 2**-20: the integer the dense-mode kernel's gate compares."""
    return round(max_density * _GATE_UNIT)


def probe_says_dense(kept: int, visible: int, max_density: float) -> bool:
    """The probe's verdict from its two counters: ``kept / visible > max_density``, computed as
    ``kept * 2**20 > probe_gate_limit(max_density) * visible`` in integers, exactly as the gated
    dense kernel computes it on the GPU (`pbs.kernels.hopper_attn.launch_hopper_dense`)."""
    return kept * _GATE_UNIT > probe_gate_limit(max_density) * visible


def dense_by_probe(config: PBSConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor | None:
    """Dense attention when the density probe finds the input too dense to plan
    (above ``dense_fallback.max_density``), else None (plan sparse).

    On a Hopper GPU with inputs the Gluon kernel takes (fp16/bf16, head dim 64 or 128), the dense
    attention is launched *before* the host reads the probe: the probe leaves its two counters on
    the GPU, the Gluon kernel in dense mode checks them itself and computes only if they say dense
    (else it exits at once), and the host reads the counters while that kernel runs. So on a dense
    input the GPU goes straight from the probe to attention, and the host read costs nothing; on a
    sparse one it costs one empty launch. Elsewhere the host reads the probe first and then runs
    `dense_attention_sdpa` (cuDNN first). Skipped, with None, inside a CUDA graph capture.

    Args:
        q: ``(B, Hq, Nq, D)``; k: ``(B, Hkv, Nk, D)``; v: ``(B, Hkv, Nk, Dv)``.

    Returns:
        ``(B, Hq, Nq, Dv)`` in ``q``'s dtype, or None.
    """
    policy = config.dense_fallback
    if policy.max_density is None or not policy_applies(config, q.device) or _capturing(q.device, "max_density"):
        return None
    args = _probe_arguments(config, scale)
    if args is None:
        return None
    if args["threshold"] < 1.0 and not gated_dense_not_supported_reasons(q, v):
        return _probe_with_gated_dense(config, q, k, v, args)
    estimate = probe_estimate(config, q, k, scale)
    if float(estimate) > policy.max_density:
        return dense_attention_sdpa(q, k, v, scale=scale, causal=config.causal)
    return None


def gated_dense_not_supported_reasons(q: torch.Tensor, v: torch.Tensor) -> list[str]:
    """Why `dense_by_probe` cannot start the Gluon kernel before reading the probe on these
    inputs (empty: it can)."""
    if q.device.type != "cuda":
        return ["needs CUDA tensors"]
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    reasons = list(_gated_dense_reasons(index, q.dtype, q.shape[-1], v.shape[-1]))
    return reasons + triton_not_supported_reasons_for_probe(q)


@functools.lru_cache(maxsize=None)
def _gated_dense_reasons(device_index: int, dtype: torch.dtype, head_dim: int, head_dim_v: int) -> tuple[str, ...]:
    # Cached: asked in every call that reaches the probe.
    from pbs.kernels._common import interpreting

    if interpreting():
        return ("the Triton interpreter cannot run Gluon",)
    try:
        from pbs.kernels.hopper_attn import BLOCK_SIZE, hopper_not_supported_reasons_for
    except ImportError as exc:  # a Triton without Gluon, or with another Gluon API
        return (f"this Triton has no usable Gluon ({exc})",)
    device = torch.device("cuda", device_index)
    return tuple(hopper_not_supported_reasons_for(device, dtype, head_dim, head_dim_v, BLOCK_SIZE))


def _probe_with_gated_dense(
    config: PBSConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, probe_args: dict[str, Any]
) -> torch.Tensor | None:
    from pbs.kernels._common import descriptor_ready
    from pbs.kernels.block_sparse_attn import sm_count
    from pbs.kernels.density_probe import probe_counters_triton
    from pbs.kernels.hopper_attn import launch_hopper_dense

    policy = config.dense_fallback
    counters = probe_counters_triton(q, k, **probe_args)
    # The counters go to pinned memory behind the probe, and the host waits for that copy only,
    # not for the dense kernel queued after it.
    host_counters = torch.empty(2, dtype=torch.int32, pin_memory=True)
    host_counters.copy_(counters[:2], non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    out = torch.empty(*q.shape[:3], v.shape[-1], dtype=q.dtype, device=q.device)
    launch_hopper_dense(*(descriptor_ready(x) for x in (q, k, v)), out, scale=probe_args["scale"], causal=config.causal,
                        sm_count=sm_count(q.device), gate=counters, gate_limit=probe_gate_limit(policy.max_density))
    copied.synchronize()
    kept, visible = host_counters.tolist()
    return out if probe_says_dense(kept, visible, policy.max_density) else None
