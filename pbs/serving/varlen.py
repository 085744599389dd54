"""Attention over packed variable-length sequences: the serving layout of PyTorch's
``torch.nn.attention.varlen.varlen_attn`` and FlashAttention's ``flash_attn_varlen_func``."""

from __future__ import annotations

import numbers

import torch

from pbs.api import ConfigLike, attention
from pbs.config import PBSConfig
from pbs.validation import FLOAT_DTYPES, check_scale


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    config: ConfigLike = None,
    *,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal PBS attention over a batch of sequences packed along the token axis.

    Sequence ``i`` holds queries ``q[cu_seq_q[i]:cu_seq_q[i+1]]`` and keys and values
    ``k, v[cu_seq_k[i]:cu_seq_k[i+1]]``. Its queries are the last ``len_q`` of its ``len_k``
    positions (bottom-right causal alignment: ``len_q == len_k`` for a prefill, ``len_q < len_k``
    for a chunk after a cached prefix whose keys lead its key range). Each sequence is planned on
    its own and gets exactly what ``pbs.attention`` gives on that sequence alone, so the dense
    fallback is decided per sequence; other sequences in the batch change nothing.

    Today every sequence is one `pbs.attention` call on zero-copy strided views of the packed
    tensors (no K/V copy, GQA native), written into ``out``. The lengths are read on the host once
    (one device-to-host copy of both ``cu_seq`` tensors), so a call cannot be captured in a CUDA
    graph yet; ``max_q`` and ``max_k`` are checked and reserved for a future path without that read.

    Args:
        q: ``(Tq, Hq, D)`` queries of all sequences, packed.
        k: ``(Tk, Hkv, D)`` keys, packed, ``Hq % Hkv == 0``.
        v: ``(Tk, Hkv, Dv)`` values, packed.
        cu_seq_q: ``(N + 1,)`` int32 on ``q``'s device: cumulative query lengths, starting at 0,
            non-decreasing, ending at ``Tq``. A sequence of 0 queries is skipped.
        cu_seq_k: ``(N + 1,)`` int32 on ``q``'s device: cumulative key lengths, ending at ``Tk``;
            each sequence needs ``len_k >= len_q``.
        max_q: the longest query sequence (an upper bound is accepted).
        max_k: the longest key sequence (an upper bound is accepted).
        config: a `PBSConfig`, a dict or JSON string of one, or None for the defaults; the same
            for every sequence.
        return_lse: also return the natural-log log-sum-exp of the scaled scores each query
            attended to (for `pbs.merge_attention_states`).
        out: ``(Tq, Hq, Dv)`` in ``q``'s dtype and device to write the output into; None
            allocates it.
        scale: softmax scale, default ``D ** -0.5``.

    Returns:
        ``(Tq, Hq, Dv)`` in ``q``'s dtype, and with ``return_lse`` the LSE ``(Hq, Tq)`` float32
        (``-inf`` for a query that sees no key, whose output row is 0).

    Raises:
        TypeError: non-tensor inputs, dtypes other than float16/bfloat16/float32 for ``q, k, v``
            or int32 for ``cu_seq_q, cu_seq_k``, a non-integer ``max_q``/``max_k``.
        ValueError: wrong ranks or head counts, ``cu_seq`` tensors on another device, of different
            lengths, not starting at 0, decreasing, or not ending at ``Tq``/``Tk``, a sequence
            with more queries than keys, ``max_q``/``max_k`` below the longest sequence, a bad
            ``out``; and whatever `pbs.attention` refuses in a sequence.
        RuntimeError: called during CUDA graph capture.

    Example:
        Two sequences, a prompt of 96 tokens and a chunk of 32 queries after a prefix of 64 cached
        keys, each equal to `pbs.attention` on it alone:

        ```python
        import torch
        import pbs

        q, k, v = pbs.testing.make_qkv(seq_len=96, heads_q=4, heads_kv=2, head_dim=32)
        packed = lambda x, n: x[0, :, -n:].transpose(0, 1)  # (B, H, N, D) -> last n as (n, H, D)
        q_packed = torch.cat([packed(q, 96), packed(q, 32)])  # (128, 4, 32)
        k_packed = torch.cat([packed(k, 96), packed(k, 96)])  # (192, 2, 32)
        v_packed = torch.cat([packed(v, 96), packed(v, 96)])
        cu_seq_q = torch.tensor([0, 96, 128], dtype=torch.int32)
        cu_seq_k = torch.tensor([0, 96, 192], dtype=torch.int32)
        config = {"backend": "reference"}
        out = pbs.varlen_attention(q_packed, k_packed, v_packed, cu_seq_q, cu_seq_k, 96, 96, config)
        chunk = pbs.attention(q[:, :, -32:], k, v, config)  # (1, 4, 32, 32)
        torch.testing.assert_close(out[96:], chunk[0].transpose(0, 1))
        ```
    """
    _check_packed_qkv(q, k, v)
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "pbs.varlen_attention cannot be captured in a CUDA graph yet: it reads cu_seq_q and cu_seq_k "
            "on the host (one sync) to split the batch. Call it outside the capture, or capture "
            "pbs.attention per sequence"
        )
    bounds_q, bounds_k = _read_bounds(cu_seq_q, cu_seq_k, q, k)
    _check_max_length("max_q", max_q, bounds_q, "query")
    _check_max_length("max_k", max_k, bounds_k, "key")
    config = PBSConfig.coerce(config)  # once, not once per sequence
    check_scale(scale, q.shape[-1])  # here too: a batch of empty sequences never reaches pbs.attention
    total_q, heads_q = q.shape[0], q.shape[1]
    out = _output_buffer(out, q, v)
    lse = torch.empty(heads_q, total_q, dtype=torch.float32, device=q.device) if return_lse else None
    # Passed only when asked, so a plain call makes the same pbs.attention call a user would.
    lse_argument = {"return_lse": True} if return_lse else {}
    for q_start, q_end, k_start, k_end in zip(bounds_q, bounds_q[1:], bounds_k, bounds_k[1:]):
        if q_end == q_start:
            continue
        result = attention(
            _sequence_view(q, q_start, q_end), _sequence_view(k, k_start, k_end), _sequence_view(v, k_start, k_end),
            config, scale=scale, **lse_argument,
        )
        sequence_out, sequence_lse = result if return_lse else (result, None)
        out[q_start:q_end].copy_(sequence_out[0].transpose(0, 1))
        if lse is not None:
            lse[:, q_start:q_end] = sequence_lse[0]
    return (out, lse) if lse is not None else out


def _sequence_view(x: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Tokens ``start:end`` of a packed ``(T, H, D)`` tensor as ``(1, H, end - start, D)``: a strided
    view, no copy."""
    return x[start:end].transpose(0, 1).unsqueeze(0)


def _check_packed_qkv(q: object, k: object, v: object) -> None:
    """Raises an error naming the first rule of the packed layout that ``q, k, v`` break; the
    rules of a single sequence (finite values, grad) are checked by `pbs.attention`."""
    shapes = {"q": "(Tq, Hq, D)", "k": "(Tk, Hkv, D)", "v": "(Tk, Hkv, Dv)"}
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must have dtype float16, bfloat16 or float32, got {x.dtype}")
        if x.dim() != 3:
            raise ValueError(
                f"{name} must have 3 dimensions {shapes[name]} (sequences packed along the first), got shape "
                f"{tuple(x.shape)}; for (B, H, N, D) tensors of equal lengths call pbs.attention"
            )
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must share a dtype, got q: {q.dtype}, k: {k.dtype}, v: {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got q: {q.device}, k: {k.device}, v: {v.device}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must agree in (Tk, Hkv), got k: {tuple(k.shape[:2])}, v: {tuple(v.shape[:2])}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"q and k must share the head dim D, got q: {q.shape[2]}, k: {k.shape[2]}")
    if q.shape[2] == 0 or v.shape[2] == 0:
        raise ValueError(f"head dims must be positive, got q: {tuple(q.shape)}, v: {tuple(v.shape)}")
    heads_q, heads_kv = q.shape[1], k.shape[1]
    if heads_q == 0 or heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(
            f"the number of query heads (q.shape[1] = {heads_q}) must be a positive multiple of the number of "
            f"key/value heads (k.shape[1] = {heads_kv})"
        )


def _read_bounds(
    cu_seq_q: object, cu_seq_k: object, q: torch.Tensor, k: torch.Tensor
) -> tuple[list[int], list[int]]:
    """Checks the two cumulative-length tensors and reads them on the host in one copy.

    Returns:
        ``(bounds_q, bounds_k)``: the ``N + 1`` boundaries of each as Python ints, checked.
    """
    for name, cu in (("cu_seq_q", cu_seq_q), ("cu_seq_k", cu_seq_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(
                f"{name} must have dtype torch.int32 (as in torch.nn.attention.varlen and FlashAttention), "
                f"got {cu.dtype}; convert with {name}.to(torch.int32)"
            )
        if cu.dim() != 1 or cu.shape[0] == 0:
            raise ValueError(
                f"{name} must be 1-D of shape (N + 1,) for N sequences (cumulative lengths starting at 0), "
                f"got shape {tuple(cu.shape)}"
            )
        if cu.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {cu.device}")
    assert isinstance(cu_seq_q, torch.Tensor) and isinstance(cu_seq_k, torch.Tensor)
    if cu_seq_q.shape != cu_seq_k.shape:
        raise ValueError(
            "cu_seq_q and cu_seq_k must have the same length N + 1 (one entry per sequence boundary), "
            f"got {cu_seq_q.shape[0]} and {cu_seq_k.shape[0]}"
        )
    entries = cu_seq_q.shape[0]
    # The one host read of the call (a sync on CUDA): both tensors in one copy.
    both = torch.cat((cu_seq_q, cu_seq_k)).tolist()
    bounds = {"cu_seq_q": both[:entries], "cu_seq_k": both[entries:]}
    for (name, values), total, tensor_name in zip(bounds.items(), (q.shape[0], k.shape[0]), ("Tq", "Tk")):
        if values[0] != 0:
            raise ValueError(f"{name} must start at 0, got {name}[0] = {values[0]}")
        for i in range(len(values) - 1):
            if values[i + 1] < values[i]:
                raise ValueError(
                    f"{name} must be non-decreasing (cumulative lengths), got {name}[{i}] = {values[i]} > "
                    f"{name}[{i + 1}] = {values[i + 1]}"
                )
        if values[-1] != total:
            raise ValueError(
                f"{name} must end at the packed length {tensor_name} = {total} "
                f"({'q' if name == 'cu_seq_q' else 'k'}.shape[0]), got {name}[-1] = {values[-1]}"
            )
    bounds_q, bounds_k = bounds["cu_seq_q"], bounds["cu_seq_k"]
    for i in range(entries - 1):
        len_q, len_k = bounds_q[i + 1] - bounds_q[i], bounds_k[i + 1] - bounds_k[i]
        if len_q > len_k:
            why = "it has queries but no keys" if len_k == 0 else (
                "queries are the last len_q of a sequence's len_k positions, so len_q <= len_k")
            raise ValueError(f"sequence {i} has len_q = {len_q} queries and len_k = {len_k} keys: {why}")
    return bounds_q, bounds_k


def _check_max_length(name: str, value: object, bounds: list[int], kind: str) -> None:
    longest = max((end - start for start, end in zip(bounds, bounds[1:])), default=0)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int (the longest {kind} sequence, {longest} here), got {type(value).__name__}")
    if value < longest:
        raise ValueError(f"{name} must be at least the longest {kind} sequence, {longest}, got {name} = {value}")


def _output_buffer(out: object, q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    shape = (q.shape[0], q.shape[1], v.shape[2])
    if out is None:
        return torch.empty(shape, dtype=q.dtype, device=q.device)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if tuple(out.shape) != shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(
            f"out must have shape (Tq, Hq, Dv) = {shape}, q's dtype {q.dtype} and device {q.device}, "
            f"got shape {tuple(out.shape)}, dtype {out.dtype} and device {out.device}"
        )
    return out
