"""Attention over packed variable-length sequences: the serving layout of PyTorch's
``torch.nn.attention.varlen.varlen_attn`` and FlashAttention's ``flash_attn_varlen_func``."""

from __future__ import annotations

import numbers

import torch

from pbs.api import ConfigLike, _on_device_of, attention
from pbs.config import PBSConfig
from pbs.dense import DensePolicy
from pbs.types import PagedTensor
from pbs.validation import FLOAT_DTYPES, check_all_finite, check_scale


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

    **Paged KV cache.** With ``block_table``, ``k`` and ``v`` are the caches
    ``(num_pages, page_size, Hkv, D)`` and ``(num_pages, page_size, Hkv, Dv)``, and sequence ``i``'s
    keys are the first ``seqused_k[i]`` rows of its pages ``block_table[i, 0], block_table[i, 1],
    ...`` in that order (key ``t`` is row ``t % page_size`` of page
    ``block_table[i, t // page_size]``). ``cu_seq_k`` must then be None: the key lengths are
    ``seqused_k`` alone. Each sequence runs what `pbs.attention` runs on its keys gathered into one
    tensor (the same masks and, on the same backend, the same output), but the Triton kernels
    read the pages in place: the attention kernels, the default selectors' planners (line scores,
    block means) and the density probe. The backend is one that reads pages (``hopper`` for page
    sizes that are multiples of 128, ``triton`` for any, ``reference`` anywhere, which gathers
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
    paged = block_table is not None
    if not paged and seqused_k is not None:
        raise ValueError(
            "seqused_k is read only with a paged cache (block_table=...); for packed k and v the key "
            "lengths are cu_seq_k's"
        )
    if paged:
        _check_paged_qkv(q, k, v)
    else:
        _check_packed_qkv(q, k, v)
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"pbs.varlen_attention cannot be captured in a CUDA graph yet: it reads cu_seq_q and "
            f"{'seqused_k' if paged else 'cu_seq_k'} on the host (one sync) to split the batch. Call it "
            "outside the capture, or capture pbs.attention per sequence"
        )
    if paged:
        bounds_q, lengths_k = _read_paged_bounds(cu_seq_q, cu_seq_k, seqused_k, block_table, q, k)
        bounds_k = [0]
        for length in lengths_k:  # cumulative, for the max_k check: the pages hold no packed order
            bounds_k.append(bounds_k[-1] + length)
    else:
        bounds_q, bounds_k = _read_bounds(cu_seq_q, cu_seq_k, q, k)
    _check_max_length("max_q", max_q, bounds_q, "query")
    _check_max_length("max_k", max_k, bounds_k, "key")
    config = PBSConfig.coerce(config)  # once, not once per sequence
    check_scale(scale, q.shape[-1])  # here too: a batch of empty sequences never reaches pbs.attention
    total_q, heads_q = q.shape[0], q.shape[1]
    out = _output_buffer(out, q, v.shape[-1])
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


def _attend_paged(
    q: torch.Tensor, k: PagedTensor, v: PagedTensor, config: PBSConfig, scale: float | None, return_lse: bool
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`pbs.attention` of one sequence whose keys and values are in a paged cache: the same dense
    policy and planning, handed the pages (`PagedTensor`) instead of tensors.

    The entry checks that `pbs.attention` makes per call were made for the whole batch by
    `_check_paged_qkv` and `_read_paged_bounds`; the finite check (on the CPU by default) reads
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


def _check_paged_qkv(q: object, k_cache: object, v_cache: object) -> None:
    """Raises an error naming the first rule of the paged layout that ``q`` and the caches break."""
    shapes = {"q": "(Tq, Hq, D)", "k": "(num_pages, page_size, Hkv, D)", "v": "(num_pages, page_size, Hkv, Dv)"}
    for name, x, rank in (("q", q, 3), ("k", k_cache, 4), ("v", v_cache, 4)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must have dtype float16, bfloat16 or float32, got {x.dtype}")
        if x.dim() != rank:
            what = "packed queries" if name == "q" else "a paged cache, as block_table is given"
            raise ValueError(f"{name} must have {rank} dimensions {shapes[name]} ({what}), got shape {tuple(x.shape)}")
    assert isinstance(q, torch.Tensor) and isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor)
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(
            f"q, k_cache and v_cache must share a dtype, got q: {q.dtype}, k: {k_cache.dtype}, v: {v_cache.dtype}"
        )
    if not (q.device == k_cache.device == v_cache.device):
        raise ValueError(
            f"q, k_cache and v_cache must be on one device, got q: {q.device}, k: {k_cache.device}, v: {v_cache.device}"
        )
    if torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad):
        raise ValueError("PBS attention is forward-only and has no backward: q, k or v requires grad; call it "
                         "under torch.no_grad() or torch.inference_mode()")
    (pages_k, page_size, heads_k, dim_k), (pages_v, page_size_v, heads_v, dim_v) = k_cache.shape, v_cache.shape
    if page_size != page_size_v:
        raise ValueError(
            f"k and v caches must have one page_size (dim 1 of (num_pages, page_size, Hkv, D)), got "
            f"k: {page_size}, v: {page_size_v}"
        )
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(
            f"page_size (dim 1 of the caches) must be a power of two (e.g. 16, 64, 128 or 256: pages and "
            f"the kernels' key tiles then nest), got page_size = {page_size}"
        )
    if pages_k != pages_v or pages_k == 0:
        raise ValueError(f"k and v caches must have the same positive num_pages, got k: {pages_k}, v: {pages_v}")
    if heads_k != heads_v:
        raise ValueError(f"k and v caches must have the same number of heads Hkv, got k: {heads_k}, v: {heads_v}")
    if dim_k != q.shape[2]:
        raise ValueError(f"q and k_cache must share the head dim D, got q: {q.shape[2]}, k: {dim_k}")
    if dim_k == 0 or dim_v == 0:
        raise ValueError(f"head dims must be positive, got q: {tuple(q.shape)}, v: {tuple(v_cache.shape)}")
    heads_q = q.shape[1]
    if heads_q == 0 or heads_k == 0 or heads_q % heads_k:
        raise ValueError(
            f"the number of query heads (q.shape[1] = {heads_q}) must be a positive multiple of the number of "
            f"key/value heads (k.shape[2] = {heads_k})"
        )


def _read_paged_bounds(
    cu_seq_q: object, cu_seq_k: object, seqused_k: object, block_table: object, q: torch.Tensor, k_cache: torch.Tensor
) -> tuple[list[int], list[int]]:
    """Checks ``cu_seq_q``, ``seqused_k`` and ``block_table`` of a paged call and reads them on
    the host in one copy (the lengths, and per sequence whether a page it uses is out of range).

    Returns:
        ``(bounds_q, lengths_k)``: the ``N + 1`` query boundaries and the ``N`` key lengths.
    """
    if cu_seq_k is not None:
        raise ValueError(
            "cu_seq_k must be None with a paged cache (block_table): the key lengths are seqused_k alone "
            "(FlashAttention 2 reads them from cu_seq_k, FlashAttention 3 from seqused_k; one source "
            "leaves nothing to disagree)"
        )
    _check_cu_seq("cu_seq_q", cu_seq_q, q)
    assert isinstance(cu_seq_q, torch.Tensor)
    num_sequences = cu_seq_q.shape[0] - 1
    if seqused_k is None:
        raise ValueError("seqused_k is required with a paged cache (block_table): (N,) int32, the keys of each sequence")
    num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
    for name, x, shape, rank in (("seqused_k", seqused_k, "(N,)", 1), ("block_table", block_table, "(N, max_pages)", 2)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype != torch.int32:
            raise TypeError(
                f"{name} must have dtype torch.int32 (as in torch.nn.attention.varlen and FlashAttention), got "
                f"{x.dtype}; convert with {name}.to(torch.int32)"
            )
        if x.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {x.device}")
        if x.dim() != rank or x.shape[0] != num_sequences:
            raise ValueError(
                f"{name} must have shape {shape} with N = {num_sequences} sequences (len(cu_seq_q) - 1), got "
                f"shape {tuple(x.shape)}"
            )
    assert isinstance(seqused_k, torch.Tensor) and isinstance(block_table, torch.Tensor)
    max_pages = block_table.shape[1]
    # Pages a sequence uses, then whether any of them is out of range: worked out on the device so
    # that the one read below carries it with the lengths.
    used = (seqused_k.long().clamp(min=0) + page_size - 1) // page_size
    in_use = torch.arange(max_pages, device=q.device)[None, :] < used[:, None]
    out_of_range = in_use & ((block_table < 0) | (block_table >= num_pages))
    values = torch.cat((cu_seq_q, seqused_k, out_of_range.any(1).to(torch.int32))).tolist()
    bounds_q = values[: num_sequences + 1]
    lengths_k = values[num_sequences + 1 : 2 * num_sequences + 1]
    bad_pages = values[2 * num_sequences + 1 :]
    _check_bounds("cu_seq_q", bounds_q, q.shape[0], "Tq")
    capacity = max_pages * page_size
    for i, length in enumerate(lengths_k):
        len_q = bounds_q[i + 1] - bounds_q[i]
        if length < 0:
            raise ValueError(f"seqused_k[{i}] = {length} is negative; it counts the keys of sequence {i}")
        if length > capacity:
            raise ValueError(
                f"seqused_k[{i}] = {length} is more than the pages of block_table hold: max_pages * page_size "
                f"= {max_pages} * {page_size} = {capacity}"
            )
        if len_q > length:
            why = "it has queries but no keys" if length == 0 else (
                "queries are the last len_q of a sequence's seqused_k positions, so len_q <= seqused_k")
            raise ValueError(f"sequence {i} has len_q = {len_q} queries and seqused_k[{i}] = {length} keys: {why}")
        if bad_pages[i]:
            row = block_table[i, : -(-length // page_size)].tolist()  # the error path only: a second read
            j = next(j for j, page in enumerate(row) if not 0 <= page < num_pages)
            raise ValueError(
                f"block_table[{i}, {j}] = {row[j]} is not a page of the cache: page indices must lie in "
                f"0 .. num_pages - 1 = {num_pages - 1} (k.shape[0] = {num_pages}) for the "
                f"{len(row)} pages that sequence {i}'s seqused_k = {length} keys use"
            )
    return bounds_q, lengths_k


def _check_cu_seq(name: str, cu: object, q: torch.Tensor) -> None:
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


def _check_bounds(name: str, values: list[int], total: int, tensor_name: str) -> None:
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


def _read_bounds(
    cu_seq_q: object, cu_seq_k: object, q: torch.Tensor, k: torch.Tensor
) -> tuple[list[int], list[int]]:
    """Checks the two cumulative-length tensors and reads them on the host in one copy.

    Returns:
        ``(bounds_q, bounds_k)``: the ``N + 1`` boundaries of each as Python ints, checked.
    """
    for name, cu in (("cu_seq_q", cu_seq_q), ("cu_seq_k", cu_seq_k)):
        _check_cu_seq(name, cu, q)
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
        _check_bounds(name, values, total, tensor_name)
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


def _output_buffer(out: object, q: torch.Tensor, head_dim_v: int) -> torch.Tensor:
    shape = (q.shape[0], q.shape[1], head_dim_v)
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
