"""Turning a config and inputs into a `Plan`: permute, select, finalize."""

from __future__ import annotations

import importlib.util

import torch

from pbs.backends import planning_implementation
from pbs.components import PermutationInputs, Permutations, SelectionInputs, permuter_registry, selector_registry
from pbs.config import PBSConfig
from pbs.layout import Layout
from pbs.reference.block_sets import forced_blocks, sink_blocks
from pbs.types import BlockMask, Permutation, Plan


def finalize_selection(
    selected: torch.Tensor, layout: Layout, key_positions: torch.Tensor, force_sink_block: bool
) -> BlockMask:
    """Adds forced blocks, drops blocks that are wholly in the future, and builds the BlockMask.

    Args:
        selected: ``(B, Hq, Tq, Tk)`` bool from a selector.
        layout: geometry of the call.
        key_positions: ``(B, Hk, Nk)`` original position of every permuted key slot.
        force_sink_block: keep the block holding position 0.
    """
    expected = (layout.batch, layout.heads_q, layout.num_query_blocks, layout.num_key_blocks)
    if selected.dtype != torch.bool or tuple(selected.shape) != expected:
        raise ValueError(
            f"a selector must return a bool tensor of shape (B, Hq, Tq, Tk) = {expected}, "
            f"got {selected.dtype} {tuple(selected.shape)}"
        )
    allowed = layout.allowed_blocks(selected.device)
    dense = (selected | forced_blocks(layout, key_positions, force_sink_block)) & allowed
    return BlockMask.from_dense(dense, layout)


def make_layout(q: torch.Tensor, k: torch.Tensor, config: PBSConfig) -> Layout:
    """The `Layout` of ``q (B, Hq, Nq, D)`` and ``k (B, Hkv, Nk, D)`` under ``config``.

    A permuter with ``segmented = False`` (``none``) gets one-block segments: nothing moves, so only
    the diagonal block needs a per-token check or is forced.
    """
    segmented = type(config.permuter).segmented
    return Layout(
        batch=q.shape[0],
        heads_q=q.shape[1],
        heads_kv=k.shape[1],
        seq_len_q=q.shape[2],
        seq_len_k=k.shape[2],
        block_size=config.block_size,
        segment_size=config.segment_size if segmented else config.block_size,
        causal=config.causal,
        segmented=segmented,
    )


def permute_keys_and_values(
    perm: Permutation, k: torch.Tensor, v: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(perm.apply(k), perm.apply(v))``, in one fused launch on CUDA when Triton is there.

    The fused gather reads one index per row instead of one per element: 3x faster than
    ``torch.gather`` on an H200 (docs/notes.md).
    """
    if perm.is_identity and k.shape[1] == perm.heads:
        return k, v
    if v is not None and k.is_cuda and importlib.util.find_spec("triton") is not None:
        from pbs.kernels.gather import gather_kv

        return gather_kv(perm.indices, k, v)
    return perm.apply(k), (perm.apply(v) if v is not None else None)


def run_permuter(q: torch.Tensor, k: torch.Tensor, layout: Layout, config: PBSConfig, scale: float) -> tuple[Permutation, Permutation]:
    """The permutation stage: ``(key_permutation, query_permutation)``.

    Args:
        q: ``(B, Hq, Nq, D)``; k: ``(B, Hkv, Nk, D)``, both in original order.

    Returns:
        Key permutation ``(B, Hk, Nk)`` (``Hk`` is ``Hq`` in per-head mode, else ``Hkv``; identity
        permutations use ``Hkv`` heads so K/V are never copied) and query permutation ``(B, Hq, Nq)``.
    """
    backend = planning_implementation(config.backend, q.device)
    perm_inputs = PermutationInputs(q=q, k=k, layout=layout, gqa=config.gqa, scale=scale)
    permute = permuter_registry.implementation(config.permuter, backend)
    perms = permute(config.permuter, perm_inputs) if permute else config.permuter.permute(perm_inputs)
    _check_permutations_type(perms, config.permuter.name)
    b, hq, nq = layout.batch, layout.heads_q, layout.seq_len_q
    # Unpermuted keys need no per-head copy, whatever the GQA mode.
    key_heads = perm_inputs.key_heads if perms.keys is not None else layout.heads_kv
    key_perm = perms.keys or Permutation.identity(b, key_heads, layout.seq_len_k, q.device)
    query_perm = perms.queries or Permutation.identity(b, hq, nq, q.device)
    _check_permutation(key_perm, (b, key_heads, layout.seq_len_k), "key")
    _check_permutation(query_perm, (b, hq, nq), "query")
    if perms.keys is not None or perms.queries is not None:
        trusted = type(config.permuter).__module__.startswith("pbs.") and q.is_cuda
        if not trusted:
            check_segmented_permutation(key_perm.indices, layout, "key", config.permuter.name)
            check_segmented_permutation(query_perm.indices, layout, "query", config.permuter.name)
    return key_perm, query_perm


def run_selector(
    q_perm: torch.Tensor,
    k: torch.Tensor,
    key_perm: Permutation,
    query_perm: Permutation,
    layout: Layout,
    config: PBSConfig,
    scale: float,
    k_perm: torch.Tensor | None = None,
) -> BlockMask:
    """The selection stage: the `BlockMask` over permuted blocks, forced blocks included.

    Args:
        q_perm: ``(B, Hq, Nq, D)`` queries in permuted order.
        k: ``(B, Hkv, Nk, D)`` keys in original order.
        key_perm, query_perm: from `run_permuter`.
        k_perm: the permuted keys when they already exist; otherwise a selector that needs them
            gathers them (GPU selectors read ``k`` through the permutation instead).
    """
    backend = planning_implementation(config.backend, q_perm.device)
    sel_inputs = SelectionInputs(
        q=q_perm,
        k=k_perm,
        layout=layout,
        query_positions=query_perm.indices + layout.query_offset,
        key_positions=key_perm.indices,
        scale=scale,
        source_k=k,
        key_permutation=key_perm,
        force_sink_block=config.force_sink_block,
    )
    select = selector_registry.implementation(config.selector, backend)
    result = select(config.selector, sel_inputs) if select else config.selector.select(sel_inputs)
    if isinstance(result, BlockMask):
        return result
    if not isinstance(result, torch.Tensor):
        raise TypeError(
            f"selector {config.selector.name!r} returned {type(result).__name__}; select() must return "
            "a (B, Hq, Tq, Tk) bool tensor or a pbs.BlockMask"
        )
    return finalize_selection(result, layout, key_perm.indices, config.force_sink_block)


def build_plan(
    q: torch.Tensor, k: torch.Tensor, config: PBSConfig, scale: float, v: torch.Tensor | None = None
) -> tuple[Plan, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Runs the permuter and the selector.

    Args:
        q, k: inputs of `pbs.plan`.
        config: the validated config.
        scale: softmax scale.
        v: values, when attention follows: they are permuted together with the keys.

    Returns:
        ``(plan, q_perm, k_perm, v_perm)``: the plan plus the permuted queries ``(B, Hq, Nq, D)``,
        keys ``(B, Hk, Nk, D)`` and values, so nothing is gathered twice. Without ``v`` the keys are
        not gathered here (``k_perm`` and ``v_perm`` are None), which keeps `pbs.plan` light.
    """
    layout = make_layout(q, k, config)
    key_perm, query_perm = run_permuter(q, k, layout, config, scale)
    q_perm = query_perm.apply(q)
    k_perm, v_perm = permute_keys_and_values(key_perm, k, v) if v is not None else (None, None)
    mask = run_selector(q_perm, k, key_perm, query_perm, layout, config, scale, k_perm=k_perm)
    plan = Plan(key_permutation=key_perm, query_permutation=query_perm, mask=mask, config=config)
    return plan, q_perm, k_perm, v_perm


def _check_permutation(perm: Permutation, expected: tuple[int, int, int], what: str) -> None:
    if tuple(perm.indices.shape) != expected:
        raise ValueError(f"the permuter returned a {what} permutation of shape {tuple(perm.indices.shape)}, expected {expected}")


def _check_permutations_type(perms: object, name: str) -> None:
    if not isinstance(perms, Permutations):
        raise TypeError(
            f"permuter {name!r} returned {type(perms).__name__}; permute() must return "
            "pbs.Permutations(keys=Permutation | None, queries=Permutation | None)"
        )
    for what, perm in (("keys", perms.keys), ("queries", perms.queries)):
        if perm is not None and not isinstance(perm, Permutation):
            raise TypeError(
                f"permuter {name!r} returned {what}={type(perm).__name__}; expected a pbs.Permutation "
                "(e.g. Permutation.from_indices(indices)) or None"
            )


def check_segmented_permutation(indices: torch.Tensor, layout: Layout, what: str, name: str = "") -> None:
    """Raises ``ValueError`` unless ``indices`` is a bijection that keeps every token in its segment.

    Args:
        indices: ``(B, H, N)`` slot -> original index of a key (``N = Nk``) or query (``N = Nq``)
            permutation.
        layout: geometry of the call; keys may move only inside the full segments, queries only
            inside the full segments that lie wholly in the query range.
        what: ``"key"`` or ``"query"``.
        name: the permuter's name, for the message.

    On CUDA the check is a device-side assert (no host sync): a bad permutation stops the
    process with a CUDA assertion naming this rule instead of raising.
    """
    n = indices.shape[-1]
    slots = torch.arange(n, device=indices.device)
    if what == "key":
        lo, hi, offset = 0, layout.permutable_key_len, 0
    else:
        (lo, hi), offset = layout.permutable_query_range, layout.query_offset
    s = layout.segment_size
    idx = indices.long()
    in_range = (idx >= 0) & (idx < n)
    movable = (slots >= lo) & (slots < hi)
    same_segment = torch.where(movable, (idx + offset) // s == (slots + offset) // s, idx == slots)
    seen = torch.zeros(indices.shape, dtype=torch.int32, device=indices.device)
    seen.scatter_add_(-1, idx.clamp(0, max(n - 1, 0)), torch.ones_like(seen))
    valid = in_range.all() & same_segment.all() & (seen == 1).all()
    message = (
        f"permuter {name!r} returned an invalid {what} permutation: its indices must be a "
        f"bijection of 0..{n - 1} along the last dim that moves tokens only inside their own "
        f"segment of {s} tokens (slots [{lo}, {hi}) may move; the others must stay in place)"
    )
    if indices.is_cuda:
        torch._assert_async(valid, message)
    elif not bool(valid):
        raise ValueError(message)
