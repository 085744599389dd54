"""Turning a config and inputs into a `Plan` (backend, permutations, block mask), and running one.

The backend is decided here, once per call (`pbs.backends.resolve_backend`), recorded in the plan
(`Plan.backend`), and obeyed by `run_planned`; the planners of that backend's family permute and
select.
"""

from __future__ import annotations

import torch

from pbs.backends import AttentionCall, CallSpec, get_backend, planner_for, planning_family, resolve_backend
from pbs.backends.permute import permute_keys_and_values
from pbs.backends.registry import backend_reasons
from pbs.components import PermutationInputs, Permutations, SelectionInputs, SequenceSummaries
from pbs.config import PBSConfig
from pbs.layout import Layout
from pbs.reference.block_sets import finalize_selection
from pbs.types import BlockMask, Permutation, Plan, is_paged
from pbs.validation import check_selector_result


def make_layout(q: torch.Tensor, k: torch.Tensor, config: PBSConfig, segmented: bool | None = None) -> Layout:
    """The `Layout` of ``q (B, Hq, Nq, D)`` and ``k (B, Hkv, Nk, D)`` under ``config``.

    A permuter with ``segmented = False`` (``none``) gets one-block segments: nothing moves, so only
    the diagonal block needs a per-token check or is forced. ``segmented`` overrides the
    permuter's flag (dense attention permutes nothing).
    """
    if segmented is None:
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


def run_permuter(
    q: torch.Tensor, k: torch.Tensor, layout: Layout, config: PBSConfig, scale: float, family: str = "reference",
    summaries: SequenceSummaries | None = None,
) -> tuple[Permutation, Permutation]:
    """The permutation stage: ``(key_permutation, query_permutation)``.

    Args:
        q: ``(B, Hq, Nq, D)``; k: ``(B, Hkv, Nk, D)``, both in original order.
        family: the planner family (`pbs.backends.planning_family`); ``"reference"``: the
            permuter's own ``permute``.
        summaries: with a ``key_permutation`` (context parallelism made it for the whole
            sequence), its first ``Nk`` slots are the keys' order and the permuter does not run.

    Returns:
        Key permutation ``(B, Hk, Nk)`` (``Hk`` is ``Hq`` in per-head mode, else ``Hkv``; identity
        permutations use ``Hkv`` heads so K/V are never copied) and query permutation ``(B, Hq, Nq)``.
    """
    perm_inputs = PermutationInputs(q=q, k=k, layout=layout, gqa=config.gqa, scale=scale)
    whole = summaries.key_permutation if summaries is not None else None
    if whole is not None:
        # Segments never straddle Nk here, so the prefix of the whole order is an order of its own.
        nk = layout.seq_len_k
        perms = Permutations(keys=Permutation(whole.indices[..., :nk], whole.inverse[..., :nk], whole.is_identity))
    else:
        permute = planner_for("permuter", config.permuter.name, family)
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
    family: str = "reference",
    summaries: SequenceSummaries | None = None,
) -> BlockMask:
    """The selection stage: the `BlockMask` over permuted blocks, forced blocks included.

    Args:
        q_perm: ``(B, Hq, Nq, D)`` queries in permuted order.
        k: ``(B, Hkv, Nk, D)`` keys in original order.
        key_perm, query_perm: from `run_permuter`.
        k_perm: the permuted keys when they already exist; otherwise a selector that needs them
            gathers them (GPU selectors read ``k`` through the permutation instead).
        family: the planner family; ``"reference"``: the selector's own ``select``.
        summaries: whole-sequence selection inputs when ``q_perm`` is part of a sequence planned
            elsewhere (context parallelism), else None.
    """
    paged_k = k if is_paged(k) else None
    sel_inputs = SelectionInputs(
        q=q_perm,
        k=None if paged_k is not None else k_perm,
        layout=layout,
        query_positions=query_perm.indices + layout.query_offset,
        key_positions=key_perm.indices,
        scale=scale,
        source_k=None if paged_k is not None else k,
        key_permutation=key_perm,
        force_sink_block=config.force_sink_block,
        summaries=summaries,
        paged_k=paged_k,
    )
    select = planner_for("selector", config.selector.name, family)
    result = select(config.selector, sel_inputs) if select else config.selector.select(sel_inputs)
    if not (q_perm.is_cuda and type(config.selector).__module__.startswith("pbs.")):
        # A custom selector's result is checked before anything reads it; pbs's own are trusted
        # on the GPU, where the check costs several launches per call.
        check_selector_result(result, layout, q_perm.device, config.selector.name)
    if isinstance(result, BlockMask):
        return result
    if not isinstance(result, torch.Tensor):
        raise TypeError(
            f"selector {config.selector.name!r} returned {type(result).__name__}; select() must return "
            "a (B, Hq, Tq, Tk) bool tensor or a pbs.BlockMask"
        )
    return finalize_selection(result, layout, key_perm.indices, config.force_sink_block)


def build_plan(
    q: torch.Tensor, k: torch.Tensor, config: PBSConfig, scale: float, v: torch.Tensor | None = None,
    return_lse: bool = False, summaries: SequenceSummaries | None = None,
) -> tuple[Plan, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Chooses the backend, then runs the permuter and the selector.

    Args:
        q, k: inputs of `pbs.plan`.
        config: the validated config.
        scale: softmax scale.
        v: values, when attention follows: they are permuted together with the keys (without
            them the backend is chosen for values of ``q``'s head dim).
        return_lse: plan for a run that returns the log-sum-exp (a backend that can).
        summaries: whole-sequence selection inputs for a chunk of a longer sequence
            (`pbs.components.SequenceSummaries`); the selector then reads them instead of ``k``.

    ``k`` and ``v`` may also be one sequence's keys and values in a paged cache
    (`pbs.types.PagedTensor`, ``B = 1``): the backend is then one that reads pages, the planners
    that can read pages read them in place, and ``k_perm``/``v_perm`` are ``k`` and ``v``
    themselves. With a permuter that reorders keys they are gathered into contiguous tensors first
    (the permuted copy that such a permuter needs is then made from those), and so they are for a
    quantized ``config.precision`` (its pass takes K's mean over the tokens and V's channel scales
    from the contiguous sequence, and writes quantized copies anyway).

    Returns:
        ``(plan, q_perm, k_perm, v_perm)``: the plan plus the permuted queries ``(B, Hq, Nq, D)``,
        keys ``(B, Hk, Nk, D)`` and values, so nothing is gathered twice. Without ``v`` the keys are
        not gathered here (``k_perm`` and ``v_perm`` are None), which keeps `pbs.plan` light.
    """
    if is_paged(k) and (type(config.permuter).segmented or config.precision != "native"):
        k, v = k.gather(), (v.gather() if v is not None else None)
    layout = make_layout(q, k, config)
    spec = CallSpec.of(q, v.shape[-1] if v is not None else q.shape[-1], layout.block_size, return_lse,
                       page_size=page_size_of(k), precision=config.precision)
    backend = resolve_backend(config.backend, spec)
    family = planning_family(backend, q.device)
    key_perm, query_perm = run_permuter(q, k, layout, config, scale, family, summaries)
    q_perm = query_perm.apply(q)
    k_perm, v_perm = permute_keys_and_values(key_perm, k, v) if v is not None else (None, None)
    mask = run_selector(q_perm, k, key_perm, query_perm, layout, config, scale, k_perm=k_perm, family=family,
                        summaries=summaries)
    plan = Plan(key_permutation=key_perm, query_permutation=query_perm, mask=mask, config=config, backend=backend.name)
    return plan, q_perm, k_perm, v_perm


def run_planned(
    plan: Plan, q_perm: torch.Tensor, k_perm: torch.Tensor, v_perm: torch.Tensor, dtype: torch.dtype, scale: float,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention of permuted tensors on the backend the plan recorded.

    Args:
        q_perm: ``(B, Hq, Nq, D)``, k_perm: ``(B, Hk, Nk, D)``, v_perm: ``(B, Hk, Nk, Dv)``, in the
            plan's permuted orders.
        dtype: the output dtype (the inputs').
        return_lse: also return the log-sum-exp.

    Returns:
        ``(B, Hq, Nq, Dv)`` in original query order; with ``return_lse`` also the float32
        ``(B, Hq, Nq)`` log-sum-exp of each query's scaled scores over the keys it attends to.
    """
    backend = get_backend(plan.backend)
    spec = CallSpec.of(q_perm, v_perm.shape[-1], plan.layout.block_size, return_lse, page_size=page_size_of(k_perm),
                       precision=plan.config.precision)
    reasons = backend_reasons(backend, spec)
    if reasons:
        raise ValueError(
            f"the plan was made for backend {plan.backend!r}, which cannot run these inputs: {'; '.join(reasons)} "
            "(plan again for them: pbs.plan(q, k, config, return_lse=...))"
        )
    result = backend.run(AttentionCall(q=q_perm, k=k_perm, v=v_perm, plan=plan, scale=scale, return_lse=return_lse))
    if not return_lse:
        return plan.query_permutation.unapply(result).to(dtype)
    out, lse = result
    lse = plan.query_permutation.unapply(lse[..., None])[..., 0]
    return plan.query_permutation.unapply(out).to(dtype), lse


def full_plan(q: torch.Tensor, k: torch.Tensor, config: PBSConfig, head_dim_v: int, return_lse: bool = False) -> Plan:
    """The plan of dense attention: nothing permuted, every causally allowed block selected, on the
    backend ``config`` resolves to (for dense attention that returns the log-sum-exp)."""
    layout = make_layout(q, k, config, segmented=False)
    spec = CallSpec.of(q, head_dim_v, layout.block_size, return_lse, page_size=page_size_of(k),
                       precision=config.precision)
    backend = resolve_backend(config.backend, spec)
    shape = (layout.batch, layout.heads_q, layout.num_query_blocks, layout.num_key_blocks)
    mask = BlockMask.from_dense(layout.allowed_blocks(q.device).expand(shape), layout)
    b, hq, nq = layout.batch, layout.heads_q, layout.seq_len_q
    return Plan(key_permutation=Permutation.identity(b, layout.heads_kv, layout.seq_len_k, q.device),
                query_permutation=Permutation.identity(b, hq, nq, q.device), mask=mask, config=config,
                backend=backend.name)


def page_size_of(k: object) -> int | None:
    """The page size of paged keys (`pbs.types.PagedTensor`), None for a tensor: what
    `pbs.backends.CallSpec` records for the backends' eligibility."""
    return k.page_size if is_paged(k) else None


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
