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
    check_lse: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merges two partial attention results over disjoint key sets into the result over both.

    ``lse = logaddexp(lse_a, lse_b)`` and ``o = o_a * exp(lse_a - lse) + o_b * exp(lse_b - lse)``,
    in float32 (float64 when an input is). A side whose LSE is ``-inf`` saw no key and adds nothing,
    whatever its output row holds (both ``-inf``: ``o = 0``, ``lse = -inf``). NaN propagates: a
    NaN LSE, or a NaN in the output row of a side that saw keys, gives a NaN row. More in
    docs/serving.md ("Merging a cached prefix and a new chunk").

    Args:
        o_a: the first part's output, float16, bfloat16, float32 or float64: batched
            ``(B, H, N, D)`` as `pbs.attention` returns, or packed ``(T, H, D)`` as
            `pbs.varlen_attention` returns.
        lse_a: its natural-log LSE, float32 or float64: ``(B, H, N)``, or ``(H, T)`` when packed.
        o_b: the second part's output, with ``o_a``'s shape, dtype and device.
        lse_b: its LSE, with ``lse_a``'s shape and dtype.
        out: where to write the merged output (may be ``o_a`` or ``o_b``); None allocates it.
        check_lse: refuse a ``+inf`` LSE (no finite scores give one) by a host read. None checks
            tensors off CUDA only, where the read costs no sync; unchecked, such a row is NaN.

    Returns:
        ``(o, lse)`` with ``o_a``'s dtype and shape and ``lse_a``'s.

    Raises:
        TypeError: a non-tensor, or a dtype not listed above.
        ValueError: mismatched shapes or devices, an ``o_a`` neither 3-D nor 4-D, a checked ``+inf``.
        RuntimeError: ``check_lse=True`` on CUDA during a CUDA graph capture.

    Example:
        ```python
        import torch
        import pbs

        q, k, v = (torch.randn(1, 2, 6, 8, dtype=torch.float64) for _ in range(3))

        def attend(keys, values):  # non-causal attention and its LSE
            scores = q @ keys.transpose(-1, -2) * 8**-0.5
            return scores.softmax(-1) @ values, scores.logsumexp(-1)

        o, lse = pbs.merge_attention_states(*attend(k[:, :, :4], v[:, :, :4]), *attend(k[:, :, 4:], v[:, :, 4:]))
        torch.testing.assert_close(o, attend(k, v)[0])
        ```
    """
    packed = _check_states(o_a, lse_a, o_b, lse_b, out)
    if o_a.device.type != "cuda" if check_lse is None else check_lse:
        _refuse_positive_infinity(lse_a, lse_b)
    compute = torch.float64 if torch.float64 in (o_a.dtype, lse_a.dtype) else torch.float32
    lse = torch.logaddexp(lse_a.to(compute), lse_b.to(compute))
    # An unchecked +inf gives a NaN LSE, not +inf, which a later merge would take for a number.
    lse = lse.masked_fill_(torch.isposinf(lse), float("nan"))
    merged = _weighted(o_a, lse_a, lse, packed).add_(_weighted(o_b, lse_b, lse, packed))
    if out is None:
        return merged.to(o_a.dtype), lse.to(lse_a.dtype)
    return out.copy_(merged), lse.to(lse_a.dtype)


def _weighted(o: torch.Tensor, lse_part: torch.Tensor, lse: torch.Tensor, packed: bool) -> torch.Tensor:
    """One side's share of the merged output, ``o * exp(lse_part - lse)`` in ``lse``'s dtype."""
    # Where both sides are -inf, lse - lse would be NaN: subtract 0 there, so the weight is
    # exp(-inf) = 0. A side whose LSE is -inf adds 0, its output row (which some kernels leave
    # unwritten) masked rather than multiplied, since 0 * NaN = NaN. A NaN LSE is not -inf: its
    # weight is NaN, and so is the row.
    weight = torch.exp(lse_part.to(lse.dtype) - torch.where(torch.isneginf(lse), 0.0, lse))
    seen = ~torch.isneginf(lse_part)
    if packed:  # lse (H, T) against o (T, H, D)
        weight, seen = weight.transpose(0, 1), seen.transpose(0, 1)
    zero = torch.zeros((), dtype=lse.dtype, device=o.device)
    return torch.where(seen.unsqueeze(-1), o.to(lse.dtype) * weight.unsqueeze(-1), zero)


def _refuse_positive_infinity(lse_a: torch.Tensor, lse_b: torch.Tensor) -> None:
    """Raises ``ValueError`` naming the first of ``lse_a``, ``lse_b`` that holds ``+inf``, and where.

    One host read for both (a sync on CUDA, which a graph capture forbids: refused there)."""
    if lse_a.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "check_lse=True reads the LSE on the host, which a CUDA graph capture forbids; leave it None "
            "(unchecked on CUDA: a +inf row comes out NaN) to capture merge_attention_states"
        )
    has_inf = torch.stack((torch.isposinf(lse_a).any(), torch.isposinf(lse_b).any())).tolist()
    for (name, lse), bad in zip((("lse_a", lse_a), ("lse_b", lse_b)), has_inf):
        if bad:
            where = tuple(torch.nonzero(torch.isposinf(lse))[0].tolist())
            raise ValueError(
                f"{name} holds +inf (first at index {where}): a log-sum-exp of finite scores is finite, "
                "or -inf for a query that saw no key; +inf means the scores overflowed"
            )


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
