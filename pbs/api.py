"""The public entry points: `plan`, `run` and `attention`.

Each checks its inputs, makes the inputs' GPU current, and hands over: planning to
`pbs.planning`, the choice between PBS and dense attention to `pbs.dense.DensePolicy`.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from pbs.config import PBSConfig
from pbs.dense import Attended, DensePolicy, dense_attention
from pbs.backends.permute import permute_keys_and_values
from pbs.planning import build_plan, run_planned
from pbs.types import Plan
from pbs.validation import check_all_finite, check_qkv, check_scale

ConfigLike = PBSConfig | dict[str, Any] | str | None


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return check_scale(scale, q.shape[-1])


def _check_inputs(config: PBSConfig, q: Any, k: Any, v: Any) -> None:
    # Shapes, dtypes and devices first: the finite check reads q.device, which a non-tensor lacks.
    check_qkv(q, k, v, check_finite=False)
    if config.checks_finite(q.device):
        check_all_finite({"q": q, "k": k, "v": v})


def _on_device_of(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """Makes ``x``'s GPU the current one for the call: Triton launches on the current device, and a
    model spread over GPUs (``device_map="auto"``) calls with tensors on the others."""
    if x.is_cuda and x.device.index is not None and x.device.index != torch.cuda.current_device():
        return torch.cuda.device(x.device)
    return contextlib.nullcontext()


def plan(
    q: torch.Tensor, k: torch.Tensor, config: ConfigLike = None, *, scale: float | None = None, return_lse: bool = False,
    **unexpected: Any,
) -> Plan:
    """Computes the permutation and the block mask without running attention.

    Args:
        q: ``(B, Hq, Nq, D)`` queries (the last ``Nq`` of the ``Nk`` positions).
        k: ``(B, Hkv, Nk, D)`` keys, ``Hq % Hkv == 0``.
        config: a `PBSConfig`, a dict or JSON string of one, or None for the defaults.
        scale: softmax scale, default ``D ** -0.5``.
        return_lse: plan for a `run` that returns the log-sum-exp (the backend chosen must
            return it).

    Returns:
        The `Plan`: ``backend``, ``key_permutation``, ``query_permutation``, ``mask`` and
        ``density``.

    Example:
        ```python
        import pbs

        q, k, v = pbs.testing.make_qkv(seq_len=1024, heads_q=4, heads_kv=2, head_dim=32)
        p = pbs.plan(q, k)
        assert 0 < p.density <= 1
        out = pbs.run(p, q, k, v)  # (1, 4, 1024, 32)
        ```
    """
    _refuse_unexpected("plan", unexpected)
    config = PBSConfig.coerce(config)
    _check_inputs(config, q, k, k)
    with _on_device_of(q):
        return build_plan(q, k, config, _scale(q, scale), return_lse=return_lse)[0]


def run(
    plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Runs block-sparse attention for a plan made by `plan` on the same ``q`` and ``k``, on the
    backend the plan recorded.

    Args:
        plan: from `plan` (with ``return_lse=True`` there when it is asked for here).
        q: ``(B, Hq, Nq, D)``; k: ``(B, Hkv, Nk, D)``; v: ``(B, Hkv, Nk, Dv)``.
        scale: softmax scale, default ``D ** -0.5``.
        return_lse: also return the log-sum-exp (see `attention`).

    Returns:
        ``(B, Hq, Nq, Dv)`` in ``q``'s dtype and original query order; with ``return_lse``,
        ``(out, lse)``.
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a pbs.Plan from pbs.plan() or attention(..., return_plan=True), "
                        f"got {type(plan).__name__}")
    _check_inputs(plan.config, q, k, v)
    layout = plan.layout
    if (q.shape[0], q.shape[1], q.shape[2], k.shape[1], k.shape[2]) != (
        layout.batch, layout.heads_q, layout.seq_len_q, layout.heads_kv, layout.seq_len_k
    ):
        raise ValueError(
            f"plan was made for q (B={layout.batch}, Hq={layout.heads_q}, Nq={layout.seq_len_q}) and "
            f"k (Hkv={layout.heads_kv}, Nk={layout.seq_len_k}), got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    with _on_device_of(q):
        q_perm = plan.query_permutation.apply(q)
        k_perm, v_perm = permute_keys_and_values(plan.key_permutation, k, v)
        return run_planned(plan, q_perm, k_perm, v_perm, q.dtype, _scale(q, scale), return_lse=return_lse)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    config: ConfigLike = None,
    *,
    scale: float | None = None,
    return_plan: bool = False,
    return_lse: bool = False,
    **unexpected: Any,
) -> torch.Tensor | tuple:
    """Permuted block-sparse attention: plan, then run.

    Args:
        q: ``(B, Hq, Nq, D)`` queries: the last ``Nq`` of the ``Nk`` positions (``Nq == Nk`` for
            prefill, ``Nq < Nk`` for a chunk after a cached prefix).
        k: ``(B, Hkv, Nk, D)`` keys, ``Hq % Hkv == 0`` (GQA without copying K/V in ``shared`` mode).
        v: ``(B, Hkv, Nk, Dv)`` values.
        config: a `PBSConfig`, a dict or JSON string of one, or None for the defaults.
        scale: softmax scale, default ``D ** -0.5``.
        return_plan: also return the `Plan` (density, mask, permutations). When the dense policy
            ran dense attention instead, the plan is dense too (density 1.0) and says why:
            ``plan.decision``, ``plan.dense_rule``, ``plan.fallback``.
        return_lse: also return the log-sum-exp: float32 ``(B, Hq, Nq)``, the natural-log
            log-sum-exp of each query's scaled scores over the keys it attends to (the selected
            blocks, causal), ``-inf`` for a query that sees no key. Partial results over
            disjoint keys merge with `pbs.merge_attention_states`.

    Returns:
        ``(B, Hq, Nq, Dv)`` in ``q``'s dtype; ``(out, lse)`` with ``return_lse``, ``(out, plan)``
        with ``return_plan``, ``(out, lse, plan)`` with both. With ``backend="auto"`` on the
        devices ``config.dense_fallback.devices`` names (CUDA by default), the policy may run
        dense attention instead (`pbs.dense.DensePolicy`).

    Example:
        Sparse against dense attention on the synthetic workload:

        ```python
        import pbs

        q, k, v = pbs.testing.make_qkv(seq_len=1024, heads_q=4, heads_kv=2, head_dim=32)
        out = pbs.attention(q, k, v, {"selector": {"name": "mean_pool", "threshold": 0.9}})
        dense = pbs.reference.dense_attention(q, k, v)
        print(float((out.float() - dense).norm() / dense.norm()))  # relative error
        ```
    """
    if unexpected:
        _refuse_unexpected("attention", unexpected)
    if torch.compiler.is_compiling():
        if return_plan or return_lse:
            asked = "return_plan=True" if return_plan else "return_lse=True"
            raise ValueError(f"{asked} is not supported under torch.compile (the op returns the output only)")
        return torch.ops.pbs.attention(q, k, v, _config_json(config), _scale(q, scale))
    config = PBSConfig.coerce(config)
    policy = DensePolicy(config, return_lse=return_lse)
    # Nq > Nk is refused below, before SDPA could warn about the NaN rows it would produce.
    decided = (policy.shape_decision(q, k) if not return_lse and _is_4d_tensor(q) and _is_4d_tensor(k)
               and q.shape[2] <= k.shape[2] else None)
    if decided is not None:
        out = _dense_then_checks(config, q, k, v, scale)
        if not return_plan:
            return out
        attended = Attended(out, None, decided[1], None, decided[0])
    else:
        attended = attend(q, k, v, policy, scale=scale)
    if not return_plan:
        return (attended.out, attended.lse) if return_lse else attended.out
    plan = attended.plan
    if attended.reason is not None:
        with _on_device_of(q):
            plan = policy.dense_plan(q, k, v.shape[-1], attended.reason, attended.rule)
    return (attended.out, attended.lse, plan) if return_lse else (attended.out, plan)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, policy: DensePolicy, *, scale: float | None = None) -> Attended:
    """`attention` under a given `DensePolicy`, with the reason when dense attention ran.

    For integrations that decide with a policy of their own (tensor parallelism plugs in its
    all-reduce) or that record why a call ran dense.

    Args:
        q: ``(B, Hq, Nq, D)``; k: ``(B, Hkv, Nk, D)``; v: ``(B, Hkv, Nk, Dv)``.
        policy: the dense policy, holding the config.
        scale: softmax scale, default ``D ** -0.5``.

    Returns:
        `pbs.dense.Attended`: ``(out, plan, reason, lse, rule)``.
    """
    _check_inputs(policy.config, q, k, v)
    with _on_device_of(q):
        return policy.attend(q, k, v, _scale(q, scale))


# Keywords users bring from SDPA and FlashAttention, and where pbs takes what they mean.
_KEYWORD_HINTS = {
    "causal": "causality is a config field: PBSConfig(causal=...), True by default (unlike SDPA's is_causal)",
    "is_causal": "causality is a config field: PBSConfig(causal=...), True by default (unlike SDPA's is_causal)",
    "softmax_scale": "the softmax scale is scale=... (default D ** -0.5)",
    "attn_mask": "pbs runs causal attention with its own block mask; an arbitrary attn_mask is not taken",
    "dropout_p": "pbs is forward-only inference attention: no dropout",
    "enable_gqa": "GQA needs no flag: k and v with fewer heads than q (Hq % Hkv == 0) are grouped without copying",
}


def _refuse_unexpected(function: str, unexpected: dict[str, Any]) -> None:
    """A ``TypeError`` for keywords ``function`` does not take, with a hint where one is known."""
    if not unexpected:
        return
    name = next(iter(unexpected))
    hint = _KEYWORD_HINTS.get(name)
    raise TypeError(f"pbs.{function}() got an unexpected keyword argument {name!r}" + (f": {hint}" if hint else ""))


def _is_4d_tensor(x: object) -> bool:
    """A plain 4-D tensor: what the shape-only dense decision may read ``shape`` of (a nested
    tensor's sizes are ragged or unreadable; `check_qkv` names the problem instead)."""
    return isinstance(x, torch.Tensor) and not x.is_nested and x.dim() == 4


def _dense_then_checks(config: PBSConfig, q: torch.Tensor, k: torch.Tensor, v: object, scale: float | None) -> torch.Tensor:
    """Dense attention (`pbs.dense.dense_attention`) for a call too short to plan, launched before
    the input checks run.

    The checks then run on the host while the GPU computes instead of before it starts: on an idle
    GPU they were most of what pbs added to SDPA's latency (docs/notes.md). Errors stay the same:
    an exception from dense attention gives way to the checks' named error, and inputs that it
    accepts but PBS refuses (inputs that need grad, ``Nq > Nk``, NaN when checked, ...) still
    raise, the output discarded.
    """
    s = _scale(q, scale)
    failure: Exception | None = None
    try:
        out = dense_attention(q, k, v, scale=s, causal=config.causal)  # type: ignore[arg-type]
    except Exception as sdpa_error:  # noqa: BLE001 - replaced by the named error below, else re-raised
        failure = sdpa_error
    if failure is not None:
        check_qkv(q, k, v, check_finite=False)
        raise failure
    check_qkv(q, k, v, check_finite=config.checks_finite(q.device))
    return out


def _config_json(config: ConfigLike) -> str:
    # Validated once when the graph is traced; the custom op receives the JSON string.
    return PBSConfig.coerce(config).model_dump_json()


# What `@torch.compiler.assume_constant_result` does (Dynamo calls a function so marked once,
# while tracing, and keeps its result as a constant), done by hand: the decorator imports
# torch._dynamo, which would cost `import pbs` about a second. tests/test_import.py checks that
# the decorator still sets exactly this mark.
_config_json._dynamo_marked_constant = True  # type: ignore[attr-defined]
