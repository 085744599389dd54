"""`pbs.varlen_attention(..., capturable=True)`: the varlen call with no host read, for CUDA graphs.

A serving engine captures its forward once per bucket of maxima and replays it with new lengths.
Every launch here therefore has a shape fixed by ``(Tq, Tk, N, max_q, max_k)`` and the tensors'
own shapes, and every decision that depends on the lengths is taken on the device:

1. the sequences are written into token-major padded buffers, viewed as ``(N, H, max, D)``
   (`pbs.serving.ragged`);
2. each is planned as it is alone (the ``ragged`` planners, `pbs.backends.ragged_planners`), and
   `pbs.dense.DensePolicy.sequence_decisions` evaluates the dense rules per sequence on the
   device; a sequence that decides dense gets every allowed block (dense attention on the
   block-sparse kernel, as paged calls run it eagerly);
3. one launch of a backend that declares ``capturable`` attends all sequences, each query reading
   its own causal offset from the query positions, and the rows are scattered back to the packing.

What it costs against the eager path: K/V are copied into the padded buffers (the eager path reads
them in place), every sequence is planned at the padded size unless the shapes alone send all of
them to dense attention (the eager path skips planning per sequence), and dense sequences run on
the block-sparse kernel instead of cuDNN.
"""

from __future__ import annotations

import torch

from pbs.backends import AttentionCall, CallSpec, get_backend, list_backends, resolve_backend
from pbs.backends.ragged_planners import RaggedInputs, block_means, probe_counters, ragged_reasons, select
from pbs.config import PBSConfig
from pbs.dense import DensePolicy
from pbs.ragged_layout import RaggedGeometry, ragged_geometry
from pbs.serving.ragged import flat_slots, pad_packed, pad_paged, unpad_rows
from pbs.types import BlockMask, Permutation, Plan
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
                scale: float) -> tuple[BlockMask, torch.Tensor | None]:
    """The block mask of every sequence of padded ``q (N, Hq, Tq*B, D)``, ``k (N, Hkv, Tk*B, D)``,
    and the per-sequence dense decisions (None where the policy does not apply).

    Returns:
        ``(mask, dense)``: a `BlockMask` over the padded layout whose lists name only blocks of
        each sequence's own grid (a dense sequence: all its allowed blocks).
    """
    n, hq = q.shape[:2]
    layout = geometry.layout(hq, k.shape[1])
    policy = DensePolicy(config)
    if policy.all_dense_by_length(geometry.padded_len_k, geometry.device):
        # Known from the shapes: every key length is below min_seq_len, so nothing is planned.
        every_allowed = geometry.allowed[:, None].expand(n, hq, -1, -1)
        return _block_mask(every_allowed, geometry, layout), torch.ones(n, dtype=torch.bool, device=q.device)
    pooled = (block_means(q, geometry.len_q, geometry.block_size), block_means(k, geometry.len_k, geometry.block_size))
    selected = select(config.selector, RaggedInputs(geometry, q, k, pooled, scale, config.force_sink_block))
    allowed = geometry.allowed[:, None]
    selected |= geometry.forced(config.force_sink_block)[:, None]  # in place: N * Hq * Tq * Tk bools a pass
    selected &= allowed
    probe_args = policy.probe_arguments(scale)
    counters = None if probe_args is None else probe_counters(geometry, *pooled, probe_args)
    selected_blocks = selected.sum((1, 2, 3), dtype=torch.float64)
    allowed_blocks = geometry.allowed.sum((1, 2), dtype=torch.float64) * hq
    dense = policy.sequence_decisions(geometry.len_k, counters, selected_blocks, allowed_blocks)
    if dense is not None:
        selected = torch.where(dense[:, None, None, None], allowed, selected)
    return _block_mask(selected, geometry, layout), dense


def _block_mask(selected: torch.Tensor, geometry: RaggedGeometry, layout) -> BlockMask:
    """``selected (N, Hq, Tq, Tk)`` bool as a `BlockMask` whose full/masked split is each
    sequence's own (`RaggedGeometry.full_counts`), not the padded layout's."""
    mask = BlockMask.from_dense(selected, layout)
    return BlockMask(mask.counts, mask.indices, layout, geometry.full_counts(mask.counts, mask.indices))


def attend_padded(config: PBSConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask,
                  query_positions: torch.Tensor, scale: float, return_lse: bool
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One launch of the backend ``config.backend`` resolves to over the padded batch: ``(out
    (N, Hq, Tq*B, Dv), lse (N, Hq, Tq*B) or None)``."""
    spec = CallSpec.of(q, v.shape[-1], config.block_size, needs_lse=return_lse, capturable=True)
    backend = resolve_backend(config.backend, spec)
    n, hq = q.shape[:2]
    positions = query_positions[:, None, :].expand(n, hq, -1)
    nothing_moved = (Permutation.identity(n, k.shape[1], k.shape[2], k.device),
                     Permutation.identity(n, hq, q.shape[2], q.device))
    plan = Plan(*nothing_moved, mask=mask, config=config, backend=backend.name)
    # Token-major like the padded inputs, so that unpadding copies whole token rows.
    out = torch.empty(n, q.shape[2], hq, v.shape[-1], dtype=q.dtype, device=q.device).transpose(1, 2)
    result = backend.run(AttentionCall(q, k, v, plan, scale, return_lse, out=out, query_positions=positions))
    return result if return_lse else (result, None)


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
    geometry, q_pad, k_pad, v_pad = pad_batch(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, config.block_size,
                                              block_table, seqused_k)
    if check_finite:
        check_all_finite({"q": q, "k": k_pad[geometry.len_q > 0], "v": v_pad[geometry.len_q > 0]})
    mask, _ = plan_ragged(config, geometry, q_pad, k_pad, scale)
    o_pad, lse_pad = attend_padded(config, q_pad, k_pad, v_pad, mask, geometry.query_positions(), scale, return_lse)
    return out, write_packed(out, o_pad, lse_pad, cu_seq_q)


def pad_batch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor | None,
    max_q: int, max_k: int, block_size: int, block_table: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
) -> tuple[RaggedGeometry, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The geometry and the padded ``(N, H, rows, D)`` q, k, v of a packed (or, with
    ``block_table`` and ``seqused_k``, paged) batch, with the lengths read on the device."""
    len_q = (cu_seq_q[1:] - cu_seq_q[:-1]).long()
    if block_table is not None:
        assert seqused_k is not None
        len_k = seqused_k.long()
    else:
        assert cu_seq_k is not None
        len_k = (cu_seq_k[1:] - cu_seq_k[:-1]).long()
    geometry = ragged_geometry(len_q, len_k, max_q, max_k, block_size)
    q_pad = pad_packed(q, cu_seq_q, geometry.padded_len_q)
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
