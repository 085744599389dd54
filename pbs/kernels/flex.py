"""The PBS block mask lowered to ``torch.nn.attention.flex_attention``: a second implementation.

The `BlockMask` maps one to one onto FlexAttention's: ``counts``/``indices``
become its ``kv_num_blocks``/``kv_indices``. The mask already stores which leading entries of each
list lie wholly in the past of their query block (``full_counts``, the rule every backend reads):
those go in as *full* blocks (no ``mask_mod`` call), the rest (on-diagonal) as partial blocks whose
``mask_mod`` compares *original* positions, read from the permutation, so permuted attention stays
exact. CUDA only (FlexAttention runs as a compiled Triton kernel); never picked by ``auto``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from pbs.kernels._common import FAR_FUTURE
from pbs.layout import cdiv
from pbs.types import BlockMask

# FlexAttention's own tile; positions are padded to a multiple of it so mask_mod never reads past them.
_FLEX_TILE = 128

_compiled_flex: Callable | None = None


def _flex_attention() -> Callable:
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def split_full_and_partial(mask: BlockMask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Splits every selected list into its unmasked head and its masked (on-diagonal) tail.

    The split is the mask's own (``mask.full_counts``, see `pbs.types.BlockMask`): the first
    ``full_counts`` entries of each ascending list are FlexAttention's full blocks, the rest its
    partial blocks.

    Returns:
        ``(partial_counts, partial_indices, full_counts, full_indices)``; counts ``(B, H, Tq)``
        int32, indices ``(B, H, Tq, Tk)`` int32 with each list first and 0 after it.
    """
    indices = mask.indices.long()
    counts = mask.counts.long()
    full_counts = mask.full_counts.long()
    tk = indices.shape[-1]
    arange = torch.arange(tk, device=indices.device)
    full = arange < full_counts[..., None]
    # The full blocks are each list's first entries; shift the rest left.
    shifted = (arange + full_counts[..., None]).clamp(max=tk - 1)
    partial_indices = indices.gather(-1, shifted)
    partial_counts = counts - full_counts
    partial_indices = torch.where(arange < partial_counts[..., None], partial_indices, 0)
    full_indices = torch.where(full, indices, 0)
    return (partial_counts.to(torch.int32), partial_indices.to(torch.int32).contiguous(),
            full_counts.to(torch.int32), full_indices.to(torch.int32).contiguous())


def _padded_positions(positions: torch.Tensor, length: int) -> torch.Tensor:
    pad = length - positions.shape[-1]
    return torch.nn.functional.pad(positions.to(torch.int64), (0, pad), value=FAR_FUTURE).contiguous()


def to_flex_block_mask(
    mask: BlockMask,
    query_positions: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
    causal: bool = True,
):
    """Builds FlexAttention's ``BlockMask`` from a PBS mask and the original positions.

    Args:
        mask: counts ``(B, Hq, Tq)`` + indices ``(B, Hq, Tq, Tk)``.
        query_positions: ``(B, Hq, Nq)`` original position of each query slot, or None (unpermuted).
        key_positions: ``(B, Hk, Nk)`` original position of each key slot, or None (unpermuted).
        causal: apply ``key_position <= query_position`` inside the on-diagonal blocks.
    """
    from torch.nn.attention.flex_attention import BlockMask as FlexBlockMask

    layout = mask.layout
    nq, nk, bs = layout.seq_len_q, layout.seq_len_k, layout.block_size
    device = mask.indices.device
    hq = mask.counts.shape[1]
    if causal:
        if not layout.causal:
            raise ValueError("causal=True needs a mask built for causal attention (mask.layout.causal is False)")
        partial_counts, partial_indices, full_counts, full_indices = split_full_and_partial(mask)
        pad_to = max(_FLEX_TILE, bs)
        offset = layout.query_offset
        qpos = None if query_positions is None else _padded_positions(query_positions, cdiv(nq, pad_to) * pad_to)
        kpos = None if key_positions is None else _padded_positions(key_positions, cdiv(nk, pad_to) * pad_to)
        kgroup = 1 if key_positions is None else hq // key_positions.shape[1]

        def mask_mod(b, h, q_idx, kv_idx):
            q_p = q_idx + offset if qpos is None else qpos[b, h, q_idx]
            k_p = kv_idx if kpos is None else kpos[b, h // kgroup, kv_idx]
            return k_p <= q_p
    else:
        # Flex bounds the padded key slots itself, so no block needs a mask_mod.
        partial_counts = torch.zeros_like(mask.counts, dtype=torch.int32)
        partial_indices = torch.zeros_like(mask.indices, dtype=torch.int32)
        full_counts = mask.counts.to(torch.int32)
        full_indices = mask.indices.clamp(min=0).to(torch.int32).contiguous()
        mask_mod = None
    kwargs = {}
    if "compute_q_blocks" in inspect.signature(FlexBlockMask.from_kv_blocks).parameters:
        kwargs["compute_q_blocks"] = False  # forward only: skip building the transposed lists
    return FlexBlockMask.from_kv_blocks(
        partial_counts.to(device),
        partial_indices.to(device),
        full_counts.to(device),
        full_indices.to(device),
        BLOCK_SIZE=bs,
        mask_mod=mask_mod,
        seq_lengths=(nq, nk),
        **kwargs,
    )


def flex_block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: BlockMask,
    query_positions: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
    scale: float | None = None,
    causal: bool = True,
    block_mask=None,
) -> torch.Tensor:
    """Block-sparse attention through compiled FlexAttention (same contract as the Triton kernel).

    Args:
        q: ``(B, Hq, Nq, D)``; k: ``(B, Hk, Nk, D)``; v: ``(B, Hk, Nk, Dv)``, permuted.
        mask, query_positions, key_positions, causal: as
            `pbs.kernels.block_sparse_attn.block_sparse_attention`.
        scale: softmax scale, default ``D ** -0.5``.
        block_mask: a prebuilt `to_flex_block_mask` result (saves rebuilding it per call).

    Returns:
        ``(B, Hq, Nq, Dv)`` in ``q``'s dtype, permuted query order.
    """
    if block_mask is None:
        block_mask = to_flex_block_mask(mask, query_positions, key_positions, causal)
    hq, hk = q.shape[1], k.shape[1]
    block = mask.layout.block_size
    # Flex's tiles must divide the mask's blocks; its defaults are 128 wide.
    options = {"BLOCK_M": block, "BLOCK_N": block} if block < _FLEX_TILE else None
    return _flex_attention()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=hq != hk, kernel_options=options)
