"""The built-in attention backends, in the order ``backend="auto"`` tries them.

* ``"hopper"``: the warp-specialized, persistent Gluon kernel of `pbs.kernels.hopper_attn` on
  Hopper GPUs (fp16/bf16, head dim 64 or 128, mask block 128);
* ``"triton"``: the software-pipelined Triton kernel of `pbs.kernels.block_sparse_attn` on any
  CUDA GPU of compute capability 8.0 or newer; on CPU tensors it runs in the Triton interpreter
  when ``TRITON_INTERPRET=1`` and ``backend="triton"`` is named (the tests do), never through
  ``auto``;
* ``"reference"``: `pbs.reference.block_sparse_attn`, pure PyTorch, anywhere (auto's last resort);
* ``"flex"``: the same mask lowered to ``torch.nn.attention.flex_attention`` (CUDA only, never
  chosen by ``auto``), a second, independent implementation to compare against.

``hopper``, ``triton`` and ``reference`` also return the log-sum-exp (``flex`` does not).
``triton`` and ``reference`` also compute in FP8 and INT8 (``PBSConfig.precision``: the kernel
quantizes first, `pbs.kernels.fp8_quant`; the reference fake-quantizes, `pbs.reference.fp8`), and
``hopper`` in the e4m3 precisions ``fp8_qk`` and ``fp8`` after the same quantization pass (with
V's keys stored in its operand order), so ``auto`` runs those on it on Hopper GPUs.
``triton`` reads keys and values from a paged cache in place (`pbs.types.PagedTensor`), and so
does ``hopper`` when the page size is 16 or more; ``reference`` takes them too, gathering
the pages into contiguous tensors first (the oracle); ``flex`` gives a reason against paged calls. The GPU backends plan with the ``triton`` planners (`pbs.backends.planners`). Kernels are
imported when they first run, so ``import pbs`` works without Triton.
"""

from __future__ import annotations

import torch

from pbs.backends.eligibility import (flex_reasons, gluon_kernel_reasons, reference_auto_reasons, triton_auto_reasons,
                                      triton_kernel_reasons)
from pbs.backends.registry import AttentionBackend, AttentionCall, CallSpec, register_backend
from pbs.types import PRECISION_FORMATS, is_paged


def _kernel_arguments(call: AttentionCall) -> dict:
    """Keyword arguments every kernel takes; positions only where something moved."""
    plan = call.plan
    if call.query_positions is not None:
        query_positions = call.query_positions
    else:
        query_positions = None if plan.query_permutation.is_identity else plan.query_positions()
    return dict(
        query_positions=query_positions,
        key_positions=None if plan.key_permutation.is_identity else plan.key_positions(),
        scale=call.scale,
        causal=plan.layout.causal,
    )


def _kv_arguments(call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k, v)`` as the kernels take them: the tensors, or the caches of paged ones."""
    if is_paged(call.k):
        return call.k.cache, call.v.cache
    return call.k, call.v


def _paged_arguments(call: AttentionCall) -> dict:
    return {"block_table": call.k.block_table} if is_paged(call.k) else {}


def _run_reference(call: AttentionCall) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The eager oracle. Paged keys and values are gathered into contiguous tensors first: a copy
    of the sequence's pages, which the kernels avoid, but the oracle should share no page
    arithmetic with them."""
    from pbs.reference.fp8 import fp8_block_sparse_attention_reference

    plan = call.plan
    k, v = (x.gather() if is_paged(x) else x for x in (call.k, call.v))
    query_positions = plan.query_positions() if call.query_positions is None else call.query_positions
    result = fp8_block_sparse_attention_reference(call.q, k, v, plan.mask, query_positions, plan.key_positions(),
                                                  scale=call.scale, causal=plan.layout.causal,
                                                  return_lse=call.return_lse, precision=plan.config.precision)
    if call.out is None:
        return result
    out, lse = result if call.return_lse else (result, None)
    call.out.copy_(out)
    return (call.out, lse) if call.return_lse else call.out


def _run_triton(call: AttentionCall) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    from pbs.kernels.block_sparse_attn import block_sparse_attention

    lse = torch.empty(call.q.shape[:3], dtype=torch.float32, device=call.q.device) if call.return_lse else None
    out = block_sparse_attention(call.q, *_kv_arguments(call), call.plan.mask, lse=lse, out=call.out,
                                 precision=call.plan.config.precision, **_kernel_arguments(call),
                                 **_paged_arguments(call))
    return (out, lse) if lse is not None else out


def _run_hopper(call: AttentionCall) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    from pbs.kernels.hopper_attn import hopper_block_sparse_attention

    rows = call.q.shape[:3] if call.row_starts is None else (call.q.shape[1], call.out.shape[0])
    lse = torch.empty(rows, dtype=torch.float32, device=call.q.device) if call.return_lse else None
    out = hopper_block_sparse_attention(call.q, *_kv_arguments(call), call.plan.mask, lse=lse, out=call.out,
                                        row_starts=call.row_starts, precision=call.plan.config.precision,
                                        **_kernel_arguments(call), **_paged_arguments(call))
    return (out, lse) if lse is not None else out


def _run_flex(call: AttentionCall) -> torch.Tensor:
    from pbs.kernels.flex import flex_block_sparse_attention

    return flex_block_sparse_attention(call.q, call.k, call.v, call.plan.mask, **_kernel_arguments(call))


_ALL_PRECISIONS = tuple(PRECISION_FORMATS)  # every pbs.PBSConfig.precision


def _no_reasons(spec: CallSpec) -> list[str]:
    return []


register_backend(AttentionBackend("hopper", gluon_kernel_reasons, _run_hopper, auto_priority=0, plans_with="triton",
                                  returns_lse=True, capturable=True, ragged_rows=True,
                                  precisions=_ALL_PRECISIONS))
register_backend(AttentionBackend("triton", triton_kernel_reasons, _run_triton, triton_auto_reasons, auto_priority=1,
                                  plans_with="triton", returns_lse=True, capturable=True, precisions=_ALL_PRECISIONS))
register_backend(AttentionBackend("reference", _no_reasons, _run_reference, reference_auto_reasons, auto_priority=100,
                                  returns_lse=True, capturable=True, precisions=_ALL_PRECISIONS))
register_backend(AttentionBackend("flex", flex_reasons, _run_flex, plans_with="triton"))
