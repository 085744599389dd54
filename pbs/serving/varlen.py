"""Attention over packed variable-length sequences: the serving layout of PyTorch's
``torch.nn.attention.varlen.varlen_attn`` and FlashAttention's ``flash_attn_varlen_func``."""

from __future__ import annotations

import numbers

import torch

from pbs.api import ConfigLike, _on_device_of, attention
from pbs.config import PBSConfig
from pbs.dense import DensePolicy
from pbs.types import PagedTensor
from pbs.serving.varlen_checks import (
    check_cu_seqs,
    check_max_length,
    check_paged_arguments,
    check_host_bounds,
    check_paged_host_bounds,
    check_packed_qkv,
    check_paged_qkv,
    output_buffer,
    read_bounds,
    read_paged_bounds,
)
from pbs.validation import check_all_finite, check_scale


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
    block_table: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    capturable: bool = False,
    host_bounds: tuple[list[int], list[int]] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal PBS attention over a batch of sequences packed along the token axis.

    Sequence ``i`` holds queries ``q[cu_seq_q[i]:cu_seq_q[i+1]]`` and keys and values
    ``k, v[cu_seq_k[i]:cu_seq_k[i+1]]``, its queries the last ``len_q`` of its ``len_k`` positions
    (bottom-right causal). Each sequence gets what `pbs.attention` gives it alone, dense fallback
    included. The lengths are read on the host once; ``capturable=True`` reads nothing there (CUDA
    graphs); ``block_table`` reads K/V from a paged cache. docs/serving.md details each path.

    Args:
        q: ``(Tq, Hq, D)`` queries, packed.
        k, v: ``(Tk, Hkv, D)`` keys and ``(Tk, Hkv, Dv)`` values, packed, ``Hq % Hkv == 0``; with
            ``block_table`` the caches ``(num_pages, page_size, Hkv, D)`` and ``(..., Hkv, Dv)``.
        cu_seq_q, cu_seq_k: ``(N + 1,)`` int32 on ``q``'s device: cumulative query and key lengths,
            from 0 up to ``Tq`` and ``Tk``, each ``len_k >= len_q``; ``cu_seq_k`` None with ``block_table``.
        max_q, max_k: the longest query and key sequence (an upper bound is accepted).
        config: a `PBSConfig`, a dict or JSON string of one, or None (the defaults), for every sequence.
        return_lse: also return the natural-log log-sum-exp (for `pbs.merge_attention_states`).
        out: ``(Tq, Hq, Dv)`` in ``q``'s dtype and device to write into; None allocates it.
        scale: softmax scale, default ``D ** -0.5``.
        block_table: ``(N, max_pages)`` int32: key ``t`` of sequence ``i`` is row ``t % page_size`` of
            page ``block_table[i, t // page_size]``; ``seqused_k``: ``(N,)`` int32, its keys.
        capturable: take the path without host reads, for CUDA-graph capture.
        host_bounds: ``cu_seq_q``'s values and ``cu_seq_k``'s (or, with ``block_table``, ``seqused_k``'s)
            already on the host: no device read (a paged cache's page indices are then checked on
            a CPU only).

    Returns:
        ``(Tq, Hq, Dv)`` in ``q``'s dtype; with ``return_lse`` also the LSE ``(Hq, Tq)`` float32
        (``-inf`` for a query that sees no key, whose output row is 0).

    Raises:
        TypeError: non-tensors; dtypes other than float16/bfloat16/float32 (``q, k, v``) or int32 (the
            index tensors); a non-integer ``max_q``/``max_k``.
        ValueError: shapes, devices, caches or ``out`` that do not fit; bad ``cu_seq``/``host_bounds``;
            ``max_q``/``max_k`` below a length; a page index out of range; a config ``capturable=True``
            cannot run; whatever `pbs.attention` refuses in a sequence.
        RuntimeError: called during CUDA graph capture without ``capturable=True``.

    Example:
        ```python
        import torch
        import pbs
        q, k, v = pbs.testing.make_qkv(seq_len=96, heads_q=4, heads_kv=2, head_dim=32)
        packed = lambda x, n: x[0, :, -n:].transpose(0, 1)  # (B, H, N, D) -> last n as (n, H, D)
        q_packed = torch.cat([packed(q, 96), packed(q, 32)])  # a prompt; a chunk after 64 cached keys
        k_packed, v_packed = (torch.cat([packed(x, 96), packed(x, 96)]) for x in (k, v))  # (192, 2, 32)
        cu_seq_q, cu_seq_k = (torch.tensor(b, dtype=torch.int32) for b in ([0, 96, 128], [0, 96, 192]))
        out = pbs.varlen_attention(q_packed, k_packed, v_packed, cu_seq_q, cu_seq_k, max_q=96, max_k=96)
        torch.testing.assert_close(out[96:], pbs.attention(q[:, :, -32:], k, v)[0].transpose(0, 1))
        ```
    """
    paged = block_table is not None
    if host_bounds is not None and capturable:
        raise ValueError("host_bounds is taken without capturable: a capturable call reads nothing on the host")
    if not paged and seqused_k is not None:
        raise ValueError(
            "seqused_k is read only with a paged cache (block_table=...); for packed k and v the key "
            "lengths are cu_seq_k's"
        )
    if paged:
        check_paged_qkv(q, k, v)
    else:
        check_packed_qkv(q, k, v)
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    if capturing and not capturable:
        raise RuntimeError(
            f"pbs.varlen_attention reads cu_seq_q and {'seqused_k' if paged else 'cu_seq_k'} on the host (one "
            "sync) to split the batch, which a CUDA graph capture forbids: pass capturable=True to capture it"
        )
    if capturing:
        return _capturable_call(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, config, return_lse, out, scale,
                                block_table, seqused_k, checked=False)
    if paged:
        if host_bounds is not None:
            bounds_q, lengths_k = check_paged_host_bounds(host_bounds, cu_seq_q, cu_seq_k, seqused_k, block_table, q, k)
        else:
            bounds_q, lengths_k = read_paged_bounds(cu_seq_q, cu_seq_k, seqused_k, block_table, q, k)
        bounds_k = [0]
        for length in lengths_k:  # cumulative, for the max_k check: the pages hold no packed order
            bounds_k.append(bounds_k[-1] + length)
    elif host_bounds is not None:
        check_cu_seqs(cu_seq_q, cu_seq_k, q)
        bounds_q, bounds_k = check_host_bounds(host_bounds, cu_seq_q, q, k)
    else:
        bounds_q, bounds_k = read_bounds(cu_seq_q, cu_seq_k, q, k)
    check_max_length("max_q", max_q, bounds_q, "query")
    check_max_length("max_k", max_k, bounds_k, "key")
    if capturable:
        return _capturable_call(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, config, return_lse, out, scale,
                                block_table, seqused_k, checked=True)
    config = PBSConfig.coerce(config)  # once, not once per sequence
    check_scale(scale, q.shape[-1])  # here too: a batch of empty sequences never reaches pbs.attention
    total_q, heads_q = q.shape[0], q.shape[1]
    out = output_buffer(out, q, v.shape[-1])
    if block_table is not None:
        block_table = block_table.contiguous()  # the kernels step through a row with unit stride
    lse = torch.empty(heads_q, total_q, dtype=torch.float32, device=q.device) if return_lse else None
    # Passed only when asked, so a plain call makes the same pbs.attention call a user would.
    lse_argument = {"return_lse": True} if return_lse else {}
    for i, (q_start, q_end, k_start, k_end) in enumerate(zip(bounds_q, bounds_q[1:], bounds_k, bounds_k[1:])):
        if q_end == q_start:
            continue
        q_seq = _sequence_view(q, q_start, q_end)
        if paged:
            assert block_table is not None
            keys, values = (PagedTensor(cache, block_table[i], k_end - k_start) for cache in (k, v))
            result = _attend_paged(q_seq, keys, values, config, scale, return_lse)
        else:
            result = attention(q_seq, _sequence_view(k, k_start, k_end), _sequence_view(v, k_start, k_end),
                               config, scale=scale, **lse_argument)
        sequence_out, sequence_lse = result if return_lse else (result, None)
        out[q_start:q_end].copy_(sequence_out[0].transpose(0, 1))
        if lse is not None:
            lse[:, q_start:q_end] = sequence_lse[0]
    return (out, lse) if lse is not None else out


def _capturable_call(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor | None,
    max_q: int, max_k: int, config: ConfigLike, return_lse: bool, out: torch.Tensor | None, scale: float | None,
    block_table: torch.Tensor | None, seqused_k: torch.Tensor | None, *, checked: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`varlen_attention` with ``capturable=True``, its lengths checked on the host already
    (``checked``) or, inside a capture, checked for shapes, dtypes and devices only."""
    from pbs.serving.capturable import capturable_varlen_attention, check_capturable_config

    if not checked:
        if block_table is not None:
            check_paged_arguments(cu_seq_q, cu_seq_k, seqused_k, block_table, q)
        else:
            check_cu_seqs(cu_seq_q, cu_seq_k, q)
        for name, value in (("max_q", max_q), ("max_k", max_k)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                raise TypeError(f"{name} must be a non-negative int (the longest sequence), got {value!r}")
    config = PBSConfig.coerce(config)
    check_capturable_config(config)
    scale = check_scale(scale, q.shape[-1])
    out = output_buffer(out, q, v.shape[-1])
    finite = config.checks_finite(q.device)
    if finite and not checked:
        raise ValueError("config.check_finite=True reads the inputs on the host, which a CUDA graph capture "
                         "forbids: leave it None or False for a captured call")
    if block_table is not None:
        block_table = block_table.contiguous()
    if q.shape[0] == 0:
        empty_lse = torch.empty(q.shape[1], 0, dtype=torch.float32, device=q.device)
        return (out, empty_lse) if return_lse else out
    result, lse = capturable_varlen_attention(
        q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, config, scale=scale, out=out, return_lse=return_lse,
        block_table=block_table, seqused_k=seqused_k, check_finite=finite,
    )
    return (result, lse) if return_lse else result


def _attend_paged(
    q: torch.Tensor, k: PagedTensor, v: PagedTensor, config: PBSConfig, scale: float | None, return_lse: bool
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`pbs.attention` of one sequence whose keys and values are in a paged cache: the same dense
    policy and planning, handed the pages (`PagedTensor`) instead of tensors.

    The entry checks that `pbs.attention` makes per call were made for the whole batch by
    `check_paged_qkv` and `read_paged_bounds`; the finite check (on the CPU by default) reads
    the sequence's own rows only, never the rest of the cache.
    """
    if config.checks_finite(q.device):
        check_all_finite({"q": q, "k": k.gather(), "v": v.gather()})
    policy = DensePolicy(config, return_lse=return_lse)
    with _on_device_of(q):
        attended = policy.attend(q, k, v, check_scale(scale, q.shape[-1]))
    return (attended.out, attended.lse) if return_lse else attended.out


def _sequence_view(x: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Tokens ``start:end`` of a packed ``(T, H, D)`` tensor as ``(1, H, end - start, D)``: a strided
    view, no copy."""
    return x[start:end].transpose(0, 1).unsqueeze(0)
