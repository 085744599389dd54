"""`pbs.varlen_attention(..., capturable=True)`: the varlen call with no host read, for CUDA graphs.

A serving engine captures its forward once per bucket of maxima and replays it with new lengths.
Every launch here therefore has a shape fixed by ``(Tq, Tk, N, max_q, max_k)`` and the tensors'
own shapes, and every decision that depends on the lengths is taken on the device:

1. the sequences' keys and values are written into token-major padded buffers, viewed as
   ``(N, H, max, D)`` (`pbs.backends.padding`: one Triton launch per tensor on CUDA), and the
   queries too unless the backend declares ``ragged_rows`` (then every step reads them packed);
2. each is planned as it is alone (the ``ragged`` planners, `pbs.backends.ragged_planners`), and
   `pbs.dense.DensePolicy.sequence_decisions` evaluates the dense rules per sequence on the
   device; a sequence that decides dense gets every allowed block (dense attention on the
   block-sparse kernel, as paged calls run it eagerly);
3. one launch of a backend that declares ``capturable`` attends all sequences, each query reading
   its own causal offset from the query positions; a backend that also declares ``ragged_rows``
   (the Gluon kernel) reads the packed queries, computes only each sequence's own rows and writes
   them packed, another's rows are scattered back to the packing.

What it costs against the eager path: K/V are copied into the padded buffers (the eager path reads
them in place); the planners' grids are sized by the maxima, though rows past a sequence's queries,
and the sequences the length and probe rules send to dense attention, are not ranked; and dense
sequences run on the block-sparse kernel instead of cuDNN.
"""

from __future__ import annotations

import torch

from pbs.backends import AttentionCall, CallSpec, get_backend, list_backends, resolve_backend
from pbs.backends.padding import pad_packed, pad_paged
from pbs.backends.ragged_planners import RaggedInputs, block_means, member_mask, probe_counters, ragged_reasons
from pbs.config import PBSConfig
from pbs.dense import DensePolicy
from pbs.ragged_layout import RaggedGeometry, ragged_geometry
from pbs.serving.ragged import flat_slots, unpad_rows
from pbs.types import BlockMask, Permutation, Plan, block_index_dtype
from pbs.validation import check_all_finite


def check_capturable_config(config: PBSConfig) -> None:
    """Raises a ``ValueError`` naming what of ``config`` the capturable path cannot run: the reasons
    come from what is declared (the ``ragged`` planners registered, `AttentionBackend.capturable`),
    not from a list of names kept here."""
    reasons = ragged_reasons(config)
    if not config.causal:
        reasons.append("config.causal must be True (causal attention only)")
    if config.backend != "auto" and not get_backend(config.backend).capturable:
        capturable = [name for name in list_backends() if get_backend(name).capturable]
        reasons.append(f"config.backend {config.backend!r} does not declare capturable; backends that do: "
                       f"{', '.join(capturable)} (or 'auto')")
    if reasons:
        raise ValueError("capturable=True cannot run this config: " + "; ".join(reasons)
                         + ". Call varlen_attention without capturable for it")


def plan_ragged(config: PBSConfig, geometry: RaggedGeometry, q: torch.Tensor, k: torch.Tensor,
                scale: float, q_row_starts: torch.Tensor | None = None) -> tuple[BlockMask, torch.Tensor | None]:
    """The block mask of every sequence of padded ``q (N, Hq, Tq*B, D)`` (or, with
    ``q_row_starts``, the packed ``(Tq, Hq, D)`` queries starting there), ``k (N, Hkv, Tk*B, D)``,
    and the per-sequence dense decisions (None where the policy does not apply).

    The length, planning-cost and probe rules are decided first, so that the planners skip the
    sequences they send to dense attention (as the eager path plans none of them); the
    planned-density rule then reads the lists. A dense sequence's rows are replaced by every allowed block in the lists
    themselves: no ``(N, Hq, Tq, Tk)`` bool mask is built on the GPU path.

    Returns:
        ``(mask, dense)``: a `BlockMask` over the padded layout whose lists name only blocks of
        each sequence's own grid (a dense sequence: all its allowed blocks).
    """
    hq = q.shape[1]
    layout = geometry.layout(hq, k.shape[1])
    policy = DensePolicy(config)
    if policy.all_dense_by_shape(geometry.padded_len_q, geometry.padded_len_k, geometry.device):
        # Known from the padded shapes: every sequence is dense by length or planning cost: nothing is planned.
        counts, indices, full = geometry.every_allowed_block(block_index_dtype(layout.num_key_blocks))
        shape = (geometry.batch, hq, layout.num_query_blocks)
        return (BlockMask(counts.expand(shape).contiguous(), indices.expand(*shape, -1).contiguous(), layout,
                          full.expand(shape).contiguous()),
                torch.ones(geometry.batch, dtype=torch.bool, device=q.device))
    by_shape = policy.sequence_decisions(geometry.len_q, geometry.len_k, None, shapes_only=True)
    len_q, len_k = ((geometry.len_q, geometry.len_k) if by_shape is None else
                    (torch.where(by_shape, 0, geometry.len_q), torch.where(by_shape, 0, geometry.len_k)))
    # The sequences dense by their shapes are not pooled (their blocks average nothing: zeros).
    pooled = (block_means(q, len_q, geometry.block_size, q_row_starts, geometry.padded_len_q),
              block_means(k, len_k, geometry.block_size))
    probe_args = policy.probe_arguments(scale)
    counters = None if probe_args is None else probe_counters(geometry, *pooled, probe_args)
    decided = policy.sequence_decisions(geometry.len_q, geometry.len_k, counters)
    inputs = RaggedInputs(geometry, q, k, pooled, scale, config.force_sink_block,
                          planned=None if decided is None else ~decided, q_row_starts=q_row_starts)
    mask = member_mask(config.selector, inputs)
    full = mask.known_full_counts
    dense = None
    if decided is not None:
        selected_blocks = mask.counts.sum((1, 2), dtype=torch.float64)
        allowed_blocks = geometry.allowed_counts.sum(1, dtype=torch.float64) * hq
        dense = policy.sequence_decisions(geometry.len_q, geometry.len_k, counters, selected_blocks, allowed_blocks)
        mask, full = _dense_rows(mask, full, dense, geometry)
    if full is None:
        full = geometry.full_counts(mask.counts, mask.indices)
    return BlockMask(mask.counts, mask.indices, layout, full), dense


def _dense_rows(mask: BlockMask, full: torch.Tensor | None, dense: torch.Tensor, geometry: RaggedGeometry
                ) -> tuple[BlockMask, torch.Tensor | None]:
    """``mask`` with the rows of the ``(N,)`` dense sequences listing every allowed block, and its
    ``full`` split likewise (None stays None)."""
    counts, indices, every_full = geometry.every_allowed_block(mask.indices.dtype)
    rows = dense[:, None, None]
    mask = BlockMask(torch.where(rows, counts, mask.counts), torch.where(rows[..., None], indices, mask.indices),
                     mask.layout)
    return mask, None if full is None else torch.where(rows, every_full, full)


def capturable_backend(config: PBSConfig, q: torch.Tensor, v: torch.Tensor, return_lse: bool):
    """The backend ``config.backend`` resolves to for a capturable call on ``q``'s device and
    dtype; a ``ValueError`` with every backend's reason when none can run it."""
    spec = CallSpec.of(q, v.shape[-1], config.block_size, needs_lse=return_lse, capturable=True,
                       precision=config.precision)
    return resolve_backend(config.backend, spec)


def attend_padded(config: PBSConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask,
                  query_positions: torch.Tensor, scale: float, out: torch.Tensor, cu_seq_q: torch.Tensor,
                  return_lse: bool) -> torch.Tensor | None:
    """One launch of the backend ``config.backend`` resolves to over the padded batch, its rows
    written to the packed ``out (Tq, Hq, Dv)``; returns the packed LSE ``(Hq, Tq)``, or None.

    A backend that declares ``ragged_rows`` takes the packed queries ``q (Tq, Hq, D)``, computes
    only each sequence's own rows and writes them packed itself; another takes them padded,
    ``(N, Hq, rows, D)``, and its rows are then copied to the packing."""
    backend = capturable_backend(config, q, v, return_lse)
    n, hq = mask.layout.batch, mask.layout.heads_q
    positions = query_positions[:, None, :].expand(n, hq, -1)
    nothing_moved = (Permutation.identity(n, k.shape[1], k.shape[2], k.device),
                     Permutation.identity(n, hq, mask.layout.seq_len_q, q.device))
    plan = Plan(*nothing_moved, mask=mask, config=config, backend=backend.name)
    if backend.ragged_rows:
        result = backend.run(AttentionCall(q, k, v, plan, scale, return_lse, out=out, query_positions=positions,
                                           row_starts=cu_seq_q.to(torch.int32)))
        return result[1] if return_lse else None
    # Token-major like the padded inputs, so that unpadding copies whole token rows.
    o_pad = torch.empty(n, q.shape[2], hq, v.shape[-1], dtype=q.dtype, device=q.device).transpose(1, 2)
    result = backend.run(AttentionCall(q, k, v, plan, scale, return_lse, out=o_pad, query_positions=positions))
    o_pad, lse_pad = result if return_lse else (result, None)
    return write_packed(out, o_pad, lse_pad, cu_seq_q)


def capturable_varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor | None,
    max_q: int, max_k: int, config: PBSConfig, *, scale: float, out: torch.Tensor, return_lse: bool,
    block_table: torch.Tensor | None = None, seqused_k: torch.Tensor | None = None, check_finite: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The work of `pbs.varlen_attention` with ``capturable=True``, on checked arguments: ``out``
    filled, and the ``(Hq, Tq)`` LSE when asked. Launch shapes depend on the arguments' shapes and
    ``max_q``/``max_k`` only; no tensor is read on the host, except by ``check_finite`` (a scan
    of the queries and of the keys and values of the sequences that have queries, as the eager
    call reads them; never inside a capture)."""
    # Refused before anything is launched; a backend that declares ragged_rows reads the packed queries.
    packed_queries = capturable_backend(config, q, v, return_lse).ragged_rows
    geometry, queries, k_pad, v_pad = pad_batch(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, config.block_size,
                                                block_table, seqused_k, packed_queries=packed_queries)
    if check_finite:
        check_all_finite({"q": q, "k": k_pad[geometry.len_q > 0], "v": v_pad[geometry.len_q > 0]})
    mask, _ = plan_ragged(config, geometry, queries, k_pad, scale, cu_seq_q if packed_queries else None)
    lse = attend_padded(config, queries, k_pad, v_pad, mask, geometry.query_positions(), scale, out, cu_seq_q,
                        return_lse)
    return out, lse


def pad_batch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor | None,
    max_q: int, max_k: int, block_size: int, block_table: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None, packed_queries: bool = False,
) -> tuple[RaggedGeometry, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The geometry and the padded ``(N, H, rows, D)`` q, k, v of a packed (or, with
    ``block_table`` and ``seqused_k``, paged) batch, with the lengths read on the device;
    ``packed_queries``: ``q`` is returned as it is (packed), not padded."""
    len_q = (cu_seq_q[1:] - cu_seq_q[:-1]).long()
    if block_table is not None:
        assert seqused_k is not None
        len_k = seqused_k.long()
    else:
        assert cu_seq_k is not None
        len_k = (cu_seq_k[1:] - cu_seq_k[:-1]).long()
    geometry = ragged_geometry(len_q, len_k, max_q, max_k, block_size)
    q_pad = q if packed_queries else pad_packed(q, cu_seq_q, geometry.padded_len_q)
    if block_table is not None:
        k_pad, v_pad = (pad_paged(cache, block_table, len_k, geometry.padded_len_k) for cache in (k, v))
    else:
        k_pad, v_pad = (pad_packed(x, cu_seq_k, geometry.padded_len_k) for x in (k, v))
    return geometry, q_pad, k_pad, v_pad


def write_packed(out: torch.Tensor, o_pad: torch.Tensor, lse_pad: torch.Tensor | None,
                 cu_seq_q: torch.Tensor) -> torch.Tensor | None:
    """``o_pad (N, Hq, rows, Dv)``'s rows written to the packed ``out (Tq, Hq, Dv)``; returns the
    packed LSE ``(Hq, Tq)`` of ``lse_pad (N, Hq, rows)``, or None."""
    total = out.shape[0]
    token_major = o_pad.transpose(1, 2)
    if token_major.is_contiguous():  # the kernels' output: one copy of whole token rows
        torch.index_select(token_major.reshape(-1, *out.shape[1:]), 0, flat_slots(cu_seq_q, total, o_pad.shape[2]),
                           out=out)
    else:
        out.copy_(unpad_rows(o_pad, cu_seq_q, total))
    if lse_pad is None:
        return None
    return unpad_rows(lse_pad[..., None], cu_seq_q, total)[..., 0].transpose(0, 1).contiguous()
