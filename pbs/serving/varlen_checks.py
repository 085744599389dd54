"""The argument rules of `pbs.varlen_attention`: packed and paged layouts, the cumulative
lengths and the block table, read on the host in one copy. Each function raises an error that
names the argument and what it accepts."""

from __future__ import annotations

import numbers

import torch

from pbs.validation import FLOAT_DTYPES


def check_packed_qkv(q: object, k: object, v: object) -> None:
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
    _check_forward_only_and_real(q, k, v)
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


def _check_forward_only_and_real(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The rules of `pbs.attention` that hold for the batch as a whole, checked before any sequence
    is split off, so that an empty batch is refused like a full one and a meta tensor is named
    before its lengths are read."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise ValueError("PBS attention is forward-only and has no backward: q, k or v requires grad; call it "
                         "under torch.no_grad() or torch.inference_mode(), or detach the inputs")
    if q.is_meta:  # q, k and v share a device here
        raise ValueError("meta tensors are not supported: planning reads the values of q and k, and the lengths "
                         "are read from cu_seq_q; use real tensors on 'cpu' or 'cuda'")


def check_paged_qkv(q: object, k_cache: object, v_cache: object) -> None:
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
    _check_forward_only_and_real(q, k_cache, v_cache)
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


def check_paged_arguments(cu_seq_q: object, cu_seq_k: object, seqused_k: object, block_table: object,
                          q: torch.Tensor) -> None:
    """The checks of a paged call's lengths and block table that read no value: types, dtypes,
    shapes and devices (all a CUDA graph capture allows)."""
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


def read_paged_bounds(
    cu_seq_q: object, cu_seq_k: object, seqused_k: object, block_table: object, q: torch.Tensor, k_cache: torch.Tensor
) -> tuple[list[int], list[int]]:
    """Checks ``cu_seq_q``, ``seqused_k`` and ``block_table`` of a paged call and reads them on
    the host in one copy (the lengths, and per sequence whether a page it uses is out of range).

    Returns:
        ``(bounds_q, lengths_k)``: the ``N + 1`` query boundaries and the ``N`` key lengths.
    """
    check_paged_arguments(cu_seq_q, cu_seq_k, seqused_k, block_table, q)
    assert isinstance(cu_seq_q, torch.Tensor)
    num_sequences = cu_seq_q.shape[0] - 1
    assert isinstance(seqused_k, torch.Tensor) and isinstance(block_table, torch.Tensor)
    out_of_range = _pages_out_of_range(seqused_k, block_table, k_cache)
    values = torch.cat((cu_seq_q, seqused_k, out_of_range.to(torch.int32))).tolist()
    bounds_q = values[: num_sequences + 1]
    lengths_k = values[num_sequences + 1 : 2 * num_sequences + 1]
    _check_paged_lengths(bounds_q, lengths_k, values[2 * num_sequences + 1 :], q, block_table, k_cache)
    return bounds_q, lengths_k


def check_paged_host_bounds(
    host_bounds: object, cu_seq_q: object, cu_seq_k: object, seqused_k: object, block_table: object,
    q: torch.Tensor, k_cache: torch.Tensor,
) -> tuple[list[int], list[int]]:
    """`read_paged_bounds` for a caller that holds ``cu_seq_q``'s and ``seqused_k``'s values on the
    host already (``host_bounds = (bounds_q, lengths_k)``): the same checks, no device read. The
    page indices are checked where that reads nothing on the host (a CPU cache); on CUDA they are
    the caller's to keep in range, as in a capturable call.

    Returns:
        ``(bounds_q, lengths_k)`` as lists of ints.
    """
    check_paged_arguments(cu_seq_q, cu_seq_k, seqused_k, block_table, q)
    assert isinstance(cu_seq_q, torch.Tensor) and isinstance(block_table, torch.Tensor)
    entries = cu_seq_q.shape[0]
    bounds_q, lengths_k = _host_lists(host_bounds, "seqused_k", (entries, entries - 1))
    _check_bounds("cu_seq_q", bounds_q, q.shape[0], "Tq")
    bad_pages = None
    if not q.is_cuda:
        assert isinstance(seqused_k, torch.Tensor)
        bad_pages = _pages_out_of_range(torch.tensor(lengths_k, dtype=torch.int32), block_table, k_cache).tolist()
    _check_paged_lengths(bounds_q, lengths_k, bad_pages, q, block_table, k_cache)
    return bounds_q, lengths_k


def _pages_out_of_range(lengths_k: torch.Tensor, block_table: torch.Tensor, k_cache: torch.Tensor) -> torch.Tensor:
    """``(N,)`` bool: whether a page a sequence uses (of its ``lengths_k`` keys) is not a page of
    the cache, worked out on the table's device."""
    num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
    used = (lengths_k.to(block_table.device).long().clamp(min=0) + page_size - 1) // page_size
    in_use = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < used[:, None]
    return (in_use & ((block_table < 0) | (block_table >= num_pages))).any(1)


def _check_paged_lengths(bounds_q: list[int], lengths_k: list[int], bad_pages: list[int] | None, q: torch.Tensor,
                         block_table: torch.Tensor, k_cache: torch.Tensor) -> None:
    """The per-sequence checks of a paged call: query bounds, key counts against the pages the
    table holds and against the queries, and (``bad_pages`` not None) the pages in range."""
    num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
    max_pages = block_table.shape[1]
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
        if bad_pages is not None and bad_pages[i]:
            row = block_table[i, : -(-length // page_size)].tolist()  # the error path only: a second read
            j = next(j for j, page in enumerate(row) if not 0 <= page < num_pages)
            raise ValueError(
                f"block_table[{i}, {j}] = {row[j]} is not a page of the cache: page indices must lie in "
                f"0 .. num_pages - 1 = {num_pages - 1} (k.shape[0] = {num_pages}) for the "
                f"{len(row)} pages that sequence {i}'s seqused_k = {length} keys use"
            )


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


def check_cu_seqs(cu_seq_q: object, cu_seq_k: object, q: torch.Tensor) -> None:
    """The checks of two cumulative-length tensors that read no value: types, dtypes, shapes, devices."""
    for name, cu in (("cu_seq_q", cu_seq_q), ("cu_seq_k", cu_seq_k)):
        _check_cu_seq(name, cu, q)
    assert isinstance(cu_seq_q, torch.Tensor) and isinstance(cu_seq_k, torch.Tensor)
    if cu_seq_q.shape != cu_seq_k.shape:
        raise ValueError(
            "cu_seq_q and cu_seq_k must have the same length N + 1 (one entry per sequence boundary), "
            f"got {cu_seq_q.shape[0]} and {cu_seq_k.shape[0]}"
        )


def read_bounds(
    cu_seq_q: object, cu_seq_k: object, q: torch.Tensor, k: torch.Tensor
) -> tuple[list[int], list[int]]:
    """Checks the two cumulative-length tensors and reads them on the host in one copy.

    Returns:
        ``(bounds_q, bounds_k)``: the ``N + 1`` boundaries of each as Python ints, checked.
    """
    check_cu_seqs(cu_seq_q, cu_seq_k, q)
    assert isinstance(cu_seq_q, torch.Tensor) and isinstance(cu_seq_k, torch.Tensor)
    entries = cu_seq_q.shape[0]
    # The one host read of the call (a sync on CUDA): both tensors in one copy.
    both = torch.cat((cu_seq_q, cu_seq_k)).tolist()
    bounds = {"cu_seq_q": both[:entries], "cu_seq_k": both[entries:]}
    for (name, values), total, tensor_name in zip(bounds.items(), (q.shape[0], k.shape[0]), ("Tq", "Tk")):
        _check_bounds(name, values, total, tensor_name)
    bounds_q, bounds_k = bounds["cu_seq_q"], bounds["cu_seq_k"]
    _check_query_counts(bounds_q, bounds_k)
    return bounds_q, bounds_k


def check_host_bounds(host_bounds: object, cu_seq_q: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                      ) -> tuple[list[int], list[int]]:
    """``host_bounds = (bounds_q, bounds_k)``, the values of ``cu_seq_q`` and ``cu_seq_k`` a caller
    already holds on the host, checked as `read_bounds` checks what it reads (no device read).

    Returns:
        ``(bounds_q, bounds_k)`` as lists of ints.
    """
    entries = cu_seq_q.shape[0]
    bounds_q, bounds_k = _host_lists(host_bounds, "cu_seq_k", (entries, entries))
    for (name, values), total, tensor_name in zip((("cu_seq_q", bounds_q), ("cu_seq_k", bounds_k)),
                                                  (q.shape[0], k.shape[0]), ("Tq", "Tk")):
        _check_bounds(name, values, total, tensor_name)
    _check_query_counts(bounds_q, bounds_k)
    return bounds_q, bounds_k


def _host_lists(host_bounds: object, keys: str, entries: tuple[int, int]) -> tuple[list[int], list[int]]:
    """``host_bounds``'s two lists of ints, of ``entries`` lengths: the values of ``cu_seq_q`` and of
    ``keys`` (``cu_seq_k`` for packed keys, ``seqused_k`` for a paged cache)."""
    if not (isinstance(host_bounds, (tuple, list)) and len(host_bounds) == 2):
        raise TypeError(f"host_bounds must be a pair: the {entries[0]} values of cu_seq_q and the {entries[1]} of "
                        f"{keys} on the host, got {type(host_bounds).__name__}")
    lists = []
    for name, values in zip(("host_bounds[0]", "host_bounds[1]"), host_bounds):
        try:
            lists.append([int(b) for b in values])
        except (TypeError, ValueError):
            raise TypeError(f"{name} must be a sequence of ints, got {values!r}") from None
    (first, second), (want_first, want_second) = lists, entries
    if len(first) != want_first or len(second) != want_second:
        raise ValueError(f"host_bounds must hold the {want_first} values of cu_seq_q and the {want_second} of {keys}, "
                         f"got {len(first)} and {len(second)}")
    return first, second


def _check_query_counts(bounds_q: list[int], bounds_k: list[int]) -> None:
    for i in range(len(bounds_q) - 1):
        len_q, len_k = bounds_q[i + 1] - bounds_q[i], bounds_k[i + 1] - bounds_k[i]
        if len_q > len_k:
            why = "it has queries but no keys" if len_k == 0 else (
                "queries are the last len_q of a sequence's len_k positions, so len_q <= len_k")
            raise ValueError(f"sequence {i} has len_q = {len_q} queries and len_k = {len_k} keys: {why}")


def check_max_length(name: str, value: object, bounds: list[int], kind: str) -> None:
    longest = max((end - start for start, end in zip(bounds, bounds[1:])), default=0)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int (the longest {kind} sequence, {longest} here), got {type(value).__name__}")
    if value < longest:
        raise ValueError(f"{name} must be at least the longest {kind} sequence, {longest}, got {name} = {value}")


def output_buffer(out: object, q: torch.Tensor, head_dim_v: int) -> torch.Tensor:
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
