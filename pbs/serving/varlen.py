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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal PBS attention over a batch of sequences packed along the token axis.

    Sequence ``i`` holds queries ``q[cu_seq_q[i]:cu_seq_q[i+1]]`` and keys and values
    ``k, v[cu_seq_k[i]:cu_seq_k[i+1]]``. Its queries are the last ``len_q`` of its ``len_k``
    positions (bottom-right causal alignment: ``len_q == len_k`` for a prefill, ``len_q < len_k``
    for a chunk after a cached prefix whose keys lead its key range). Each sequence is planned on
    its own and gets exactly what ``pbs.attention`` gives on that sequence alone, so the dense
    fallback is decided per sequence; other sequences in the batch change nothing.

    By default every sequence is one `pbs.attention` call on zero-copy strided views of the packed
    tensors (no K/V copy, GQA native), written into ``out``. The lengths are read on the host once
    (one device-to-host copy of both ``cu_seq`` tensors), so such a call cannot be captured in a
    CUDA graph.

    **CUDA graphs** (``capturable=True``). No tensor is read on the host: the sequences are padded
    to ``max_q``/``max_k`` on the device, planned together with each sequence's lengths read from
    the device, and attended in one launch (`pbs.serving.capturable`), so a graph captured at
    given ``Tq``, ``Tk``, ``N``, ``max_q`` and ``max_k`` replays correctly with any lengths within
    them. Each sequence gets the selection it gets alone, and the dense policy's rules are decided
    per sequence on the device; a sequence that decides dense runs every allowed block on the
    block-sparse kernel (not SDPA). It plans unpermuted configs with the ``mean_pool``,
    ``vertical_slash`` and ``union`` selectors (the defaults among them), on the ``hopper``,
    ``triton`` or ``reference`` backend; others raise a ``ValueError``. Outside a capture the
    lengths are still read and checked as above (the warm-up call before a capture validates its
    arguments); inside one only shapes, dtypes and devices are, and lengths above ``max_q`` or
    ``max_k``, or page indices out of range, are the caller's to rule out (as in FlashAttention).

    **Paged KV cache.** With ``block_table``, ``k`` and ``v`` are the caches
    ``(num_pages, page_size, Hkv, D)`` and ``(num_pages, page_size, Hkv, Dv)``, and sequence ``i``'s
    keys are the first ``seqused_k[i]`` rows of its pages ``block_table[i, 0], block_table[i, 1],
    ...`` in that order (key ``t`` is row ``t % page_size`` of page
    ``block_table[i, t // page_size]``). ``cu_seq_k`` must then be None: the key lengths are
    ``seqused_k`` alone. Each sequence runs what `pbs.attention` runs on its keys gathered into one
    tensor (the same masks and, on the same backend, the same output), but the Triton kernels
    read the pages in place: the attention kernels, the default selectors' planners (line scores,
    block means) and the density probe. The backend is one that reads pages (``hopper`` for page
    sizes of 16 and up, ``triton`` for any, ``reference`` anywhere, which gathers
    them); ``auto`` picks it. Dense fallback runs every allowed block on that backend instead of
    SDPA. A permuter that reorders keys (``pbs_paper``'s
    ``last_block``) makes a permuted copy of K/V in any case; for paged inputs that copy is made
    from the sequence's pages gathered first. The cache's rows outside the sequences are never
    read for their values (their NaNs cannot leak) and are not checked for NaN.

    Args:
        q: ``(Tq, Hq, D)`` queries of all sequences, packed.
        k: ``(Tk, Hkv, D)`` keys, packed, ``Hq % Hkv == 0``; with ``block_table`` the key cache
            ``(num_pages, page_size, Hkv, D)``.
        v: ``(Tk, Hkv, Dv)`` values, packed; with ``block_table`` the value cache
            ``(num_pages, page_size, Hkv, Dv)``.
        cu_seq_q: ``(N + 1,)`` int32 on ``q``'s device: cumulative query lengths, starting at 0,
            non-decreasing, ending at ``Tq``. A sequence of 0 queries is skipped.
        cu_seq_k: ``(N + 1,)`` int32 on ``q``'s device: cumulative key lengths, ending at ``Tk``;
            each sequence needs ``len_k >= len_q``. None with ``block_table``.
        max_q: the longest query sequence (an upper bound is accepted).
        max_k: the longest key sequence (an upper bound is accepted).
        config: a `PBSConfig`, a dict or JSON string of one, or None for the defaults; the same
            for every sequence.
        return_lse: also return the natural-log log-sum-exp of the scaled scores each query
            attended to (for `pbs.merge_attention_states`).
        out: ``(Tq, Hq, Dv)`` in ``q``'s dtype and device to write the output into; None
            allocates it.
        scale: softmax scale, default ``D ** -0.5``.
        block_table: ``(N, max_pages)`` int32 on ``q``'s device: the pages of each sequence in
            order; only the first ``ceil(seqused_k[i] / page_size)`` entries of row ``i`` are
            read, and each must lie in ``0 .. num_pages - 1``. ``page_size`` must be a power of
            two (16, 64 and 128 are the common ones; 1 to 2**k all work).
        seqused_k: ``(N,)`` int32 on ``q``'s device, with ``block_table`` only: the keys of each
            sequence, ``len_q <= seqused_k[i] <= max_pages * page_size``.
        capturable: take the path without host reads, for CUDA-graph capture (see above).

    Returns:
        ``(Tq, Hq, Dv)`` in ``q``'s dtype, and with ``return_lse`` the LSE ``(Hq, Tq)`` float32
        (``-inf`` for a query that sees no key, whose output row is 0).

    Raises:
        TypeError: non-tensor inputs, dtypes other than float16/bfloat16/float32 for ``q, k, v``
            or int32 for ``cu_seq_q, cu_seq_k``, a non-integer ``max_q``/``max_k``.
        ValueError: wrong ranks or head counts, ``cu_seq`` tensors on another device, of different
            lengths, not starting at 0, decreasing, or not ending at ``Tq``/``Tk``, a sequence
            with more queries than keys, ``max_q``/``max_k`` below the longest sequence, a bad
            ``out``; and whatever `pbs.attention` refuses in a sequence. With ``block_table``:
            ``cu_seq_k`` given, ``seqused_k`` missing (or given without ``block_table``), caches
            of another rank, page size, head count or dtype than each other, a page size that is
            not a power of two, ``block_table``/``seqused_k`` of the wrong shape or device, a
            page index out of range, ``seqused_k[i]`` negative or above what the sequence's
            pages hold. (The dtype of ``block_table``/``seqused_k`` is a TypeError.)
        RuntimeError: called during CUDA graph capture without ``capturable=True``.

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
    paged = block_table is not None
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
        bounds_q, lengths_k = read_paged_bounds(cu_seq_q, cu_seq_k, seqused_k, block_table, q, k)
        bounds_k = [0]
        for length in lengths_k:  # cumulative, for the max_k check: the pages hold no packed order
            bounds_k.append(bounds_k[-1] + length)
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
