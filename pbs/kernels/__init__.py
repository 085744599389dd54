"""Triton kernels and their launchers (each with an eager twin in `pbs.reference`).

Registers three attention backends (`pbs.backends`), in the order ``backend="auto"`` tries them:

* ``"hopper"``: the warp-specialized, persistent Gluon kernel of `pbs.kernels.hopper_attn` on
  Hopper GPUs (fp16/bf16, head dim 64 or 128, mask block 128);
* ``"triton"``: `pbs.kernels.block_sparse_attn.block_sparse_attention`'s software-pipelined Triton
  kernel on any CUDA GPU of compute capability 8.0 or newer; on CPU tensors it runs in the Triton
  interpreter when ``TRITON_INTERPRET=1`` and ``backend="triton"`` is named (the tests do), never
  through ``auto``;
* ``"flex"``: the same mask lowered to ``torch.nn.attention.flex_attention`` (CUDA only, never
  chosen by ``auto``), a second, independent implementation to compare against.

All three plan with the ``triton`` implementations of the permuters and selectors on CUDA.

`pbs.kernels.gather.gather_kv` applies a key permutation to K and V in one launch (3x faster
than ``Permutation.apply``'s ``torch.gather`` on an H200; see docs/benchmarks.md).

Triton is imported only when a kernel runs, so ``import pbs`` works without it.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from pbs.backends import AttentionBackend, AttentionCall, register_backend
from pbs.components import permuter_registry, selector_registry
from pbs.kernels._common import interpreting

__all__ = ["triton_not_supported_reasons", "flex_not_supported_reasons"]

_MAX_HEAD_DIM = 256


def _head_dim_reasons(call: AttentionCall) -> list[str]:
    reasons = []
    # TMA needs rows of a multiple of 16 bytes.
    multiple = 16 // call.q.element_size()
    for name, dim in (("head dim", call.q.shape[-1]), ("value head dim", call.v.shape[-1])):
        if dim > _MAX_HEAD_DIM:
            reasons.append(f"{name} {dim} is larger than {_MAX_HEAD_DIM}")
        elif dim % multiple:
            reasons.append(f"{name} {dim} is not a multiple of {multiple} (16 bytes of {call.q.dtype})")
    return reasons


def triton_not_supported_reasons(call: AttentionCall) -> list[str]:
    """Why the Triton kernel cannot run ``call`` (empty: it can)."""
    reasons = []
    if importlib.util.find_spec("triton") is None:
        reasons.append("triton is not installed")
    q = call.q
    if q.device.type != "cuda":
        if not interpreting():
            reasons.append(f"inputs are on {q.device.type}, not CUDA (set TRITON_INTERPRET=1 to run the kernel in the interpreter)")
        elif q.dtype == torch.bfloat16:
            reasons.append("the Triton interpreter computes bfloat16 dot products wrongly; use float16 or float32")
    elif torch.cuda.get_device_capability(q.device) < (8, 0):
        reasons.append("the Triton kernel needs a GPU of compute capability 8.0 or newer")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        reasons.append(f"dtype {q.dtype} is not float16, bfloat16 or float32")
    reasons += _head_dim_reasons(call)
    return reasons


def _kernel_arguments(call: AttentionCall) -> dict:
    """Keyword arguments shared by both kernels; positions only where something moved."""
    plan = call.plan
    return dict(
        query_positions=None if plan.query_permutation.is_identity else plan.query_positions(),
        key_positions=None if plan.key_permutation.is_identity else plan.key_positions(),
        scale=call.scale,
        causal=plan.layout.causal,
    )


def _run_triton(call: AttentionCall) -> torch.Tensor:
    from pbs.kernels.block_sparse_attn import block_sparse_attention

    return block_sparse_attention(call.q, call.k, call.v, call.plan.mask, kernel="triton", **_kernel_arguments(call))


def hopper_not_supported_reasons_for_call(call: AttentionCall) -> list[str]:
    """Why the warp-specialized Gluon kernel (`pbs.kernels.hopper_attn`) cannot run ``call``."""
    if importlib.util.find_spec("triton") is None:
        return ["triton is not installed"]
    if call.q.device.type != "cuda":
        return [f"inputs are on {call.q.device.type}, not CUDA (the Gluon kernel has no interpreter)"]
    try:
        from pbs.kernels.hopper_attn import hopper_not_supported_reasons
    except ImportError as exc:  # a Triton without Gluon, or with another Gluon API
        return [f"this Triton has no usable Gluon ({exc})"]
    return hopper_not_supported_reasons(call.q, call.k, call.v, call.plan.layout.block_size)


def _run_hopper(call: AttentionCall) -> torch.Tensor:
    from pbs.kernels.block_sparse_attn import block_sparse_attention

    return block_sparse_attention(call.q, call.k, call.v, call.plan.mask, kernel="hopper", **_kernel_arguments(call))


def flex_not_supported_reasons(call: AttentionCall) -> list[str]:
    """Why the FlexAttention lowering cannot run ``call`` (empty: it can)."""
    reasons = []
    if call.q.device.type != "cuda":
        reasons.append(f"inputs are on {call.q.device.type}, not CUDA (FlexAttention runs compiled on CUDA only)")
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        reasons.append(f"torch {torch.__version__} has no torch.nn.attention.flex_attention")
    if call.q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        reasons.append(f"dtype {call.q.dtype} is not float16, bfloat16 or float32")
    return reasons


def _run_flex(call: AttentionCall) -> torch.Tensor:
    from pbs.kernels.flex import flex_block_sparse_attention

    return flex_block_sparse_attention(call.q, call.k, call.v, call.plan.mask, **_kernel_arguments(call))


def _triton_auto_reasons(call: AttentionCall) -> list[str]:
    if call.q.device.type != "cuda":
        return ["auto uses the Triton kernel on CUDA only (name backend='triton' to run the interpreter)"]
    return []


def _lazy(module: str, name: str):
    """``module.name`` imported on first call: registering the GPU implementations must not import
    their Triton kernels (``import pbs`` stays light)."""

    def implementation(config, inputs):
        return getattr(importlib.import_module(module), name)(config, inputs)

    implementation.__name__ = name
    return implementation


# The attention backends, in auto's order: the Gluon kernel on Hopper, the Triton kernel on any
# CUDA GPU (and, named, in the interpreter), then the reference (pbs.backends). flex is never auto.
register_backend(AttentionBackend(
    "hopper", hopper_not_supported_reasons_for_call, _run_hopper, auto_priority=0, plans_with="triton",
))
register_backend(AttentionBackend(
    "triton", triton_not_supported_reasons, _run_triton, _triton_auto_reasons, auto_priority=1, plans_with="triton",
))
register_backend(AttentionBackend("flex", flex_not_supported_reasons, _run_flex, plans_with="triton"))

# Planning on the GPU: the `triton` implementations of the default permuter and the score-based
# selectors (pbs.planning uses them for CUDA inputs unless backend="reference").
# They follow the reference semantics (Eq. 3 scoring unless `causal_scoring`, candidate blocks,
# XAttention's estimator for unsegmented layouts). A permuter without one (`none`, `identity`,
# ...) runs its reference `permute` on the GPU tensors, and the selectors still run here.
permuter_registry.register_impl("last_block", "triton")(_lazy("pbs.kernels.last_block", "last_block_permute"))
for _name, _module, _function in (
    ("mean_pool", "pbs.kernels.selection", "mean_pool_select"),
    ("antidiagonal", "pbs.kernels.selection", "antidiagonal_select"),
    ("sampled_rows", "pbs.kernels.sampled_rows", "sampled_rows_select"),
    ("vertical_slash", "pbs.kernels.vertical_slash", "vertical_slash_select"),
    ("union", "pbs.kernels.vertical_slash", "union_select"),
    ("head_choice", "pbs.kernels.vertical_slash", "head_choice_select"),
):
    selector_registry.register_impl(_name, "triton")(_lazy(_module, _function))
