"""Context-parallel PBS prefill: one causal sequence split over the ranks of a process group.

Each rank holds the zigzag shard of q, k and v (`pbs.distributed.sharding`: chunks ``r`` and
``2P - 1 - r``, on segment boundaries) and plans its own queries. A chunk is planned as the cached-
prefix call it is (``Nq`` = the chunk, ``Nk`` = every key up to the chunk's end, bottom-right
causal), with the selection inputs that read the whole sequence given to the selectors as
`pbs.components.SequenceSummaries`, so the chunk's mask is the rows one process would select:

* ``mean_pool`` reads pooled keys of every block: each rank pools its own key blocks and the ranks
  all-gather them (``B * Hkv * N / block * D`` float32: 32 MiB per layer at 1M tokens for 8 KV
  heads of 128);
* ``vertical_slash`` reads the exact softmax of the sequence's last ``last_rows`` queries: the
  rank holding the last chunk broadcasts those rows, every rank scores them against its own
  keys, the row maxima and sums are all-reduced (the softmax spans every key), and the per-key
  (vertical) and per-offset (slash) scores are summed over the ranks in one all-reduce
  (``2 * B * Hq * N`` float32: 256 MiB at 1M tokens and 32 query heads);
* ``last_block`` (the ``pbs_paper`` preset) sorts keys by the last query block's attention: that
  block is broadcast, each rank scores its own keys (row maxima and sums all-reduced, since the
  softmax spans every key) and sorts its own segments, and the ranks all-gather the order
  (``B * Hk * N`` int64: 256 MiB at 1M tokens in ``per_head`` mode, 64 MiB in ``shared``);
* the dense policy decides as one process: the length and planning-cost rules read the whole
  sequence's length, the density probe pools its sampled query blocks on the ranks that hold them
  (one small all-reduce) against the gathered pooled keys, and the planned density is summed over
  every rank's blocks (the policy's ``reduce`` hook, as tensor parallelism uses it).

None of this moves keys. Attention then needs the keys and values of every earlier position: they
are all-gathered (the simplest exact scheme the issue allows), the gather started before the
selection runs so that it overlaps it, and each chunk runs as a cached-prefix call on the gathered
prefix with its own plan. No partial results need merging.

Before all of this the ranks agree (`pbs.distributed.agreement`): each rank runs its input checks
without raising, and one all-gather of a 1 KiB record per rank (the config's digest, the scale,
dtype, shapes, shard length and the checks' outcome) is the call's first collective. A failed
check or a disagreement raises the same ValueError on every rank, so no rank waits in a later
collective for one that raised, and no two configs mix.

The selection inputs above are computed in `pbs.distributed.summaries`, the group helpers and
all-gathers in `pbs.distributed.collectives`; this module checks the shards, plans and attends.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, NamedTuple

import torch

from pbs.backends.pooling import block_means
from pbs.backends.registry import planner_for, planners_of, register_planner
from pbs.components import READS_PREFIX_KEYS, SequenceSummaries
from pbs.config import PBSConfig
from pbs.dense import DensePolicy
from pbs.distributed.agreement import agree, dim, tensor_fields
from pbs.distributed.collectives import (
    all_gather_shards,
    assemble,
    global_rank,
    group_rank_and_size,
    kv_group,
    torch_distributed,
)
from pbs.distributed.sharding import chunk_bounds
from pbs.distributed.summaries import key_order, line_scores, probe_estimate
from pbs.planning import build_plan, permute_keys_and_values, run_planned
from pbs.types import Permutation, Plan
from pbs.validation import check_all_finite, check_qkv, check_scale

ConfigLike = PBSConfig | dict[str, Any] | str | None

CONTEXT_PARALLEL = "context_parallel"
"""The planner family of whole-sequence key orders: a permuter that moves keys is planned over
ranks when a function ``fn(q, k, local, seq_len, config, scale, group, src)`` is registered for
it here (`pbs.distributed.summaries.key_order` for ``last_block``)."""

register_planner("permuter", "last_block", CONTEXT_PARALLEL)(key_order)


class ContextParallelResult(NamedTuple):
    """What `context_parallel_attend` ran on this rank.

    Attributes:
        out: ``(B, Hq, N_local, Dv)`` in ``q``'s dtype: this rank's shard of the output, in the
            order of its input shard.
        lse: with ``return_lse``, float32 ``(B, Hq, N_local)``; else None.
        plans: the plans of the rank's two chunks (chunk ``r``, then chunk ``2P - 1 - r``); None
            where dense attention ran without planning.
        reason: why dense attention ran (the same on every rank), or None.
        seq_len: ``N``, tokens of the whole sequence.
        chunks: the two chunks' ``(start, end)`` positions in the sequence.
        timings: with ``timings=True``, milliseconds per phase on this rank, from after the
            ranks' agreement: ``summaries``
            (selection inputs of the whole sequence: their compute and collectives), ``planning``
            (the chunks' permutation and selection), ``kv_wait`` (waiting for the K/V all-gather
            once planning is done), ``attention`` (both chunks), ``total``.
    """

    out: torch.Tensor
    lse: torch.Tensor | None
    plans: tuple[Plan | None, Plan | None]
    reason: str | None
    seq_len: int
    chunks: tuple[tuple[int, int], tuple[int, int]]
    timings: dict[str, float] | None = None


def _selector_leaves(selector: Any) -> list[Any]:
    members = getattr(selector, "selectors", None)
    if members:
        return [leaf for member in members for leaf in _selector_leaves(member)]
    return [selector]


def _line_selectors(leaves: list[Any]) -> list[Any]:
    """The selectors that read the whole sequence's line scores (they score its last rows)."""
    return [leaf for leaf in leaves if "line_scores" in (leaf.summaries_needed() or ())]


def unsupported_reasons(config: PBSConfig) -> list[str]:
    """Why ``config`` cannot be planned context-parallel yet; empty when it can. The reasons come
    from what the components declare: a permuter that moves keys needs a planner registered in the
    `CONTEXT_PARALLEL` family, a selector its ``sequence_summaries``."""
    reasons = []
    permuter = config.permuter
    if type(permuter).segmented and planner_for("permuter", permuter.name, CONTEXT_PARALLEL) is None:
        ordered = ", ".join(planners_of(CONTEXT_PARALLEL, "permuter"))
        reasons.append(f"permuter {permuter.name!r} has no whole-sequence key order over ranks (registered: "
                       f"{ordered}, and 'none')")
    leaves = _selector_leaves(config.selector)
    bad = sorted({leaf.name for leaf in leaves if leaf.summaries_needed() is None})
    if bad:
        reasons.append(f"selector {', '.join(map(repr, bad))} does not declare the whole-sequence summaries it reads "
                       "(SelectorConfig.sequence_summaries)")
    rows = {leaf.last_rows for leaf in _line_selectors(leaves)}
    if len(rows) > 1:
        reasons.append(f"vertical_slash members with different last_rows {sorted(rows)} (one set of lines is scored)")
    if not config.causal:
        reasons.append("causal=False (the zigzag split balances causal work only)")
    return reasons


def check_supported(config: PBSConfig) -> None:
    """Raises ``ValueError`` naming what in ``config`` context parallelism cannot plan yet."""
    reasons = unsupported_reasons(config)
    if reasons:
        raise ValueError(
            "config cannot be planned context-parallel yet: " + "; ".join(reasons)
            + ". pbs.distributed plans the permuters none and last_block with the selectors mean_pool, "
            "vertical_slash, budget and union of them (the defaults, and the pbs_paper preset)"
        )


def _agreed_call(q: object, k: object, v: object, config: ConfigLike, scale: float | None, group: Any,
                 world: int) -> tuple[PBSConfig, float, int]:
    """The local checks, then the ranks' agreement (`pbs.distributed.agreement.agree`): the first
    collective of a call. Returns ``(config, scale, N)``; raises the same ValueError on every rank.

    A rank whose checks fail (bad input, NaN, grad, a config context parallelism cannot plan) does
    not raise before the exchange, so its peers do not wait for it in a later collective.
    """
    failure = coerced = checked_scale = None
    try:
        coerced = PBSConfig.coerce(config)
        check_qkv(q, k, v, check_finite=False)
        assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
        if coerced.checks_finite(q.device):
            check_all_finite({"q": q, "k": k, "v": v})
        check_supported(coerced)
        checked_scale = check_scale(scale, q.shape[-1])
    except Exception as error:  # noqa: BLE001 - recorded, then raised on every rank by agree()
        failure = error
    same = {"scale": checked_scale, **tensor_fields(q=q),
            "B": dim(q, 0), "Hq": dim(q, 1), "Hkv": dim(k, 1), "D": dim(q, -1), "Dv": dim(v, -1)}
    table = agree("context-parallel", group=group, like=q, config=coerced, same=same,
                  own={"Nq": dim(q, 2), "Nk": dim(k, 2)}, failure=failure)
    assert coerced is not None and checked_scale is not None  # agree() raised otherwise
    return coerced, checked_scale, _sequence_length([(row["Nq"], row["Nk"]) for row in table], world,
                                                    coerced.segment_size)


def _sequence_length(lengths: list[tuple[int, int]], world: int, segment_size: int) -> int:
    """``N`` from every rank's ``(Nq_local, Nk_local)``, checked to be the zigzag split of one
    self-attention prefill (the same table on every rank, so every rank raises alike)."""
    if any(nq != nk for nq, nk in lengths):
        raise ValueError(
            "each rank's q and k shards must hold the same tokens (a causal prefill of one sequence); "
            f"(Nq_local, Nk_local) per rank: {dict(enumerate(lengths))}"
        )
    seq_len = sum(nq for nq, _ in lengths)
    bounds = chunk_bounds(seq_len, world, segment_size)
    expected = [(bounds[r][1] - bounds[r][0]) + (bounds[2 * world - 1 - r][1] - bounds[2 * world - 1 - r][0])
                for r in range(world)]
    got = [nq for nq, _ in lengths]
    if got != expected:
        raise ValueError(
            f"the shards' lengths per rank {got} are not the zigzag split of the {seq_len}-token sequence over "
            f"{world} ranks, which gives {expected} (segments of {segment_size}): shard q, k and v with "
            "pbs.distributed.shard_sequence(x, rank, world_size, segment_size=config.segment_size)"
        )
    return seq_len


def _shape_only(like: torch.Tensor, length: int, head_dim: int | None = None) -> torch.Tensor:
    # A (B, H, length, D) view of one zero: planning reads the keys' shape, not their values, when
    # the selection inputs come as summaries. Zeros, not garbage, if something reads it anyway.
    b, h, _, d = like.shape
    return torch.zeros((), dtype=like.dtype, device=like.device).expand(b, h, length, head_dim or d)


class _Clock:
    """Phase times of one call: CUDA events on the GPU (read once at the end), wall time on the CPU."""

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled = enabled
        self.cuda = enabled and device.type == "cuda"
        self.marks: list[tuple[str, Any]] = []
        self.mark("start")

    def mark(self, name: str) -> None:
        if not self.enabled:
            return
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((name, event))
        else:
            self.marks.append((name, time.perf_counter()))

    def read(self) -> dict[str, float] | None:
        if not self.enabled:
            return None
        if self.cuda:
            torch.cuda.synchronize()
        times: dict[str, float] = {}
        for (_, before), (name, after) in zip(self.marks, self.marks[1:]):
            times[name] = before.elapsed_time(after) if self.cuda else (after - before) * 1e3
        first, last = self.marks[0][1], self.marks[-1][1]
        times["total"] = first.elapsed_time(last) if self.cuda else (last - first) * 1e3
        return times


def context_parallel_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    config: ConfigLike = None,
    *,
    group: Any = None,
    scale: float | None = None,
    return_lse: bool = False,
    timings: bool = False,
) -> ContextParallelResult:
    """`context_parallel_attention` with what ran: the plans, the dense reason, phase timings.

    Args:
        q, k, v, config, group, scale, return_lse: as `context_parallel_attention`.
        timings: record each phase's time on this rank (`ContextParallelResult.timings`; on the
            GPU this synchronises once at the end of the call).

    Returns:
        `ContextParallelResult`.
    """
    rank, world = group_rank_and_size(group)
    config, scale, seq_len = _agreed_call(q, k, v, config, scale, group, world)
    context = torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext()
    with context:
        return _attend(q, k, v, config, group, rank, world, seq_len, scale, return_lse, timings)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: PBSConfig, group: Any, rank: int, world: int,
            seq_len: int, scale: float, return_lse: bool, timings: bool) -> ContextParallelResult:
    dist = torch_distributed()
    clock = _Clock(timings, q.device)
    bounds = chunk_bounds(seq_len, world, config.segment_size)
    chunks = (bounds[rank], bounds[2 * world - 1 - rank])
    first_len = chunks[0][1] - chunks[0][0]
    local = [(chunks[0][0], chunks[0][1], 0), (chunks[1][0], chunks[1][1], first_len)]
    lengths = [(bounds[r][1] - bounds[r][0]) + (bounds[2 * world - 1 - r][1] - bounds[2 * world - 1 - r][0])
               for r in range(world)]
    leaves = _selector_leaves(config.selector)
    lines = next(iter(_line_selectors(leaves)), None)
    if lines is not None and min(lines.last_rows, seq_len) > bounds[-1][1] - bounds[-1][0]:
        raise ValueError(
            f"vertical_slash.last_rows = {lines.last_rows} is longer than the sequence's last chunk "
            f"({bounds[-1][1] - bounds[-1][0]} tokens over {world} ranks): the last rows must sit on one rank"
        )
    if config.permuter.name == "last_block":
        proxies = min(seq_len, config.permuter.num_queries or config.block_size)
        if proxies > bounds[-1][1] - bounds[-1][0]:
            raise ValueError(
                f"last_block.num_queries = {proxies} is longer than the sequence's last chunk "
                f"({bounds[-1][1] - bounds[-1][0]} tokens over {world} ranks): the scoring queries must sit on one rank"
            )

    # Dense decisions as one process takes them: on the whole sequence's length, probe and blocks.
    total_allowed = local_allowed = 1.0

    def over_ranks(local_density: torch.Tensor | float) -> float:
        # Rule 3's reduce: this rank's selected share, weighted by its allowed blocks, summed.
        value = torch.as_tensor(local_density, dtype=torch.float64, device=q.device) * local_allowed
        dist.all_reduce(value, group=group)
        return float(value) / total_allowed

    policy = DensePolicy(config, reduce=over_ranks, scope=f" over the {world} context-parallel ranks",
                         return_lse=return_lse)
    reason = (policy.length_reason(q, _shape_only(k, seq_len))
              or policy.planning_cost_reason(seq_len, seq_len, q.device))
    probe_args = policy.probe_arguments(scale) if reason is None and policy.probe_runs(q.device) else None
    bs = config.block_size
    src = global_rank(group, 0)  # rank 0 holds the last chunk, and so the sequence's last queries
    block_counts = [sum(-(-(bounds[c][1]) // bs) - bounds[c][0] // bs for c in (r, 2 * world - 1 - r))
                    for r in range(world)]

    def pooled_keys(order: torch.Tensor | None) -> torch.Tensor:
        # Every rank pools its own key blocks (through its key order), and the ranks all-gather them.
        means = torch.cat([block_means(k[:, :, slot:slot + end - start], bs,
                                       None if order is None else order[..., slot:slot + end - start] - start)
                           for start, end, slot in local], dim=2)
        gathered, _ = all_gather_shards(means, block_counts, group)
        return assemble(gathered, bounds, bs, -(-seq_len // bs))

    permuted = type(config.permuter).segmented
    pools = reason is None and "key_block_means" in (config.selector.summaries_needed() or ())
    original_means = None
    if probe_args is not None:
        original_means = pooled_keys(None)
        estimate = probe_estimate(q, local, original_means, seq_len, probe_args, group)
        reason = policy.probe_reason(estimate, seq_len, seq_len)
    summaries = SequenceSummaries()
    if reason is None:
        key_perm = order = None
        if permuted:
            order = planner_for("permuter", config.permuter.name, CONTEXT_PARALLEL)(
                q, k, local, seq_len, config, scale, group, src)
            gathered, _ = all_gather_shards(order[..., None], lengths, group)
            key_perm = Permutation.from_indices(assemble(gathered, bounds, 1, seq_len)[..., 0])
        key_means = None
        if pools:
            key_means = original_means if original_means is not None and not permuted else pooled_keys(order)
        scores = line_scores(q, k, local, seq_len, lines.last_rows, scale, group, src) if lines else None
        summaries = SequenceSummaries(key_block_means=key_means, line_scores=scores, key_permutation=key_perm)
    clock.mark("summaries")

    # Keys and values of every rank, gathered while this rank plans (on a communicator of their own,
    # so that the planned-density all-reduce does not queue behind them).
    kv_comm = kv_group(group, world)
    k_parts, k_work = all_gather_shards(k, lengths, kv_comm, async_op=True)
    v_parts, v_work = all_gather_shards(v, lengths, kv_comm, async_op=True)

    def gathered_keys_and_values() -> tuple[torch.Tensor, torch.Tensor]:
        k_work.wait()
        v_work.wait()
        return assemble(k_parts, bounds, 1, seq_len), assemble(v_parts, bounds, 1, seq_len)

    # A selector that reads its call's keys themselves (``prefix_keys``: antidiagonal scoring) plans
    # once the keys are here, on the real prefix; the others plan while they travel.
    reads_keys = reason is None and READS_PREFIX_KEYS in (config.selector.summaries_needed() or ())
    kv_all = gathered_keys_and_values() if reads_keys else None
    plans: list[Plan | None] = [None, None]
    perm_q: list[torch.Tensor | None] = [None, None]
    if reason is None:
        for i, (start, end, slot) in enumerate(local):
            q_chunk = q[:, :, slot:slot + end - start]
            # Values only tell the backend choice their head dim; under a key permutation planning
            # would gather them (and the shape-only keys), so there it sees none (Dv taken as D).
            v_spec = None if permuted else _shape_only(v, end, v.shape[-1])
            k_plan = kv_all[0][:, :, :end] if kv_all is not None else _shape_only(k, end)
            plan, q_perm, _, _ = build_plan(q_chunk, k_plan, config, scale, v_spec,
                                            return_lse=return_lse, summaries=summaries)
            plans[i], perm_q[i] = plan, q_perm
        total_allowed = float(q.shape[0] * q.shape[1] * _total_allowed(seq_len, config))
        local_allowed = float(sum(p.layout.batch * p.layout.heads_q * p.layout.total_allowed_blocks for p in plans))
        reason = policy.planned_density_reason((plans[0], plans[1]))
        if reason is not None:
            plans = [None if p is None else _with_fallback(p, reason) for p in plans]
    clock.mark("planning")

    k_all, v_all = kv_all if kv_all is not None else gathered_keys_and_values()
    del k_parts, v_parts, kv_all
    clock.mark("kv_wait")

    outs, lses = [], []
    for i, (start, end, slot) in enumerate(local):
        k_prefix, v_prefix = k_all[:, :, :end], v_all[:, :, :end]
        plan = plans[i]
        if reason is not None:
            # A later chunk is aligned bottom-right: `pbs.dense.dense_attention` picks its kernel.
            out, lse = policy.dense(q[:, :, slot:slot + end - start], k_prefix, v_prefix, scale)
        else:
            k_perm, v_perm = permute_keys_and_values(plan.key_permutation, k_prefix, v_prefix)
            result = run_planned(plan, perm_q[i], k_perm, v_perm, q.dtype, scale, return_lse=return_lse)
            out, lse = result if return_lse else (result, None)
        outs.append(out)
        lses.append(lse)
    out = torch.cat(outs, dim=2)
    lse = torch.cat(lses, dim=2) if return_lse else None
    clock.mark("attention")
    return ContextParallelResult(out, lse, (plans[0], plans[1]), reason, seq_len, chunks, clock.read())


def _total_allowed(seq_len: int, config: PBSConfig) -> int:
    from pbs.layout import Layout

    segment = config.segment_size if type(config.permuter).segmented else config.block_size
    layout = Layout(1, 1, 1, seq_len, seq_len, config.block_size, segment, config.causal,
                    type(config.permuter).segmented)
    return layout.total_allowed_blocks


def _with_fallback(plan: Plan, reason: str) -> Plan:
    import dataclasses

    return dataclasses.replace(plan, fallback=reason)


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    config: ConfigLike = None,
    *,
    group: Any = None,
    scale: float | None = None,
    return_lse: bool = False,
    return_plans: bool = False,
) -> torch.Tensor | tuple:
    """Causal PBS attention of one sequence split over the ranks of ``group``: call it on every
    rank with that rank's zigzag shard (`shard_sequence`). docs/context-parallel.md says how it
    runs, what it communicates and what equals one process.

    Args:
        q, k, v: this rank's shards, ``(B, Hq, N_local, D)``, ``(B, Hkv, N_local, D)``, ``(B, Hkv, N_local, Dv)``.
        config, scale, return_lse: as `pbs.attention`; the config must pass `check_supported`.
        group: the process group (None: the default one).
        return_plans: also return the plans of the rank's two chunks (None where dense ran).

    Returns:
        ``out`` ``(B, Hq, N_local, Dv)``: this rank's shard of the output; ``(out, lse)``,
        ``(out, plans)`` or ``(out, lse, plans)`` with the flags.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: the same on every rank: a rank's checks failed, the ranks disagree (config,
            scale, dtype, head shapes), or the shards are not the zigzag split of one sequence.
    """
    result = context_parallel_attend(q, k, v, config, group=group, scale=scale, return_lse=return_lse)
    if return_lse:
        return (result.out, result.lse, result.plans) if return_plans else (result.out, result.lse)
    return (result.out, result.plans) if return_plans else result.out
