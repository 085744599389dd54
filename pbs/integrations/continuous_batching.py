"""PBS in transformers' continuous batching: attention over one step's packed batch of requests.

transformers' continuous batching (``model.generate_batch(...)``, the ``ContinuousBatchingManager``)
runs many requests at once. Every step packs the new tokens of the scheduled requests along one
axis (a whole prompt, a chunk of a long prompt, or one decode token each) and reads each request's
cached keys back from a paged cache. For an attention implementation whose name contains
"flash", each layer's attention function then receives that step as one call:

* ``query (1, Hq, Tq, D)``: the new tokens of every request, packed;
* ``key, value (1, Hkv, Tk, D)``: each request's cached prefix followed by its new tokens, packed;
* ``cu_seq_lens_q``, ``cu_seq_lens_k``: ``(N + 1,)`` cumulative lengths of both, and no mask.

That is the layout of `pbs.varlen_attention`. `unpack_call` reads such a call (in both argument
conventions transformers has used, below), and `attend_packed` runs it request by request: the
requests given a `PBSConfig` run through `pbs.varlen_attention` (each planned on its own), the
others run dense SDPA, the decode tokens among them in one batched call.

The name transformers sees is `CONTINUOUS_BATCHING_NAME`, ``"pbs_flash_varlen"``. It contains
"flash" because continuous batching accepts nothing else but ``"sdpa"`` and ``"paged|eager"``
(5.24 refuses other names; 5.17 replaces them by ``flash_attention_2``/``3`` where FlashAttention is
installed), and because only for "flash" names does it pass the packed layout without building a
``(Tq, Tk)`` mask over the whole batch. It holds no digit: transformers reads ``flash...2`` and
``flash...3`` as FlashAttention 2 and 3 and then, on CUDA, decodes with ``flash_attn_with_kvcache``
over a block table instead of calling the attention function on packed K/V.

The two conventions:

* **transformers 5.24** (bare names): the decoder layer writes the new keys and values into the
  paged cache and reads each request's keys back before calling attention, so ``key``/``value``
  arrive packed; ``cu_seq_lens_k`` is a tensor; the lengths are ``max_length_q``/``max_length_k``.
* **transformers 5.17** (``"paged|<name>"`` names): the attention function gets the paged cache
  (``cache``, ``read_index``, ``write_index``) and must update it itself, as transformers' own
  ``paged|sdpa`` does; ``cu_seq_lens_k`` may be a dict per layer type; the lengths are
  ``max_seqlen_q``/``max_seqlen_k``.

This module needs no transformers import (the cache is used through its ``update`` method), so it
imports without transformers installed.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from pbs.api import attend
from pbs.config import PBSConfig
from pbs.dense import DensePolicy, dense_attention
from pbs.serving import varlen_attention

__all__ = ["CONTINUOUS_BATCHING_NAME", "Measured", "PackedBatch", "attend_packed", "unpack_call"]

CONTINUOUS_BATCHING_NAME = "pbs_flash_varlen"


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """One continuous-batching attention call, split by request.

    Request ``i`` owns queries ``bounds_q[i]:bounds_q[i+1]`` and keys ``bounds_k[i]:bounds_k[i+1]``
    of the packed tensors; its queries are the last ``q_len`` of its ``kv_len`` positions.

    Attributes:
        key: ``(1, Hkv, Tk, D)``: every request's keys (cached prefix, then its new tokens), packed.
        value: ``(1, Hkv, Tk, Dv)``, packed as ``key``.
        bounds_q: the ``N + 1`` query boundaries (``cu_seq_lens_q`` read on the host). The last may
            fall short of the query tensor's length: transformers pads steps it captures or compiles.
        bounds_k: the ``N + 1`` key boundaries (``cu_seq_lens_k``), likewise.
        cu_seq: ``(2, N + 1)`` int32 on the device, both boundaries as transformers passed them
            (None: made from the host boundaries when needed), so that a run of requests slices
            them on the device instead of copying host lists over (a sync each).
    """

    key: torch.Tensor
    value: torch.Tensor
    bounds_q: list[int]
    bounds_k: list[int]
    cu_seq: torch.Tensor | None = None

    def lengths(self) -> list[tuple[int, int]]:
        """``(q_len, kv_len)`` of every request, in batch order."""
        bq, bk = self.bounds_q, self.bounds_k
        return [(bq[i + 1] - bq[i], bk[i + 1] - bk[i]) for i in range(len(bq) - 1)]


@dataclasses.dataclass(frozen=True)
class Measured:
    """What a request given to PBS ran, measured for a trace.

    Attributes:
        density: the share of causally allowed blocks computed (``None`` where it ran dense).
        dense_reason: why ``PBSConfig.dense_fallback`` ran it dense (the text of
            `pbs.dense.Attended.reason`), or ``None`` where PBS ran.
    """

    density: float | None
    dense_reason: str | None


def unpack_call(module: torch.nn.Module, key: torch.Tensor, value: torch.Tensor, kwargs: dict[str, Any]) -> PackedBatch | None:
    """Reads a continuous-batching attention call; ``None`` for any other call.

    Under transformers 5.17 this also writes the step's new keys and values into the paged cache
    and reads every request's keys back (``cache.update``), which the attention function must do
    there; call it once per attention call.

    Args:
        module: the attention layer (``layer_idx``; ``sliding_window`` picks the layer type of a
            per-type ``cu_seq_lens_k``).
        key, value: ``(1, Hkv, T, D)`` as the layer passes them: already packed with the cache
            (5.24), or this step's new tokens only (5.17, with ``cache`` in ``kwargs``).
        kwargs: the attention function's keyword arguments.

    Returns:
        A `PackedBatch`, or ``None`` when ``kwargs`` hold no ``cu_seq_lens_q``/``cu_seq_lens_k``.

    Raises:
        NotImplementedError: a decode step over a block table (``block_table``), or attention
            sinks (``s_aux``).
        ValueError: boundaries that do not fit the tensors.
    """
    cu_seq_q, cu_seq_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_seq_q is None or cu_seq_k is None:
        return None
    if kwargs.get("block_table") is not None:
        raise NotImplementedError(
            f"{CONTINUOUS_BATCHING_NAME}: continuous batching passed a block table (the flash_attn_with_kvcache "
            "decode path), which this attention function does not read; that path is meant for "
            "flash_attention_2/3 only. Set ContinuousBatchingConfig(max_blocks_per_request=0)"
        )
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError(f"{CONTINUOUS_BATCHING_NAME}: attention sinks (s_aux) are not supported")
    cache = kwargs.get("cache")
    if cache is not None and _updates_with_indices(type(cache)):
        # transformers 5.17: the attention function updates the paged cache itself (as its paged|sdpa
        # does); update returns the packed keys as (Tk, Hkv, D).
        key, value = cache.update(
            key_states=key, value_states=value, layer_idx=module.layer_idx,
            read_index=kwargs["read_index"], write_index=kwargs["write_index"],
        )
        key, value = (x.transpose(0, 1).unsqueeze(0) for x in (key, value))
    if isinstance(cu_seq_k, dict):  # one entry per layer type, as transformers' flash_paged picks it
        cu_seq_k = cu_seq_k["sliding_attention" if getattr(module, "sliding_window", None) else "full_attention"]
    entries = cu_seq_q.shape[0]
    if cu_seq_k.shape[0] != entries:
        raise ValueError(
            f"cu_seq_lens_q and cu_seq_lens_k must have one entry per request boundary each, got "
            f"{entries} and {cu_seq_k.shape[0]}"
        )
    # The one host read of the call (a sync on CUDA): both boundary tensors in one copy.
    cu_seq = torch.stack((cu_seq_q.reshape(-1).to(torch.int32), cu_seq_k.reshape(-1).to(torch.int32)))
    both = cu_seq.tolist()
    bounds_q, bounds_k = both
    if bounds_k[-1] > key.shape[2]:
        raise ValueError(f"cu_seq_lens_k ends at {bounds_k[-1]}, past the {key.shape[2]} packed keys")
    return PackedBatch(key, value, bounds_q, bounds_k, cu_seq)


@functools.lru_cache(maxsize=None)
def _updates_with_indices(cache_type: type) -> bool:
    """Whether ``cache_type.update`` takes ``read_index``/``write_index``: the 5.17 paged cache, which
    the attention function updates. (5.24's takes ``kwargs`` and is updated by the layer.)"""
    try:
        return "read_index" in inspect.signature(cache_type.update).parameters
    except (AttributeError, TypeError, ValueError):
        return False


def attend_packed(
    query: torch.Tensor,
    batch: PackedBatch,
    configs: Sequence[PBSConfig | None],
    *,
    scale: float | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    softcap: float | None = None,
    measure: bool = False,
) -> tuple[torch.Tensor, dict[int, Measured]]:
    """Attention over a packed continuous-batching step: PBS for the requests given a config, dense
    SDPA for the others.

    Consecutive requests given the same config go to `pbs.varlen_attention` in one call, on views of
    the packed tensors (no copy); each is planned on its own, so its output is what `pbs.attention`
    gives on it alone. Requests given ``None`` run dense: the decode tokens (one query each) together
    in one SDPA call over their keys gathered and padded to the longest, each longer one in an SDPA
    call of its own. Dense attention is causal with the queries last, within ``sliding_window`` when
    one is given, and eager with ``softcap`` when one is given.

    Args:
        query: ``(1, Hq, Tq, D)``: every request's new tokens, packed.
        batch: the call's keys, values and boundaries (`unpack_call`).
        configs: one entry per request: the `PBSConfig` to run it with, or ``None`` for dense.
        scale: softmax scale (``None``: ``D ** -0.5``).
        causal: whether dense requests attend causally (PBS is always causal).
        sliding_window: the layer's window (a query sees the keys less than this many positions
            back), for dense requests; ``None`` for none.
        softcap: logit softcapping ``softcap * tanh(scores / softcap)`` for dense requests.
        measure: also run each PBS request's solo `pbs.api.attend` call (the one
            `pbs.varlen_attention` makes for it) to learn its density and whether
            ``dense_fallback`` ran it dense: twice the work, for traces only.

    Returns:
        ``(out, measured)``: ``out (1, Tq, Hq, Dv)`` in ``query``'s dtype, the layout transformers'
        flash attention returns (rows past the last boundary are zeros); ``measured`` maps the
        index of each PBS request to its `Measured` when ``measure``, else it is empty.

    Raises:
        RuntimeError: called while a CUDA graph is being captured.
        ValueError: ``configs`` of the wrong length, or boundaries past the tensors.
    """
    if query.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{CONTINUOUS_BATCHING_NAME} cannot run inside a CUDA graph: it reads each step's request lengths "
            "on the host. transformers' continuous batching captures graphs by default for 'flash' names on "
            "CUDA: pass ContinuousBatchingConfig(use_cuda_graph=False)"
        )
    lengths = batch.lengths()
    if len(configs) != len(lengths):
        raise ValueError(f"configs has {len(configs)} entries for {len(lengths)} requests")
    if batch.bounds_q[-1] > query.shape[2]:
        raise ValueError(f"cu_seq_lens_q ends at {batch.bounds_q[-1]}, past the {query.shape[2]} packed queries")
    total_q, heads_q = query.shape[2], query.shape[1]
    value_dim = batch.value.shape[-1]
    padded = batch.bounds_q[-1] < total_q
    out = query.new_zeros(total_q, heads_q, value_dim) if padded else query.new_empty(total_q, heads_q, value_dim)
    dense = dict(scale=scale, causal=causal, sliding_window=sliding_window, softcap=softcap)
    measured: dict[int, Measured] = {}
    decode_rows: list[int] = []
    first = 0
    while first < len(lengths):
        q_len, kv_len = lengths[first]
        config = configs[first]
        if q_len == 0:  # a request with nothing new this step, or a padding entry
            first += 1
        elif config is None and q_len == 1:
            decode_rows.append(first)
            first += 1
        elif config is None:
            _dense_request(query, batch, first, out, **dense)
            first += 1
        else:
            last = first
            while last + 1 < len(lengths) and configs[last + 1] is config and lengths[last + 1][0] > 0:
                last += 1
            _pbs_requests(query, batch, first, last, config, out, scale)
            if measure:
                measured.update(_measure(query, batch, range(first, last + 1), config, scale))
            first = last + 1
    if decode_rows:
        _dense_decode_rows(query, batch, decode_rows, out, **dense)
    return out.unsqueeze(0), measured


def _packed(x: torch.Tensor) -> torch.Tensor:
    """``(1, H, T, D)`` as ``(T, H, D)``: a view."""
    return x[0].transpose(0, 1)


def _request_view(x: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Tokens ``start:end`` of a packed ``(1, H, T, D)`` tensor: a view."""
    return x[:, :, start:end]


def _pbs_requests(
    query: torch.Tensor, batch: PackedBatch, first: int, last: int, config: PBSConfig, out: torch.Tensor,
    scale: float | None,
) -> None:
    """Requests ``first..last`` (consecutive, one config) through `pbs.varlen_attention`, into ``out``."""
    bq, bk = batch.bounds_q, batch.bounds_k
    q_start, q_end, k_start, k_end = bq[first], bq[last + 1], bk[first], bk[last + 1]
    # The boundaries of this run, rebased to its first token (the packed views below start there).
    run_q = [b - q_start for b in bq[first : last + 2]]
    run_k = [b - k_start for b in bk[first : last + 2]]
    if batch.cu_seq is not None and batch.cu_seq.device == query.device:
        # Sliced and rebased on the device: the boundaries were read once already (unpack_call).
        cu_seq = batch.cu_seq[:, first : last + 2] - batch.cu_seq[:, first : first + 1]
    else:
        cu_seq = torch.tensor([run_q, run_k], dtype=torch.int32, device=query.device)
    varlen_attention(
        _packed(query)[q_start:q_end], _packed(batch.key)[k_start:k_end], _packed(batch.value)[k_start:k_end],
        cu_seq[0], cu_seq[1], max(b - a for a, b in zip(run_q, run_q[1:])), max(b - a for a, b in zip(run_k, run_k[1:])),
        config, scale=scale, out=out[q_start:q_end], host_bounds=(run_q, run_k),
    )


def _measure(
    query: torch.Tensor, batch: PackedBatch, requests: range, config: PBSConfig, scale: float | None
) -> dict[int, Measured]:
    """Each request's solo `pbs.api.attend` call, the one `pbs.varlen_attention` made for it."""
    bq, bk = batch.bounds_q, batch.bounds_k
    measured = {}
    for i in requests:
        k = _request_view(batch.key, bk[i], bk[i + 1])
        v = _request_view(batch.value, bk[i], bk[i + 1])
        attended = attend(_request_view(query, bq[i], bq[i + 1]), k, v, DensePolicy(config), scale=scale)
        if attended.reason is not None:
            measured[i] = Measured(None, attended.reason)
        else:
            assert attended.plan is not None
            measured[i] = Measured(float(attended.plan.density), None)
    return measured


def _dense_request(
    query: torch.Tensor, batch: PackedBatch, i: int, out: torch.Tensor, *, scale: float | None, causal: bool,
    sliding_window: int | None, softcap: float | None,
) -> None:
    """Request ``i`` (more than one query) through dense attention, into ``out``."""
    bq, bk = batch.bounds_q, batch.bounds_k
    q = _request_view(query, bq[i], bq[i + 1])
    k, v = _request_view(batch.key, bk[i], bk[i + 1]), _request_view(batch.value, bk[i], bk[i + 1])
    q_len, kv_len = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    windowed = causal and sliding_window is not None and kv_len > sliding_window
    if softcap is None and not windowed:
        result = dense_attention(q, k, v, scale=scale, causal=causal)
    else:
        visible = None
        if causal:  # query r sits at position kv_len - q_len + r
            positions = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
            keys = torch.arange(kv_len, device=q.device)[None, :]
            visible = keys <= positions
            if windowed:
                visible &= keys > positions - sliding_window
            visible = visible[None, None]
        result = _masked_attention(q, k, v, visible, scale, softcap)
    out[bq[i] : bq[i + 1]] = result[0].transpose(0, 1)


def _dense_decode_rows(
    query: torch.Tensor, batch: PackedBatch, requests: list[int], out: torch.Tensor, *, scale: float | None,
    causal: bool, sliding_window: int | None, softcap: float | None,
) -> None:
    """The requests of one query each (decode tokens) in one dense call, into ``out``.

    Each row's keys are gathered and padded to the longest row (a copy of the keys read, no more), so
    the cost is that of one query per request over its own keys, not over the whole batch.
    """
    del causal  # one query, last of its keys: causal or not, it sees all of them
    device = query.device
    bq, bk = batch.bounds_q, batch.bounds_k
    rows = torch.tensor([bq[i] for i in requests], device=device)
    starts = torch.tensor([bk[i] for i in requests], device=device)[:, None]
    lengths = torch.tensor([bk[i + 1] - bk[i] for i in requests], device=device)[:, None]
    offsets = torch.arange(int(max(bk[i + 1] - bk[i] for i in requests)), device=device)[None, :]
    visible = offsets < lengths  # (n, L): the padding past a row's own keys is masked
    if sliding_window is not None:
        visible &= offsets > lengths - 1 - sliding_window
    index = torch.where(visible, starts + offsets, starts)  # padding reads the row's first key
    k = batch.key[0][:, index].transpose(0, 1)  # (n, Hkv, L, D)
    v = batch.value[0][:, index].transpose(0, 1)
    q = query[0][:, rows].transpose(0, 1).unsqueeze(2)  # (n, Hq, 1, D)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    result = _masked_attention(q, k, v, visible[:, None, None, :], scale, softcap)  # (n, Hq, 1, Dv)
    out[rows] = result[:, :, 0].to(out.dtype)


def _masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None, scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """Dense attention under a boolean mask (``True`` = attend; ``None`` = all keys), GQA without
    repeating K/V through SDPA, and eager with the K/V heads repeated when logits are softcapped.

    Args:
        q: ``(B, Hq, Nq, D)``; k: ``(B, Hkv, Nk, D)``; v: ``(B, Hkv, Nk, Dv)``.
        visible: broadcastable to ``(B, Hq, Nq, Nk)``, or ``None``.

    Returns:
        ``(B, Hq, Nq, Dv)`` in ``q``'s dtype.
    """
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)).float() * scale
    scores = torch.tanh(scores / softcap) * softcap
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)
