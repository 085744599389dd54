"""Merging two partial attention results computed over disjoint sets of keys.

A cached prefix and a new chunk, the steps of ring attention, or the splits of a split-KV kernel
each give, per query, an output normalised over its own keys and the log-sum-exp (LSE) of its
scaled scores. Weighting each output by its share of the total softmax mass gives the attention
over the union of the keys, exactly (FlashAttention's and FlashInfer's ``merge_state``).
"""

from __future__ import annotations

import torch

_OUTPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_LSE_DTYPES = (torch.float32, torch.float64)


def merge_attention_states(
    o_a: torch.Tensor,
    lse_a: torch.Tensor,
    o_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merges two partial attention results over disjoint key sets into the result over both.

    ``lse = logaddexp(lse_a, lse_b)`` and ``o = o_a * exp(lse_a - lse) + o_b * exp(lse_b - lse)``,
    computed in float32 (float64 when an input is float64). A query that sees no key on one side
    (its LSE ``-inf``) takes the other side's result whatever that side's output row holds; a
    query that sees no key on either side gets ``o = 0`` and ``lse = -inf``, never NaN.

    Two layouts, told apart by ``o_a``'s rank:

    - batched, as `pbs.attention` returns: ``o (B, H, N, D)`` with ``lse (B, H, N)``;
    - packed, as `pbs.varlen_attention` (and PyTorch's and FlashAttention's varlen functions)
      return: ``o (T, H, D)`` with ``lse (H, T)``.

    This is plain PyTorch (a few elementwise kernels); a fused Triton version is future work.

    Args:
        o_a: the first part's output, float16, bfloat16, float32 or float64.
        lse_a: its natural-log LSE, float32 (or float64), ``(B, H, N)`` or ``(H, T)``.
        o_b: the second part's output: ``o_a``'s shape, dtype and device.
        lse_b: its LSE: ``lse_a``'s shape and dtype.
        out: where to write the merged output (``o_a``'s shape, dtype and device); it may be
            ``o_a`` or ``o_b`` itself. None allocates it.

    Returns:
        ``(o, lse)``: ``o`` in ``o_a``'s dtype and shape, ``lse`` in ``lse_a``'s dtype and shape.

    Raises:
        TypeError: a non-tensor, or a dtype not listed above.
        ValueError: mismatched shapes or devices, an ``o_a`` that is neither 3-D nor 4-D.

    Example:
        A prefix and a suffix of the keys, attended separately and merged:

        ```python
        import torch
        import pbs

        torch.manual_seed(0)
        q, k, v = (torch.randn(1, 2, 6, 8, dtype=torch.float64) for _ in range(3))

        def attend(keys, values):  # non-causal attention and its LSE
            scores = q @ keys.transpose(-1, -2) * 8**-0.5
            return scores.softmax(-1) @ values, scores.logsumexp(-1)

        o_prefix, lse_prefix = attend(k[:, :, :4], v[:, :, :4])
        o_suffix, lse_suffix = attend(k[:, :, 4:], v[:, :, 4:])
        o, lse = pbs.merge_attention_states(o_prefix, lse_prefix, o_suffix, lse_suffix)
        torch.testing.assert_close(o, attend(k, v)[0])
        ```
    """
    packed = _check_states(o_a, lse_a, o_b, lse_b, out)
    compute = torch.float64 if torch.float64 in (o_a.dtype, lse_a.dtype) else torch.float32
    lse_a32, lse_b32 = lse_a.to(compute), lse_b.to(compute)
    lse = torch.logaddexp(lse_a32, lse_b32)
    # Where both sides are -inf, lse - lse would be NaN: subtract 0 there, so both weights are
    # exp(-inf) = 0 and the row is 0. A side whose LSE is -inf gets weight 0, and its output row
    # (which some kernels leave unwritten) is masked rather than multiplied, since 0 * NaN = NaN.
    finite_total = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    weight_a = torch.exp(lse_a32 - finite_total)
    weight_b = torch.exp(lse_b32 - finite_total)
    if packed:  # lse (H, T) against o (T, H, D)
        weight_a, weight_b = weight_a.transpose(0, 1), weight_b.transpose(0, 1)
        seen_a, seen_b = ~torch.isneginf(lse_a).transpose(0, 1), ~torch.isneginf(lse_b).transpose(0, 1)
    else:
        seen_a, seen_b = ~torch.isneginf(lse_a), ~torch.isneginf(lse_b)
    zero = torch.zeros((), dtype=compute, device=o_a.device)
    part_a = torch.where(seen_a.unsqueeze(-1), o_a.to(compute) * weight_a.unsqueeze(-1), zero)
    part_b = torch.where(seen_b.unsqueeze(-1), o_b.to(compute) * weight_b.unsqueeze(-1), zero)
    merged = part_a.add_(part_b)
    if out is None:
        out = merged.to(o_a.dtype)
    else:
        out.copy_(merged)
    return out, lse.to(lse_a.dtype)


def _check_states(
    o_a: object, lse_a: object, o_b: object, lse_b: object, out: object
) -> bool:
    """Raises an error naming the first argument that breaks the layout; returns whether the
    layout is packed (``o (T, H, D)``, ``lse (H, T)``)."""
    for name, x in (("o_a", o_a), ("lse_a", lse_a), ("o_b", o_b), ("lse_b", lse_b)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    assert isinstance(o_a, torch.Tensor) and isinstance(lse_a, torch.Tensor)
    assert isinstance(o_b, torch.Tensor) and isinstance(lse_b, torch.Tensor)
    if o_a.dim() == 4:
        packed, expected_lse, layout = False, tuple(o_a.shape[:3]), "o (B, H, N, D) with lse (B, H, N)"
    elif o_a.dim() == 3:
        packed, expected_lse, layout = True, (o_a.shape[1], o_a.shape[0]), "o (T, H, D) with lse (H, T)"
    else:
        raise ValueError(
            "o_a must be batched (B, H, N, D) with lse (B, H, N), or packed (T, H, D) with lse (H, T); "
            f"got o_a of shape {tuple(o_a.shape)}"
        )
    if o_a.dtype not in _OUTPUT_DTYPES:
        raise TypeError(f"o_a must have dtype float16, bfloat16, float32 or float64, got {o_a.dtype}")
    if o_b.shape != o_a.shape or o_b.dtype != o_a.dtype:
        raise ValueError(
            f"o_b must have o_a's shape {tuple(o_a.shape)} and dtype {o_a.dtype}, "
            f"got shape {tuple(o_b.shape)} and dtype {o_b.dtype}"
        )
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        if tuple(lse.shape) != expected_lse:
            raise ValueError(
                f"{name} must have shape {expected_lse} for o_a of shape {tuple(o_a.shape)} ({layout}), "
                f"got {tuple(lse.shape)}"
            )
        if lse.dtype not in _LSE_DTYPES:
            raise TypeError(
                f"{name} must have dtype float32 (or float64), got {lse.dtype}: the log-sum-exp loses "
                "too much precision in 16 bits to weigh the two parts"
            )
    if lse_b.dtype != lse_a.dtype:
        raise TypeError(f"lse_a and lse_b must share a dtype, got lse_a: {lse_a.dtype}, lse_b: {lse_b.dtype}")
    devices = {name: x.device for name, x in (("o_a", o_a), ("lse_a", lse_a), ("o_b", o_b), ("lse_b", lse_b))}
    if len(set(devices.values())) > 1:
        raise ValueError(
            "o_a, lse_a, o_b and lse_b must be on one device, got "
            + ", ".join(f"{name}: {device}" for name, device in devices.items())
        )
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
        if out.shape != o_a.shape or out.dtype != o_a.dtype or out.device != o_a.device:
            raise ValueError(
                f"out must have o_a's shape {tuple(o_a.shape)}, dtype {o_a.dtype} and device {o_a.device}, "
                f"got shape {tuple(out.shape)}, dtype {out.dtype} and device {out.device}"
            )
    return packed
