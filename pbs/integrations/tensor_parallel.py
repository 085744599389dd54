"""PBS on one rank's share of the heads, when a model is split by tensor parallelism.

transformers' tensor parallelism (``from_pretrained(..., tp_plan="auto")`` or
``distributed_config=DistributedConfig(tp_plan="auto")``) shards ``q_proj``, ``k_proj`` and ``v_proj``
column-wise, so each rank's attention function receives plain tensors holding its own query and
KV heads (``Hq / tp`` and ``Hkv / tp``, GQA groups intact) and the row-wise ``o_proj`` sums the
ranks' outputs. PBS plans every head on its own (the permutation of a KV head depends only on its
own query group, selection is per query head), so running PBS on each rank's heads gives the
single-process result, with four exceptions that this module removes:

* **ranks that disagree.** A rank whose checks fail raises, and a rank registered with another
  config decides otherwise; its peers then wait in a collective it never enters, or the layer
  mixes two configs' heads. `check_ranks_agree` makes the ranks agree first: one all-gather of a
  1 KiB record per rank at the start of every prefill call (`attention_on_shard` and the
  transformers function's SDPA fallbacks, decode steps aside), and the same ValueError on every
  rank when they differ.
* **decisions over all heads.** ``dense_fallback.max_density`` and ``max_planned_density``
  (``backend="auto"`` on CUDA) compare a density averaged over the heads (the pre-planning
  probe's, and the plan's) with a limit. Each rank sees only its heads, so ranks could decide
  differently, and differently from one process. `attention_on_shard` gives the dense policy a
  ``reduce`` hook that averages those densities over the ranks (one ``all_reduce`` of one number
  per rule, where one process already reads that number on the host), so every rank decides as
  one process would.
* **seeded draws.** The ``random`` permuter and the ``budget`` selector draw one tensor over the
  head axis; inside `pbs.reference.seeded.head_shard` a rank takes its heads' slice of the draw
  for all heads.
* **DTensor inputs.** Styles that keep the projections' outputs as DTensors (not transformers'
  defaults, which hand attention local tensors) give DTensors: `local_heads` runs PBS on the
  local shard of head-sharded ones (and gathers any other layout first) and wraps the output back.

On CUDA the call also runs under ``torch.cuda.device(q.device)``, so Triton launches on the rank's
own GPU even if the current device was not set to it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "UNCHECKED_FALLBACKS",
    "HeadShard",
    "attention_on_shard",
    "check_ranks_agree",
    "head_shard_of",
    "local_heads",
]


@dataclasses.dataclass(frozen=True)
class HeadShard:
    """This rank's share of an attention layer's heads.

    Attributes:
        rank: this rank's index among the ranks the heads are split over (its heads are
            ``rank * H_local .. (rank + 1) * H_local - 1`` of the layer).
        size: how many ranks the heads are split over.
        group: the process group of those ranks (``None``: the default group).
    """

    rank: int
    size: int
    group: Any = None


def _dtensor_type() -> type | None:
    # A DTensor can only exist once torch.distributed.tensor is imported: no import cost otherwise.
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def _is_shard(placement: Any, dim: int | None = None, ndim: int | None = None) -> bool:
    if not (hasattr(placement, "is_shard") and placement.is_shard()):
        return False
    if dim is None:
        return True
    return placement.dim % ndim == dim  # type: ignore[operator]


def _mesh_shard(mesh: Any) -> HeadShard:
    return HeadShard(rank=mesh.get_local_rank(), size=mesh.size(), group=mesh.get_group())


def head_shard_of(module: torch.nn.Module, heads_q: int) -> HeadShard | None:
    """The head shard of ``module``'s call, or ``None`` if it sees all its layer's heads.

    The shard is read from the module's own parameters: a tensor-parallel plan leaves them as
    DTensors sharded over the tensor-parallel mesh (``q_proj`` row-sharded for column-wise TP).
    A call whose query heads already number ``config.num_attention_heads`` (projections whose
    outputs were gathered) is not a shard.

    Args:
        module: the attention layer transformers passes to the attention function.
        heads_q: query heads of this call.
    """
    dtensor = _dtensor_type()
    # A sharded DTensor lives on a device mesh, which needs an initialized process group; without
    # one, skip the walk over the layer's parameters (it runs in every layer of every call).
    if dtensor is None or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    mesh = None
    for param in module.parameters():
        if isinstance(param, dtensor) and any(_is_shard(p) for p in param.placements):
            mesh = param.device_mesh
            break
    if mesh is None:
        return None
    if mesh.ndim > 1:
        names = mesh.mesh_dim_names or ()
        if "tp" not in names:
            return None
        mesh = mesh["tp"]
    if mesh.size() == 1:
        return None
    config = getattr(module, "config", None)
    total = getattr(config, "num_attention_heads", None)
    if isinstance(total, int) and heads_q >= total:
        return None  # every head is here: each rank computes the whole layer
    return _mesh_shard(mesh)


def local_heads(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, HeadShard | None, Callable[[torch.Tensor], torch.Tensor]]:
    """Plain tensors for the attention function, and how to turn its output back into a DTensor.

    DTensor ``(B, H, N, D)`` inputs sharded on the head axis (or replicated) on a one-dimensional
    mesh give their local tensors: each rank runs PBS on its heads. Other layouts (sharded over
    the sequence, partial sums, several mesh dimensions) are first gathered to every rank, since
    PBS plans a whole sequence (logged once); the output is then sharded again as the queries
    were.

    Returns:
        ``(q, k, v, shard, wrap)``: plain tensors, this rank's `HeadShard` (``None`` when the
        tensors hold every head) and a function that turns the ``(B, N, Hq, D)`` output into a
        DTensor laid out like ``query`` (heads and sequence swap places); for plain inputs
        ``(query, key, value, None, identity)``.
    """
    dtensor = _dtensor_type()
    tensors = (query, key, value)
    if dtensor is None or not any(isinstance(t, dtensor) for t in tensors):
        return query, key, value, None, lambda out: out
    from torch.distributed.tensor import Replicate, Shard

    lead = next(t for t in tensors if isinstance(t, dtensor))
    mesh = lead.device_mesh
    tensors = tuple(
        t if isinstance(t, dtensor) else dtensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)
        for t in tensors
    )
    query = tensors[0]
    by_heads = mesh.ndim == 1 and all(
        t.device_mesh == mesh and _is_shard(t.placements[0], 1, t.ndim) for t in tensors
    )
    if by_heads:
        out_placements = [Shard(2)]  # the output is (B, N, Hq, D)
        shard = _mesh_shard(mesh) if mesh.size() > 1 else None
        local = tuple(t.to_local() for t in tensors)
    else:
        replicated = [Replicate()] * mesh.ndim
        if any(t.device_mesh != mesh or list(t.placements) != replicated for t in tensors):
            _log_gather_once(query.placements)
        local = tuple(t.redistribute(mesh, replicated).to_local() for t in tensors)
        swap = {1: 2, 2: 1}
        out_placements = [
            Shard(swap.get(p.dim % query.ndim, p.dim % query.ndim)) if _is_shard(p) else Replicate()
            for p in query.placements
        ]
        shard = None

    def wrap(out: torch.Tensor) -> torch.Tensor:
        if by_heads:
            return dtensor.from_local(out, mesh, out_placements, run_check=False)
        full = dtensor.from_local(out, mesh, [Replicate()] * mesh.ndim, run_check=False)
        return full.redistribute(mesh, out_placements)  # slicing a replicated tensor: no communication

    return local[0], local[1], local[2], shard, wrap


_gather_logged = False


def _log_gather_once(placements: Any) -> None:
    global _gather_logged
    if not _gather_logged:
        _gather_logged = True
        import logging

        logging.getLogger("pbs.integrations.transformers").warning(
            "pbs: DTensor attention inputs with placements %s are gathered to every rank before PBS runs "
            "(PBS splits work by heads: shard q, k and v on the head axis, as tp_plan='auto' does; logged once)",
            tuple(placements),
        )


def _device_guard(t: torch.Tensor) -> contextlib.AbstractContextManager:
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _mean_over_ranks(shard: HeadShard, device: torch.device) -> Callable[[torch.Tensor | float], float]:
    """The dense policy's ``reduce`` hook: the mean of a density over the ranks, with one
    all_reduce and one read on the host.

    Every rank holds the same number of heads, so the mean of the ranks' per-head averages is the
    average over all heads.
    """
    import torch.distributed as dist

    def reduce(value: torch.Tensor | float) -> float:
        t = torch.as_tensor(value, dtype=torch.float64, device=device).reshape(1)
        dist.all_reduce(t, group=shard.group)
        return float(t) / shard.size

    return reduce


UNCHECKED_FALLBACKS = ("decode", "compiling")
"""Fallback reasons of the transformers attention function that skip `check_ranks_agree`: a decode
step is decided by the input's shape, which the ranks share, and would pay a collective per layer
and token; under ``torch.compile`` a collective and a host read would break the traced graph."""


def check_ranks_agree(
    shard: HeadShard, config: Any, q: Any, k: Any, v: Any, *, scale: float | None, dispatch: str = "pbs"
) -> float | None:
    """The tensor-parallel ranks agree on one attention call, before any collective of it.

    Every rank of ``shard.group`` calls it with its heads, whichever way it runs the call:
    `attention_on_shard` with ``dispatch="pbs"``, the transformers attention function with the
    reason it runs SDPA instead. For ``"pbs"`` the input checks run here without raising; then
    the ranks all-gather one record each (`pbs.distributed.agreement.agree`: the config's digest,
    the dispatch, the scale, dtype and shapes, the checks' outcome). Ranks that agree on all of it
    run the same collectives (the dense rules' all-reduce, ``o_proj``'s): without this, a rank
    that raised or went to SDPA left its peers waiting, and different thresholds silently mixed
    two configs' heads.

    Args:
        shard: this rank's `HeadShard`.
        config: the layer's `PBSConfig` (None for a layer configured dense).
        q, k, v: this rank's heads, ``(B, Hq_local, Nq, D)`` and ``(B, Hkv_local, Nk, D)``.
        scale: the softmax scale asked for (``None``: ``D ** -0.5``).
        dispatch: ``"pbs"``, or the fallback reason of a call that runs SDPA.

    Returns:
        The checked scale for ``"pbs"``, else None.

    Raises:
        ValueError: on every rank alike, naming the rank whose checks failed, or the field the
            ranks disagree on and the ranks' values.
    """
    from pbs.config import PBSConfig
    from pbs.distributed.agreement import agree, dim, tensor_fields
    from pbs.validation import check_all_finite, check_qkv, check_scale

    failure = checked = None
    shown_scale: Any = scale
    try:
        if config is not None or dispatch == "pbs":
            config = PBSConfig.coerce(config)  # the digest is of the config itself, however it was given
        if dispatch == "pbs":
            check_qkv(q, k, v, check_finite=False)
            if config.checks_finite(q.device):
                check_all_finite({"q": q, "k": k, "v": v})
            shown_scale = checked = check_scale(scale, q.shape[-1])
    except Exception as error:  # noqa: BLE001 - recorded, then raised on every rank by agree()
        failure = error
    if dispatch != "pbs" and scale is None and dim(q, -1):
        shown_scale = dim(q, -1) ** -0.5
    if not (shown_scale is None or isinstance(shown_scale, (int, float))):
        shown_scale = repr(shown_scale)
    same = {"dispatch": dispatch, "scale": shown_scale, **tensor_fields(q=q), "B": dim(q, 0), "Hq": dim(q, 1),
            "Hkv": dim(k, 1), "Nq": dim(q, 2), "Nk": dim(k, 2), "D": dim(q, -1), "Dv": dim(v, -1)}
    agree("tensor-parallel", group=shard.group, like=q, config=config, same=same, failure=failure)
    return checked


def attention_on_shard(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    config: Any,
    *,
    scale: float | None,
    shard: HeadShard | None,
) -> tuple[torch.Tensor, Any, str | None]:
    """`pbs.attention` on one rank's heads, deciding as one process over all heads would.

    With a shard of several ranks, the ranks first agree on the call (`check_ranks_agree`), then
    the dense policy (`pbs.dense.DensePolicy`) runs with the ranks' mean as its ``reduce`` hook.

    Args:
        q, k, v: this rank's heads, ``(B, Hq_local, Nq, D)`` and ``(B, Hkv_local, Nk, D)``.
        config: the layer's `PBSConfig`.
        scale: softmax scale (``None``: ``D ** -0.5``).
        shard: this rank's `HeadShard`, or ``None`` when the call holds every head.

    Returns:
        ``(out (B, Hq_local, Nq, Dv), plan, dense_reason)``. ``dense_reason`` is set when
        ``config.dense_fallback`` ran dense attention instead; the plan is then ``None`` (decided
        before planning) or has ``fallback`` set; otherwise ``plan`` is what ran.

    Raises:
        ValueError: bad inputs (as `pbs.attention`); with several ranks, on every rank alike,
            also when the ranks disagree (`check_ranks_agree`).
    """
    from pbs.api import attend
    from pbs.dense import DensePolicy

    if shard is None or shard.size == 1:
        with _device_guard(q):
            attended = attend(q, k, v, DensePolicy(config), scale=scale)
        return attended.out, attended.plan, attended.reason

    from pbs.config import PBSConfig
    from pbs.reference.seeded import head_shard

    # The ranks' agreement also runs the input checks that `attend` would run.
    checked_scale = check_ranks_agree(shard, config, q, k, v, scale=scale)
    policy = DensePolicy(PBSConfig.coerce(config), reduce=_mean_over_ranks(shard, q.device),
                         scope=f" over the {shard.size} tensor-parallel ranks")
    with _device_guard(q), head_shard(shard.rank, shard.size):
        attended = policy.attend(q, k, v, checked_scale)
    return attended.out, attended.plan, attended.reason
