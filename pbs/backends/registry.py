"""The registries of the dispatch layer: attention backends and the planners that plan for them.

One registry answers "what runs this": ``auto`` picks, by ``auto_priority``, the first backend
with no reasons against the call; a named backend that cannot run it raises with its reasons (and
``auto`` with every backend's). `resolve_backend` is the only place a backend is chosen: planning
calls it once and records the name in the `Plan`, and `run` obeys the plan.

A *planner* is the fast implementation of a permuter or selector for one planning family
(``"triton"``); a backend names the family that plans for it (``plans_with``). Which family plans
a call is an eligibility question (`pbs.backends.eligibility.planning_family`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from pbs.types import PagedTensor, Plan


@dataclass(frozen=True)
class CallSpec:
    """What a backend's eligibility depends on: the properties of one attention call.

    Hashable, so that the eligibility rules (`pbs.backends.eligibility`) are cached per spec and
    cost a dict lookup per call.
    """

    device: torch.device
    dtype: torch.dtype
    head_dim: int
    head_dim_v: int
    block_size: int
    needs_lse: bool = False
    page_size: int | None = None
    """Rows per page when keys and values are read from a paged cache (`pbs.types.PagedTensor`),
    None when they are contiguous tensors."""
    capturable: bool = False
    """The call is one launch over a padded batch inside a CUDA graph (``capturable=True``): each
    query's position comes from `AttentionCall.query_positions` and the result goes to
    `AttentionCall.out`, with no host read (`AttentionBackend.capturable`)."""
    precision: str = "native"
    """`pbs.PBSConfig.precision` of the call (`AttentionBackend.precisions`)."""

    @classmethod
    def of(cls, q: torch.Tensor, head_dim_v: int, block_size: int, needs_lse: bool = False,
           page_size: int | None = None, capturable: bool = False, precision: str = "native") -> "CallSpec":
        device = q.device
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return cls(device, q.dtype, q.shape[-1], head_dim_v, block_size, needs_lse, page_size, capturable,
                   precision)


@dataclass(frozen=True)
class AttentionCall:
    """Permuted tensors and the plan for one attention call."""

    q: torch.Tensor  # (B, Hq, Nq, D), permuted queries
    # (B, Hk, Nk, D) permuted keys and (B, Hk, Nk, Dv) values; or, for a backend whose reasons
    # accept a page_size, a sequence's keys and values in a paged cache (pbs.types.PagedTensor,
    # B = 1, original order).
    k: "torch.Tensor | PagedTensor"
    v: "torch.Tensor | PagedTensor"
    plan: "Plan"
    scale: float
    return_lse: bool = False
    out: torch.Tensor | None = None
    """``(B, Hq, Nq, Dv)`` to write the output into (any strides the backend takes), or None."""
    query_positions: torch.Tensor | None = None
    """``(B, Hq, Nq)`` original position of every query slot, in place of the plan's: a padded
    batch's sequences each have their own causal offset (``capturable=True``)."""
    row_starts: torch.Tensor | None = None
    """``(B + 1,)`` int32 cumulative query rows of a ragged batch (``cu_seq_q``), for a backend
    that declares ``ragged_rows``: ``q`` is then the packed ``(Tq, Hq, D)`` queries, the padded
    geometry (``B`` entries of ``Nq`` rows) is ``plan.mask.layout``'s, entry ``b`` has
    ``row_starts[b + 1] - row_starts[b]`` real rows, only they are computed, ``out`` is the packed
    ``(Tq, Hq, Dv)`` they are written to (row ``r`` of entry ``b`` at ``row_starts[b] + r``), and
    the LSE returned is ``(Hq, Tq)``."""


@dataclass(frozen=True)
class AttentionBackend:
    """A way to run block-sparse attention: the one registry that ``PBSConfig.backend``, ``auto``,
    ``pbs list``, the demo's choices and planning all read.

    Attributes:
        name: the ``PBSConfig.backend`` value that selects it.
        not_supported_reasons: why it cannot run calls of a `CallSpec` (empty list: it can).
        run: returns ``(B, Hq, Nq, Dv)`` in permuted query order, in any float dtype; with
            ``call.return_lse``, ``(out, lse)`` with a float32 ``(B, Hq, Nq)`` log-sum-exp.
        not_chosen_by_auto_reasons: further reasons for ``auto`` to pass it over although it can
            run a call when asked by name (e.g. the Triton interpreter on CPU: right but slow).
        auto_priority: ``auto`` tries backends by increasing priority; None: never by ``auto``.
        plans_with: the planner family (`register_planner`) used to plan for it on CUDA;
            planning off CUDA always uses the reference.
        returns_lse: whether ``run`` can return the log-sum-exp (calls that need it go to a
            backend that can).
        capturable: whether ``run`` takes `AttentionCall.query_positions` and `AttentionCall.out`
            and reads no tensor on the host, so that a padded batch runs in one launch inside a
            CUDA graph (calls with ``CallSpec.capturable`` go to a backend that does).
        precisions: the `pbs.PBSConfig.precision` values ``run`` computes in (it reads
            ``call.plan.config.precision``); calls in another go to a backend that declares theirs.
        ragged_rows: whether ``run`` takes `AttentionCall.row_starts`: a ragged batch's packed
            queries read in place, its real rows only computed and written packed (the capturable
            path then neither pads the queries nor copies the rows back).
    """

    name: str
    not_supported_reasons: Callable[[CallSpec], list[str]]
    run: Callable[[AttentionCall], torch.Tensor]
    not_chosen_by_auto_reasons: Callable[[CallSpec], list[str]] | None = None
    auto_priority: int | None = None
    plans_with: str = "reference"
    returns_lse: bool = False
    capturable: bool = False
    precisions: tuple[str, ...] = ("native",)
    ragged_rows: bool = False


_BACKENDS: dict[str, AttentionBackend] = {}


def register_backend(backend: AttentionBackend) -> AttentionBackend:
    """Adds (or replaces, by name) an attention backend; ``auto`` is reserved."""
    if backend.name == "auto":
        raise ValueError("'auto' is not a backend name: it chooses among the registered backends")
    _BACKENDS[backend.name] = backend
    return backend


def list_backends() -> list[str]:
    """Names of the registered attention backends, in the order ``auto`` tries them (then the
    ones ``auto`` never chooses)."""
    ranked = sorted((b for b in _BACKENDS.values() if b.auto_priority is not None), key=lambda b: b.auto_priority)
    return [b.name for b in ranked] + [name for name, b in _BACKENDS.items() if b.auto_priority is None]


def get_backend(name: str) -> AttentionBackend:
    """The backend registered as ``name``; the error names the registered ones."""
    try:
        return _BACKENDS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown backend {name!r}; available: auto, {', '.join(list_backends())}") from None


def check_backend_name(name: str) -> None:
    """Raises the `get_backend` error unless ``name`` is ``auto`` or a registered backend (for
    callers that want to fail before loading a model)."""
    if name != "auto":
        get_backend(name)


def resolve_backend(requested: str, spec: CallSpec) -> AttentionBackend:
    """``requested`` (a backend name or ``auto``) as the backend that runs calls of ``spec``.

    Raises:
        ValueError: a named backend that cannot run ``spec`` (its reasons), or no backend for
            ``auto`` (every backend's reasons).
    """
    if requested != "auto":
        backend = get_backend(requested)
        reasons = _reasons(backend, spec)
        if reasons:
            raise ValueError(f"backend {requested!r} cannot run this call: " + "; ".join(reasons))
        return backend
    all_reasons = []
    for name in list_backends():
        backend = _BACKENDS[name]
        if backend.auto_priority is None:
            continue
        reasons = _reasons(backend, spec)
        if not reasons and backend.not_chosen_by_auto_reasons is not None:
            reasons = backend.not_chosen_by_auto_reasons(spec)
        if not reasons:
            return backend
        all_reasons.append(f"{name}: {'; '.join(reasons)}")
    raise ValueError("no backend can run this call: " + " | ".join(all_reasons))


def _reasons(backend: AttentionBackend, spec: CallSpec) -> list[str]:
    reasons = backend.not_supported_reasons(spec)
    if spec.needs_lse and not backend.returns_lse:
        reasons = [*reasons, "it does not return the log-sum-exp (return_lse=True)"]
    if spec.capturable and not backend.capturable:
        reasons = [*reasons, "it does not declare capturable (per-query positions and a given out, no host read: "
                             "capturable=True)"]
    if spec.precision not in backend.precisions:
        takers = [name for name, b in _BACKENDS.items() if spec.precision in b.precisions]
        reasons = [*reasons, f"it computes in precision {', '.join(backend.precisions)}, not "
                             f"config.precision={spec.precision!r} (backends that do: {', '.join(takers) or 'none'})"]
    return reasons


def backend_reasons(backend: AttentionBackend, spec: CallSpec) -> list[str]:
    """Why ``backend`` cannot run calls of ``spec``: its own reasons, and the LSE when asked."""
    return _reasons(backend, spec)


ComponentKind = Literal["permuter", "selector"]
Planner = Callable[[Any, Any], Any]
_PLANNERS: dict[tuple[str, str, str], Planner] = {}


def register_planner(kind: ComponentKind, name: str, family: str) -> Callable[[Planner], Planner]:
    """Decorator: ``fn(config, inputs)`` plans the ``kind`` (``"permuter"`` or ``"selector"``)
    named ``name`` for the backends whose ``plans_with`` is ``family``.

    A permuter planner returns `pbs.Permutations`; a selector planner a `pbs.BlockMask` (forced
    blocks included) or a ``(B, Hq, Tq, Tk)`` bool tensor.
    """
    if kind not in ("permuter", "selector"):
        raise ValueError(f"kind must be 'permuter' or 'selector', got {kind!r}")
    if family == "reference":
        raise ValueError("the reference family is the components' own methods; register another family name")

    def decorator(fn: Planner) -> Planner:
        _PLANNERS[(kind, name, family)] = fn
        return fn

    return decorator


def family_has_planners(family: str) -> bool:
    """Whether any planner is registered for ``family``."""
    return any(f == family for (_, _, f) in _PLANNERS)


def planners_of(family: str, kind: ComponentKind) -> list[str]:
    """Names of the ``kind`` components with a planner registered for ``family``, sorted."""
    return sorted(n for (k, n, f) in _PLANNERS if k == kind and f == family)


def planner_for(kind: ComponentKind, name: str, family: str) -> Planner | None:
    """The planner registered for ``(kind, name, family)``, or None (the reference method runs)."""
    return _PLANNERS.get((kind, name, family))
