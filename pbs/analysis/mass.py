"""Exact block attention mass of permuted inputs, and oracle selection on it.

Every analysis asks the same question of a (layer, permuter) pair: once the permuter has
reordered the tokens, what share of each query block's true attention lands in each key block?
That dense pass is the expensive part, so `BlockMassCache` computes it once per pair and the
coverage curves and head statistics all read from it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from pbs.analysis.inputs import QKCapture, as_capture
from pbs.analysis.progress import ProgressBar
from pbs.components import PermuterConfig, permuter_registry
from pbs.config import PBSConfig
from pbs.layout import Layout
from pbs.planning import build_plan
from pbs.reference.block_sets import forced_blocks
from pbs.reference.block_mass import attention_coverage, block_attention_mass
from pbs.reference.threshold_select import select_by_cumulative_threshold

PermuterLike = str | dict[str, Any] | PermuterConfig


def permuter_label(permuter: PermuterLike) -> str:
    """A short name for plots and tables: the registry name, plus any non-default fields."""
    config = permuter_registry.parse(permuter)
    defaults = type(config)()
    changed = {k: v for k, v in config.model_dump().items() if k != "name" and getattr(defaults, k) != v}
    if not changed:
        return config.name
    return f"{config.name}(" + ", ".join(f"{k}={v}" for k, v in sorted(changed.items())) + ")"


def config_with(config: PBSConfig | dict[str, Any] | str | None, **components: Any) -> PBSConfig:
    """``config`` (or the defaults) with some fields replaced, validated again."""
    base = PBSConfig.coerce(config).model_dump()
    base.update({k: v for k, v in components.items() if v is not None})
    return PBSConfig.model_validate(base)


@dataclass(frozen=True, eq=False)
class PermutedMass:
    """The exact block mass of one layer under one permuter, with the blocks selection must keep.

    Attributes:
        permuter: label of the permuter (see `permuter_label`).
        layout: geometry of the call.
        mass: ``(B, Hq, Tq, Tk)`` float32, each query block's share of attention per key block in
            permuted order; rows sum to 1.
        allowed: ``(Tq, Tk)`` bool, blocks not wholly in the future.
        forced: ``(B, Hq, Tq, Tk)`` bool, blocks every selection keeps (sink, on-diagonal segment).
    """

    permuter: str
    layout: Layout
    mass: torch.Tensor
    allowed: torch.Tensor
    forced: torch.Tensor

    def oracle_selection(self, coverage_target: float) -> torch.Tensor:
        """Per query block, the fewest blocks whose exact mass reaches ``coverage_target``, plus the
        forced blocks: ``(B, Hq, Tq, Tk)`` bool. A target of 1 keeps every allowed block."""
        if not 0.0 < coverage_target <= 1.0:
            raise ValueError(f"coverage_target must be in (0, 1], got {coverage_target}")
        if coverage_target >= 1.0:
            # Rounding can make a cumulative sum reach 1 before the last blocks with tiny mass;
            # full coverage is only guaranteed by every allowed block.
            return self.allowed.expand(self.mass.shape).clone()
        selected = select_by_cumulative_threshold(self.mass, self.allowed, coverage_target)
        return (selected | self.forced) & self.allowed

    def density(self, selected: torch.Tensor) -> torch.Tensor:
        """Selected over allowed blocks per (batch, head): ``(B, Hq)`` float64."""
        return selected.sum((-1, -2), dtype=torch.int64).double() / self.layout.total_allowed_blocks

    def coverage(self, selected: torch.Tensor) -> torch.Tensor:
        """Share of the exact attention inside ``selected`` per (batch, head): ``(B, Hq)`` float64."""
        return attention_coverage(self.mass, selected, self.layout).double()


def permuted_block_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    permuter: PermuterLike = "identity",
    config: PBSConfig | dict[str, Any] | str | None = None,
    *,
    scale: float | None = None,
) -> PermutedMass:
    """Permutes ``q``/``k`` with ``permuter`` and computes the exact block mass.

    Args:
        q: ``(B, Hq, Nq, D)`` queries in original order.
        k: ``(B, Hkv, Nk, D)`` keys in original order.
        permuter: a permuter name, dict or config (overrides ``config.permuter``).
        config: block size, segment size, GQA mode, causality and sink forcing; defaults otherwise.
        scale: softmax scale, default ``D ** -0.5``.
    """
    cfg = config_with(config, permuter=permuter_registry.parse(permuter).model_dump())
    q, k = q.float(), k.float()
    s = q.shape[-1] ** -0.5 if scale is None else float(scale)
    plan, q_perm, _, _ = build_plan(q, k, cfg, s)
    k_perm = plan.key_permutation.apply(k)
    layout = plan.layout
    mass = block_attention_mass(q_perm, k_perm, plan.query_positions(), plan.key_positions(), layout, s)
    return PermutedMass(
        permuter=permuter_label(cfg.permuter),
        layout=layout,
        mass=mass,
        allowed=layout.allowed_blocks(mass.device),
        forced=forced_blocks(layout, plan.key_positions(), cfg.force_sink_block),
    )


class BlockMassCache:
    """Computes `PermutedMass` once per (layer, permuter) of a capture.

    Args:
        qk: a `QKCapture` or a ``(q, k)`` pair.
        config: geometry and GQA mode (see `permuted_block_mass`).
        scale: softmax scale, default ``D ** -0.5``.
    """

    def __init__(
        self,
        qk: QKCapture | tuple[torch.Tensor, torch.Tensor],
        config: PBSConfig | dict[str, Any] | str | None = None,
        *,
        scale: float | None = None,
    ):
        self.capture = as_capture(qk)
        self.config = PBSConfig.coerce(config)
        self.scale = scale
        self._entries: dict[tuple[int, str], PermutedMass] = {}

    def get(self, layer_index: int, permuter: PermuterLike) -> PermutedMass:
        """The mass of layer ``layer_index`` (position in the capture) under ``permuter``."""
        if not 0 <= layer_index < self.capture.num_layers:
            raise IndexError(f"layer_index must be in [0, {self.capture.num_layers}), got {layer_index}")
        key = (layer_index, permuter_registry.parse(permuter).model_dump_json())
        entry = self._entries.get(key)
        if entry is None:
            q, k = self.capture.queries[layer_index], self.capture.keys[layer_index]
            entry = permuted_block_mass(q, k, permuter, self.config, scale=self.scale)
            self._entries[key] = entry
        return entry

    def fill(self, permuters: Iterable[PermuterLike], progress: bool | ProgressBar = False) -> None:
        """Computes every (layer, permuter) pair up front, with an optional progress bar."""
        unique = {}
        for permuter in permuters:
            config = permuter_registry.parse(permuter)
            unique.setdefault(config.model_dump_json(), config)
        bar = progress if isinstance(progress, ProgressBar) else ProgressBar(
            self.capture.num_layers * len(unique), "block mass", enabled=bool(progress)
        )
        for index, layer_id in enumerate(self.capture.layer_ids):
            for config in unique.values():
                self.get(index, config)
                bar.advance(f"layer {layer_id} {permuter_label(config)}")
        if not isinstance(progress, ProgressBar):
            bar.close()
