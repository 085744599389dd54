"""Attention backends: each declares what it supports and runs a plan on permuted tensors.

One registry answers "what runs this": ``auto`` picks, by ``auto_priority``, the first backend
with no reasons against it; a named backend that cannot run a call raises with its reasons (and
``auto`` with every backend's). Built in: ``reference`` (here), ``hopper``, ``triton`` and
``flex`` (`pbs.kernels`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pbs.reference.block_sparse_attn import block_sparse_attention_reference
from pbs.types import Plan


@dataclass(frozen=True)
class AttentionCall:
    """Permuted tensors and the plan for one attention call."""

    q: torch.Tensor  # (B, Hq, Nq, D), permuted queries
    k: torch.Tensor  # (B, Hk, Nk, D), permuted keys
    v: torch.Tensor  # (B, Hk, Nk, Dv), permuted values
    plan: Plan
    scale: float


@dataclass(frozen=True)
class AttentionBackend:
    """A way to run block-sparse attention: the one registry that ``PBSConfig.backend``, ``auto``,
    ``pbs list``, the demo's choices and planning all read.

    Attributes:
        name: the ``PBSConfig.backend`` value that selects it.
        not_supported_reasons: why it cannot run a call (empty list: it can).
        run: returns ``(B, Hq, Nq, Dv)`` in permuted query order, in any float dtype.
        not_chosen_by_auto_reasons: further reasons for ``auto`` to pass it over although it can
            run a call when asked by name (e.g. the Triton interpreter on CPU: right but slow).
        auto_priority: ``auto`` tries backends by increasing priority; None: never by ``auto``.
        plans_with: the permuter/selector implementations (`PermuterRegistry.register_impl`
            names) used to plan for it on CUDA; planning off CUDA always uses the reference.
    """

    name: str
    not_supported_reasons: Callable[[AttentionCall], list[str]]
    run: Callable[[AttentionCall], torch.Tensor]
    not_chosen_by_auto_reasons: Callable[[AttentionCall], list[str]] | None = None
    auto_priority: int | None = None
    plans_with: str = "reference"


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
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; available: auto, {', '.join(list_backends())}") from None


def planning_implementation(backend: str, device: torch.device) -> str:
    """Which permuter/selector implementations plan for ``backend`` on ``device``: ``"reference"``
    off CUDA or without Triton, else the named backend's ``plans_with`` (``auto``: ``"triton"``)."""
    import importlib.util

    if device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return "reference"
    if backend == "auto":
        return "triton" if "triton" in _BACKENDS else "reference"
    return get_backend(backend).plans_with


def _reference_reasons(call: AttentionCall) -> list[str]:
    return []


def _run_reference(call: AttentionCall) -> torch.Tensor:
    return block_sparse_attention_reference(
        call.q,
        call.k,
        call.v,
        call.plan.mask,
        call.plan.query_positions(),
        call.plan.key_positions(),
        scale=call.scale,
        causal=call.plan.layout.causal,
    )


# The reference is auto's last resort; faster backends register lower priorities (see pbs.kernels).
REFERENCE = AttentionBackend("reference", _reference_reasons, _run_reference, auto_priority=100)
register_backend(REFERENCE)


def choose_backend(requested: str, call: AttentionCall) -> AttentionBackend:
    """Resolves ``requested`` (a backend name or ``auto``) to a backend that supports ``call``."""
    if requested != "auto":
        backend = get_backend(requested)
        reasons = backend.not_supported_reasons(call)
        if reasons:
            raise ValueError(f"backend {requested!r} cannot run this call: " + "; ".join(reasons))
        return backend
    all_reasons = []
    for name in list_backends():
        backend = _BACKENDS[name]
        if backend.auto_priority is None:
            continue
        reasons = backend.not_supported_reasons(call)
        if not reasons and backend.not_chosen_by_auto_reasons is not None:
            reasons = backend.not_chosen_by_auto_reasons(call)
        if not reasons:
            return backend
        all_reasons.append(f"{name}: {'; '.join(reasons)}")
    raise ValueError("no backend can run this call: " + " | ".join(all_reasons))

