"""Block-level attention maps of one head before and after permutation (the paper's Figure 3).

Each panel holds the exact block mass of the head in that panel's token order, the blocks a real
selector (default ``mean_pool`` at 0.9) picks in that order, and the share of attention and of
blocks that selection amounts to. Side by side, the panels show permutation gathering scattered
heavy-hitter columns into the leading blocks of each segment.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pbs.analysis.inputs import QKCapture, as_capture
from pbs.analysis.mass import PermuterLike, config_with, permuter_label
from pbs.components import SelectorConfig, permuter_registry, selector_registry
from pbs.config import PBSConfig
from pbs.planning import build_plan
from pbs.reference.block_mass import attention_coverage, block_attention_mass

SelectorLike = str | dict[str, Any] | SelectorConfig


@dataclass(frozen=True, eq=False)
class AttentionMapPanel:
    """One head's block attention in one token order.

    Attributes:
        permuter: label of the permuter that set the order.
        mass: ``(Tq, Tk)`` float32 exact block mass in that order; rows sum to 1 (on the CPU, as
            are the masks: panels are for drawing).
        allowed: ``(Tq, Tk)`` bool, blocks not wholly in the future.
        selected: ``(Tq, Tk)`` bool, blocks the selector keeps (forced blocks included).
        coverage: share of the head's attention inside ``selected``.
        density: selected over allowed blocks.
    """

    permuter: str
    mass: torch.Tensor
    allowed: torch.Tensor
    selected: torch.Tensor
    coverage: float
    density: float


@dataclass(frozen=True, eq=False)
class AttentionMaps:
    """Panels of one head, one per permuter.

    Attributes:
        layer, batch, head: which head (``layer`` is the model's layer id).
        selector: label of the selector whose choice is overlaid.
        block_size: tokens per block.
        panels: one `AttentionMapPanel` per permuter.
        source: where the queries and keys came from.
    """

    layer: int
    batch: int
    head: int
    selector: str
    block_size: int
    panels: tuple[AttentionMapPanel, ...]
    source: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready numbers of every panel (not the maps themselves)."""
        return {
            "meta": {
                "analysis": "attention_map",
                "source": self.source,
                "layer": self.layer,
                "batch": self.batch,
                "head": self.head,
                "selector": self.selector,
                "block_size": self.block_size,
            },
            "panels": [
                {
                    "permuter": p.permuter,
                    "coverage": p.coverage,
                    "density": p.density,
                    "selected_blocks": int(p.selected.sum()),
                    "allowed_blocks": int(p.allowed.sum()),
                }
                for p in self.panels
            ],
        }

    def write_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path


def selector_label(selector: SelectorLike) -> str:
    """``name(field=value, ...)`` of a selector config, e.g. ``mean_pool(threshold=0.9)``."""
    config = selector_registry.parse(selector)
    fields = {k: v for k, v in config.model_dump().items() if k != "name"}
    return f"{config.name}(" + ", ".join(f"{k}={v}" for k, v in sorted(fields.items())) + ")"


def attention_maps(
    qk: QKCapture | tuple[torch.Tensor, torch.Tensor],
    head: int = 0,
    *,
    layer: int | None = None,
    batch: int = 0,
    permuters: Sequence[PermuterLike] = ("identity", "last_block"),
    selector: SelectorLike = "mean_pool",
    config: PBSConfig | dict[str, Any] | str | None = None,
    scale: float | None = None,
) -> AttentionMaps:
    """Block attention of one query head in each permuter's order, with the selected blocks.

    Args:
        qk: a `QKCapture` or a ``(q, k)`` pair (``q (B, Hq, Nq, D)``,
            ``k (B, Hkv, Nk, D)``).
        head: query head index in ``[0, Hq)``.
        layer: the model's layer id (one of ``capture.layer_ids``); default the first layer.
        batch: batch index.
        permuters: one panel per permuter, e.g. ``("identity", "last_block")`` for before/after.
        selector: the selector whose blocks are overlaid (name, dict or config; default
            ``mean_pool`` with threshold 0.9).
        config: block size, segment size and GQA mode.
        scale: softmax scale, default ``D ** -0.5``.

    Returns:
        `AttentionMaps`.
    """
    capture = as_capture(qk)
    layer_id = capture.layer_ids[0] if layer is None else layer
    index = capture.layer_index(layer_id)
    q, k = capture.queries[index].float(), capture.keys[index].float()
    b, hq = q.shape[:2]
    if not 0 <= head < hq:
        raise ValueError(f"head must be in [0, {hq}) (query heads of layer {layer_id}), got {head}")
    if not 0 <= batch < b:
        raise ValueError(f"batch must be in [0, {b}), got {batch}")
    if not permuters:
        raise ValueError("permuters must name at least one permuter")
    selector_config = selector_registry.parse(selector)
    s = q.shape[-1] ** -0.5 if scale is None else float(scale)
    panels = []
    cfg = PBSConfig.coerce(config)
    for permuter in permuters:
        cfg = config_with(
            config,
            permuter=permuter_registry.parse(permuter).model_dump(),
            selector=selector_config.model_dump(),
        )
        plan, q_perm, _, _ = build_plan(q, k, cfg, s)
        k_perm = plan.key_permutation.apply(k)
        layout = plan.layout
        key_head = head * k_perm.shape[1] // hq  # per-head keys: the head itself; shared: its group
        one = slice(batch, batch + 1)
        mass = block_attention_mass(
            q_perm[one, head : head + 1],
            k_perm[one, key_head : key_head + 1],
            plan.query_positions()[one, head : head + 1],
            plan.key_positions()[one, key_head : key_head + 1],
            layout,
            s,
        )
        selected = plan.mask.to_dense()[batch, head]
        coverage = float(attention_coverage(mass, selected[None, None], layout)[0, 0])
        panels.append(
            AttentionMapPanel(
                permuter=permuter_label(permuter),
                mass=mass[0, 0].cpu(),
                allowed=layout.allowed_blocks(),
                selected=selected.cpu(),
                coverage=coverage,
                density=float(plan.mask.density_per_head()[batch, head]),
            )
        )
    return AttentionMaps(
        layer=layer_id,
        batch=batch,
        head=head,
        selector=selector_label(selector_config),
        block_size=cfg.block_size,
        panels=tuple(panels),
        source=capture.source,
    )

