"""Dense attention, and `DensePolicy`: the one place that decides when ``auto`` runs it instead
of PBS, and why.

Sparse attention only pays when the skipped blocks cost more than planning: at short lengths and
at high selected densities a dense kernel wins (docs/benchmarks.md has the measured crossover).
`pbs.config.DenseFallback` says where the lines are; `DensePolicy` applies them, in one order, for
every entry point: `pbs.attention` and `pbs.varlen_attention` (eagerly, and per sequence on the
device with ``capturable=True``), context parallelism (whole-sequence numbers, its all-reduce as
the ``reduce`` hook), tensor parallelism (its all-reduce as the hook) and the integrations. No
other module compares a length or a density with ``dense_fallback`` or writes a fallback reason
(tests/test_layout_rules.py holds that).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from pbs.backends.probe import (
    dense_kernel_attention,
    dense_kernel_available,
    gated_dense_available,
    probe_estimate,
    probe_then_gated_dense,
)
from pbs.config import DenseFallback, PBSConfig
from pbs.planning import build_plan, full_plan, page_size_of, run_planned
from pbs.types import Plan, is_paged

logger = logging.getLogger("pbs")

_LOGGED: set[str] = set()

_ABOVE_ANY_LENGTH = 1 << 62


def _log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.info(message)


# The last priority order seen and its cuDNN-first form: the order rarely changes, so most calls
# compare two short lists instead of building a new one.
_LAST_ORDER: tuple[list[int], list[int] | None] = ([], None)


def _cudnn_first(order: list[int]) -> list[int] | None:
    """SDPA's backend priority ``order`` with cuDNN moved first, or None if it is first already.

    cuDNN is the fastest dense causal prefill on Hopper (docs/benchmarks.md), but
    PyTorch does not rank it first. Only the order changes: a backend the user disabled stays
    disabled. (``torch.nn.attention.sdpa_kernel`` would do the same, at a host cost per call that
    shows at short lengths.)
    """
    global _LAST_ORDER
    seen, cudnn_first = _LAST_ORDER
    if order == seen:
        return cudnn_first
    from torch.nn.attention import SDPBackend

    cudnn = int(SDPBackend.CUDNN_ATTENTION)
    cudnn_first = None if order[0] == cudnn else [cudnn] + [b for b in order if b != cudnn]
    _LAST_ORDER = (order, cudnn_first)
    return cudnn_first


def dense_attention_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool = True
) -> torch.Tensor:
    """Dense attention with PBS's conventions, through ``scaled_dot_product_attention``.

    Queries are the last ``Nq`` of the ``Nk`` positions (bottom-right causal alignment), and GQA is
    handled by SDPA's ``enable_gqa`` (no copy of K/V). On CUDA cuDNN is tried first.

    Args:
        q: ``(B, Hq, Nq, D)``; k: ``(B, Hkv, Nk, D)``; v: ``(B, Hkv, Nk, Dv)``.

    Returns:
        ``(B, Hq, Nq, Dv)`` in ``q``'s dtype.
    """
    _, heads_q, nq, _ = q.shape
    _, heads_kv, nk, _ = k.shape
    mask = None
    if causal and nq != nk:
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(nq, nk)
    is_causal = causal and mask is None
    gqa = heads_q != heads_kv
    if q.is_cuda:
        previous = torch._C._get_sdp_priority_order()
        order = _cudnn_first(previous)
        if order is not None:
            torch._C._set_sdp_priority_order(order)
            try:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                                      enable_gqa=gqa)
            finally:
                torch._C._set_sdp_priority_order(previous)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa)


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool = True
) -> torch.Tensor:
    """The dense attention that PBS runs in place of sparse attention: `dense_attention_sdpa`,
    except for causal calls with fewer queries than keys (a chunk after a cached prefix) on a
    Hopper GPU, which run the Gluon kernel in dense mode.

    SDPA serves bottom-right causal alignment (torch's ``causal_lower_right``) with
    FlashAttention-2, or its memory-efficient kernel where flash cannot run, not cuDNN: about twice
    as long on an H200 (docs/serving.md, "What a chunk costs"). Both compute the same attention.

    Args:
        q: ``(B, Hq, Nq, D)``; k: ``(B, Hkv, Nk, D)``; v: ``(B, Hkv, Nk, Dv)``.

    Returns:
        ``(B, Hq, Nq, Dv)`` in ``q``'s dtype.
    """
    if causal and _chunk_after_prefix(q, k, v) and dense_kernel_available(q, v.shape[-1]):
        return dense_kernel_attention(q, k, v, scale=scale, causal=causal)
    return dense_attention_sdpa(q, k, v, scale=scale, causal=causal)


def _chunk_after_prefix(q: Any, k: Any, v: Any) -> bool:
    """Whether ``q``, ``k`` and ``v`` are well-formed 4-d tensors of one dtype and device with
    fewer queries than keys. `pbs.attention` launches dense attention before its input checks,
    and the Gluon kernel, unlike SDPA, does not check shapes."""
    if not all(isinstance(x, torch.Tensor) and x.dim() == 4 for x in (q, k, v)):
        return False
    (b, hq, nq, d), (bk, hk, nk, dk) = q.shape, k.shape
    return (nq < nk and b == bk and d == dk and hk > 0 and hq % hk == 0 and v.shape[:3] == k.shape[:3]
            and q.dtype == k.dtype == v.dtype and q.device == k.device == v.device)


# The dense-mode kernel's gate compares the probe's counters in integers (a float threshold
# rounded the same way on host and device is harder to guarantee than an integer product).
_GATE_UNIT = 1 << 20


def probe_gate_limit(max_density: float) -> int:
    """``max_density`` in units of 2**-20: the integer the dense-mode kernel's gate compares."""
    return round(max_density * _GATE_UNIT)


def probe_says_dense(kept: int, visible: int, max_density: float) -> bool:
    """The probe's verdict from its two counters: ``kept / visible > max_density``, computed as
    ``kept * 2**20 > probe_gate_limit(max_density) * visible`` in integers, exactly as the gated
    dense kernel computes it on the GPU (`pbs.kernels.hopper_attn.launch_hopper_dense`)."""
    return _above_gate(kept, visible, probe_gate_limit(max_density))


def _above_gate(kept: int, visible: int, gate_limit: int) -> bool:
    return kept * _GATE_UNIT > gate_limit * visible


def _planning_share_limit(pairs: Any, planning_pairs: int) -> Any:
    """``1 - planning_pairs / pairs`` in units of 2**-20, rounded down, for an int or an int64
    tensor of query-key pairs (the same integers on the host and on the device), computed as
    ``2**20 - ceil(planning_pairs * 2**20 / pairs)`` so that no product overflows int64."""
    scaled = -planning_pairs * _GATE_UNIT
    if isinstance(pairs, torch.Tensor):
        return _GATE_UNIT + scaled // pairs.clamp(min=1)
    return _GATE_UNIT + scaled // max(pairs, 1)


def _capturing(device: torch.device, rule: str) -> bool:
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        _log_once(f"pbs: dense_fallback.{rule} is not applied inside a CUDA graph capture (it needs a host sync)")
        return True
    return False


class Attended(NamedTuple):
    """What `DensePolicy.attend` ran.

    Attributes:
        out: ``(B, Hq, Nq, Dv)`` in ``q``'s dtype.
        plan: the plan that ran, or the plan made before dense attention ran instead (its
            ``fallback`` set), or None when dense attention ran before planning
            (`DensePolicy.dense_plan` makes the plan of what ran).
        reason: why dense attention ran, or None when PBS ran.
        lse: with ``return_lse``, the float32 ``(B, Hq, Nq)`` log-sum-exp of each query's scaled
            scores over the keys it attended to (all visible keys where dense attention ran).
        rule: the rule that decided dense (``"length"``, ``"planning_cost"``, ``"probe"``,
            ``"planned_density"``), or None when PBS ran.
    """

    out: torch.Tensor
    plan: Plan | None
    reason: str | None
    lse: torch.Tensor | None = None
    rule: str | None = None


Reduce = Callable[[torch.Tensor | float], float]


def _read(value: torch.Tensor | float) -> float:
    return float(value)


class DensePolicy:
    """``config.dense_fallback`` applied to calls: when dense attention runs instead of PBS, and why.

    The rules, in the order `attend` applies them (``backend="auto"`` on the policy's devices only):

    1. **length**: fewer than ``min_seq_len`` keys (shapes only: no planning, no sync);
    2. **planning cost**: at most ``planning_cost_pairs`` query-key pairs (``Nq x Nk``), where
       planning would cost about as much as dense attention (shapes only);
    3. **probe**: the density probe, before planning, estimates more than ``max_density``, or
       more than ``1 - planning_cost_pairs / (Nq x Nk)`` where that is lower (`probe_limit`);
    4. **planned density**: the plan selects more than ``max_planned_density`` of the blocks.

    Rules 2-4 apply only with ``max_density`` set. Rules 3 and 4 read one number on the host each,
    and are skipped (logged once) inside a CUDA graph capture. On a Hopper GPU with inputs the Gluon kernel takes, rule 3 queues the kernel in
    dense mode behind the probe, gated on the probe's counters on the GPU, so the GPU never waits
    for the host read (`probe`).

    Args:
        config: the call's config.
        reduce: turns a density measured on this process's heads (a float, or a 0-d tensor not
            yet read) into the number rules 3 and 4 compare. The default reads it; tensor
            parallelism averages it over the ranks (one all-reduce), so every rank decides as one
            process would. A policy with a ``reduce`` never uses the gated kernel, whose gate sees
            only this process's heads.
        scope: words appended to a density in the reasons (e.g. ``" over the 2 tensor-parallel
            ranks"``).
        return_lse: calls return the log-sum-exp too. Dense attention then runs as a full mask on
            a backend that returns it (SDPA does not), and the gated Gluon path is not used.
    """

    __slots__ = ("config", "fallback", "reduce", "scope", "return_lse")

    def __init__(self, config: PBSConfig, *, reduce: Reduce | None = None, scope: str = "", return_lse: bool = False):
        self.config = config
        self.fallback = config.dense_fallback
        self.reduce = reduce
        self.scope = scope
        self.return_lse = return_lse

    def dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Dense attention, ``(out, lse)``: `dense_attention` (``lse`` None), or with
        ``return_lse`` every allowed block on a backend that returns the log-sum-exp. Keys and
        values in a paged cache (`pbs.types.PagedTensor`) also take every allowed block, on a
        backend that reads the pages in place: SDPA would need them copied out."""
        if not self.return_lse and not is_paged(k):
            return dense_attention(q, k, v, scale=scale, causal=self.config.causal), None
        plan = full_plan(q, k, self.config, v.shape[-1], return_lse=self.return_lse)
        result = run_planned(plan, q, k, v, q.dtype, scale, return_lse=self.return_lse)
        return result if self.return_lse else (result, None)

    def applies(self, device: torch.device) -> bool:
        """Whether the policy may replace PBS on ``device`` (``backend="auto"`` on its devices)."""
        return self.config.backend == "auto" and device.type in self.fallback.devices

    @staticmethod
    def always_dense(config: PBSConfig, device: torch.device) -> PBSConfig:
        """``config`` with a policy that sends every call on ``device`` to dense attention (the
        length rule above any length, the density rules off): for a caller that has decided dense
        already with this policy (`too_short`) and runs a path that must still attend."""
        fallback = DenseFallback(min_seq_len=_ABOVE_ANY_LENGTH, devices=(device.type,), max_density=None,
                                 max_planned_density=None, probe_blocks=0)
        return config.model_copy(update={"backend": "auto", "dense_fallback": fallback})

    def too_short(self, len_k: int) -> bool:
        """Rule 1's comparison alone, on any device and backend: fewer than ``min_seq_len`` keys.
        The transformers integration asks it where SDPA is always at hand."""
        return len_k < self.fallback.min_seq_len

    def runs_dense_by_length(self, q: torch.Tensor, k: torch.Tensor) -> bool:
        """Rule 1, decided from shapes alone in few Python steps: it is the whole decision of every
        short call."""
        return k.shape[2] < self.fallback.min_seq_len and self.applies(q.device)

    def length_reason(self, q: torch.Tensor, k: torch.Tensor) -> str | None:
        """Why rule 1 sends the call to dense attention, or None."""
        if not self.runs_dense_by_length(q, k):
            return None
        return f"Nk = {k.shape[2]} is below dense_fallback.min_seq_len = {self.fallback.min_seq_len}"

    def runs_dense_by_planning_cost(self, len_q: int, len_k: int, device: torch.device) -> bool:
        """Rule 2 for a call (or a whole sequence) of ``len_q`` queries and ``len_k`` keys: at
        most ``planning_cost_pairs`` query-key pairs (shapes only)."""
        pairs = self.fallback.planning_cost_pairs
        return self.fallback.max_density is not None and 0 < len_q * len_k <= pairs and self.applies(device)

    def planning_cost_reason(self, len_q: int, len_k: int, device: torch.device) -> str | None:
        """Why rule 2 sends a call of ``len_q`` queries and ``len_k`` keys to dense attention, or None."""
        if not self.runs_dense_by_planning_cost(len_q, len_k, device):
            return None
        return (f"Nq x Nk = {len_q} x {len_k} is at most dense_fallback.planning_cost_pairs = "
                f"{self.fallback.planning_cost_pairs}: planning would cost about as much as dense attention")

    def shape_decision(self, q: torch.Tensor, k: torch.Tensor) -> tuple[str, str] | None:
        """``(rule, reason)`` of rules 1 and 2, decided from the shapes of ``q`` ``(B, Hq, Nq, D)``
        and ``k`` ``(B, Hkv, Nk, D)`` alone, or None."""
        reason = self.length_reason(q, k)
        if reason is not None:
            return "length", reason
        reason = self.planning_cost_reason(q.shape[2], k.shape[2], q.device)
        return None if reason is None else ("planning_cost", reason)

    def probe_limit(self, len_q: int, len_k: int) -> int:
        """Rule 3's limit for a call of ``len_q`` queries and ``len_k`` keys, in units of 2**-20
        (the integer the gated dense kernel compares): ``max_density``, or
        ``1 - planning_cost_pairs / (len_q * len_k)`` rounded down where that is lower (the blocks
        the plan would skip must save more than planning costs)."""
        limit = probe_gate_limit(self.fallback.max_density)
        pairs = self.fallback.planning_cost_pairs
        return min(limit, _planning_share_limit(len_q * len_k, pairs)) if pairs else limit

    def probe_runs(self, device: torch.device) -> bool:
        """Whether rule 2 runs on ``device``: ``max_density`` set, the policy applies, and no CUDA
        graph is being captured (the rule reads a number on the host)."""
        return self.fallback.max_density is not None and self.applies(device) and not _capturing(device, "max_density")

    def probe_reason(self, estimate: float, len_q: int, len_k: int) -> str | None:
        """Rule 3's verdict on an estimate read on the host (``reduce`` applied) for a call of
        ``len_q`` queries and ``len_k`` keys: the reason when it is above `probe_limit`, else None."""
        if self.fallback.max_density is None:
            return None
        limit = self.probe_limit(len_q, len_k)
        if not estimate * _GATE_UNIT > limit:
            return None
        return self._probe_text(estimate, len_q, len_k, limit)

    def _probe_text(self, estimate: float, len_q: int, len_k: int, limit: int) -> str:
        text = f"the density probe estimates {estimate:.3f}{self.scope}, above "
        if limit < probe_gate_limit(self.fallback.max_density):
            pairs = self.fallback.planning_cost_pairs
            return text + (f"1 - dense_fallback.planning_cost_pairs / (Nq x Nk) = 1 - {pairs} / ({len_q} x {len_k}) "
                           f"= {limit / _GATE_UNIT:.3f}")
        return text + f"dense_fallback.max_density = {self.fallback.max_density}"

    def probe_arguments(self, scale: float) -> dict[str, Any] | None:
        """The probe's keyword arguments, or None where it does not run (``probe_blocks == 0``, or
        a selector without a mass share: `pbs.SelectorConfig.mass_share`)."""
        share = self.config.selector.mass_share()
        if self.fallback.probe_blocks == 0 or share is None:
            return None
        return dict(block_size=self.config.block_size, num_blocks=self.fallback.probe_blocks, threshold=share,
                    scale=scale, causal=self.config.causal)

    def probe_estimate(self, q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor | float | None:
        """The probe's estimate on these heads (`pbs.reference.density_probe.probe_density`), or
        None where it does not run: a float from the Triton kernel on CUDA (it reads its two
        counters), else a 0-d tensor not yet read."""
        args = self.probe_arguments(scale)
        return None if args is None else probe_estimate(q, k, args)

    def probe(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor | None, str | None]:
        """Rule 3: ``(dense output, reason)`` when the probe finds the call too dense to plan, else
        ``(None, None)``. With ``return_lse`` the dense output is ``(out, lse)``.

        Args:
            q: ``(B, Hq, Nq, D)``; k: ``(B, Hkv, Nk, D)``; v: ``(B, Hkv, Nk, Dv)``.
        """
        if not self.probe_runs(q.device):
            return None, None
        args = self.probe_arguments(scale)
        if args is None:
            return None, None
        len_q, len_k = q.shape[2], k.shape[2]
        limit = self.probe_limit(len_q, len_k)
        if (self.reduce is None and not self.return_lse and args["threshold"] < 1.0
                and gated_dense_available(q, v.shape[-1], self.config.block_size, page_size_of(k))):
            out, (kept, visible) = probe_then_gated_dense(q, k, v, args, causal=self.config.causal,
                                                           gate_limit=limit)
            if not _above_gate(kept, visible, limit):
                return None, None
            return out, self._probe_text(kept / max(visible, 1), len_q, len_k, limit)
        reason = self.probe_reason((self.reduce or _read)(probe_estimate(q, k, args)), len_q, len_k)
        if reason is None:
            return None, None
        out, lse = self.dense(q, k, v, scale)
        return (out if lse is None else (out, lse)), reason

    def planned_density_reason(self, plan: Plan | tuple[Plan, ...]) -> str | None:
        """Rule 4: why dense attention should run although a plan exists, or None.

        ``plan`` may be several plans of one call's query chunks (context parallelism plans a
        rank's two chunks apart): their density is selected over allowed blocks of all of them.
        """
        plans = plan if isinstance(plan, tuple) else (plan,)
        limit = self.fallback.max_planned_density
        device = plans[0].mask.counts.device
        if (self.fallback.max_density is None or limit is None or not self.applies(device)
                or _capturing(device, "max_planned_density")):
            return None
        # One reduction and one read on the host (Plan.density would take several small ops).
        allowed = sum(p.layout.batch * p.layout.heads_q * p.layout.total_allowed_blocks for p in plans)
        selected = sum(p.mask.counts.sum(dtype=torch.float64) for p in plans) / allowed
        density = (self.reduce or _read)(selected)
        if density > limit:
            return f"density {density:.3f}{self.scope} is above dense_fallback.max_planned_density = {limit}"
        return None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> Attended:
        """PBS attention, or dense attention where a rule says so: checked inputs in, `Attended` out.

        Args:
            q: ``(B, Hq, Nq, D)``; k: ``(B, Hkv, Nk, D)``; v: ``(B, Hkv, Nk, Dv)``, on the current
                device; or, with ``B = 1``, ``k`` and ``v`` in a paged cache
                (`pbs.types.PagedTensor`, from `pbs.varlen_attention`), which every rule reads
                in place.
            scale: softmax scale.
        """
        decided = self.shape_decision(q, k)
        if decided is not None:
            out, lse = self.dense(q, k, v, scale)
            return Attended(out, None, decided[1], lse, decided[0])
        dense_out, reason = self.probe(q, k, v, scale)
        if dense_out is not None:
            out, lse = dense_out if isinstance(dense_out, tuple) else (dense_out, None)
            return Attended(out, None, reason, lse, "probe")
        plan, q_perm, k_perm, v_perm = build_plan(q, k, self.config, scale, v, return_lse=self.return_lse)
        reason = self.planned_density_reason(plan)
        if reason is not None:
            out, lse = self.dense(q, k, v, scale)
            return Attended(out, dataclasses.replace(plan, fallback=reason, dense_rule="planned_density"), reason, lse,
                            "planned_density")
        result = run_planned(plan, q_perm, k_perm, v_perm, q.dtype, scale, return_lse=self.return_lse)
        out, lse = result if self.return_lse else (result, None)
        return Attended(out, plan, None, lse)

    def dense_plan(self, q: torch.Tensor, k: torch.Tensor, head_dim_v: int, reason: str, rule: str) -> Plan:
        """The plan of a call the policy sent to dense attention: every causally allowed block,
        nothing permuted (density 1.0), with ``fallback = reason`` and ``dense_rule = rule``.

        Made only when a caller asks for the plan (``return_plan=True``): the dense call itself
        never builds it. `pbs.run` of it is dense attention on the block-sparse backend.

        Args:
            q: ``(B, Hq, Nq, D)``; k: ``(B, Hkv, Nk, D)`` (or a paged sequence).
        """
        plan = full_plan(q, k, self.config, head_dim_v, return_lse=self.return_lse)
        return dataclasses.replace(plan, fallback=reason, dense_rule=rule)

    def all_dense_by_shape(self, padded_len_q: int, padded_len_k: int, device: torch.device) -> bool:
        """Rules 1 and 2 for a padded batch whose every query and key length is at most
        ``padded_len_q`` and ``padded_len_k``: true when the padded lengths themselves send a
        sequence to dense attention (a host decision from shapes alone, the same in every
        CUDA-graph replay)."""
        return self.applies(device) and (self.too_short(padded_len_k)
                                         or self.runs_dense_by_planning_cost(padded_len_q, padded_len_k, device))

    def sequence_decisions(
        self, len_q: torch.Tensor, len_k: torch.Tensor, probe_counters: tuple[torch.Tensor, torch.Tensor] | None,
        selected_blocks: torch.Tensor | None = None, allowed_blocks: torch.Tensor | None = None,
        shapes_only: bool = False,
    ) -> torch.Tensor | None:
        """The four rules per sequence, on the device, with no host read (for CUDA graphs): ``(N,)``
        bool, or None where the policy does not apply (a named backend, a device outside
        ``dense_fallback.devices``). The integers compared are those of the eager call
        (`probe_limit`), so each sequence is decided as it would be alone.

        Args:
            len_q, len_k: ``(N,)`` int64 query and key lengths.
            probe_counters: ``(kept, visible)`` ``(N,)`` int64 counters of the density probe, or
                None where it does not run (`probe_arguments` is None).
            selected_blocks, allowed_blocks: ``(N,)`` selected and causally allowed blocks of
                each sequence, summed over its query heads (float64); None before planning (the
                decisions of the rules before it, which spare the planning of those sequences).
            shapes_only: the decisions of rules 1 and 2 alone (before the probe's inputs exist).
        """
        if not self.applies(len_k.device):
            return None
        fallback = self.fallback
        dense = len_k < fallback.min_seq_len
        if fallback.max_density is None:
            return dense
        planning_pairs = fallback.planning_cost_pairs
        pairs = len_q.to(torch.int64) * len_k.to(torch.int64)
        if planning_pairs:
            dense = dense | ((pairs > 0) & (pairs <= planning_pairs))
        if shapes_only:
            return dense
        if probe_counters is not None:
            kept, visible = probe_counters
            limit = probe_gate_limit(fallback.max_density)
            if planning_pairs:
                limit = torch.clamp(_planning_share_limit(pairs, planning_pairs), max=limit)
            dense = dense | (kept * _GATE_UNIT > limit * visible)
        if fallback.max_planned_density is not None and selected_blocks is not None:
            dense = dense | (selected_blocks > fallback.max_planned_density * allowed_blocks)
        return dense
