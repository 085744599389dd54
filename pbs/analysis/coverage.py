"""Coverage-density curves (the paper's Figure 1): how much attention each permuter lets a given
block density capture.

For every permuter the exact block mass is computed once; then, for a sweep of coverage targets,
the oracle keeps per query block the fewest key blocks that reach the target (plus the forced
sink and on-diagonal blocks), and the resulting (density, coverage) pair of every head is recorded.
A permuter whose curve lies higher and further left captures the same attention with fewer blocks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pbs.analysis.inputs import QKCapture, as_capture
from pbs.analysis.mass import BlockMassCache, PermuterLike, permuter_label
from pbs.analysis.result_files import write_csv, write_json
from pbs.config import PBSConfig

DEFAULT_PERMUTERS: tuple[str, ...] = ("identity", "random", "greedy", "random_query", "avg_query", "last_block")

# Dense near full coverage, where the curves separate (the long tail of Figure 1).
DEFAULT_COVERAGE_TARGETS: tuple[float, ...] = (
    0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.875, 0.9, 0.925, 0.95,
    0.96, 0.97, 0.975, 0.98, 0.985, 0.99, 0.995, 0.999, 1.0,
)


@dataclass(frozen=True)
class HeadId:
    """Which head a row describes: the model's layer id, the batch index and the query head."""

    layer: int
    batch: int
    head: int

    def __str__(self) -> str:
        return f"L{self.layer}.b{self.batch}.h{self.head}"


@dataclass(frozen=True, eq=False)
class CoverageCurve:
    """The coverage-density points of one permuter.

    Attributes:
        permuter: the permuter's label.
        targets: ``(T,)`` coverage targets of the oracle, ascending; the last is 1 (every allowed block).
        heads: one `HeadId` per row of ``density`` and ``coverage``.
        density: ``(num_heads, T)`` float64, selected over allowed blocks per head and target.
        coverage: ``(num_heads, T)`` float64, attention share captured per head and target.
        forced_density: ``(num_heads,)`` float64, density of the forced blocks alone (sink and
            on-diagonal segment): no selection is sparser. ``None``: the curve's first point.
        forced_coverage: ``(num_heads,)`` float64, the attention share those blocks capture.
    """

    permuter: str
    targets: tuple[float, ...]
    heads: tuple[HeadId, ...]
    density: torch.Tensor
    coverage: torch.Tensor
    forced_density: torch.Tensor | None = None
    forced_coverage: torch.Tensor | None = None

    @property
    def mean_density(self) -> torch.Tensor:
        """``(T,)`` density averaged over heads, per target."""
        return self.density.mean(0)

    @property
    def mean_coverage(self) -> torch.Tensor:
        """``(T,)`` coverage averaged over heads, per target."""
        return self.coverage.mean(0)

    @property
    def min_density(self) -> float:
        """Head-mean density of the forced blocks alone: the sparsest any selection can be."""
        if self.forced_density is None:
            return float(self.mean_density[0])
        return float(self.forced_density.mean())

    def reachable(self, density: float) -> bool:
        """Whether a selection can be as sparse as ``density`` (not below `min_density`)."""
        return density >= self.min_density - 1e-12

    def coverage_at(self, density: float) -> float | None:
        """Head-mean coverage at a block density, linearly interpolated along the mean curve.

        No selection is sparser than the forced blocks (sink and on-diagonal segment), so the curve
        starts at their density and coverage; below it the density is unreachable and the result
        is ``None`` (see `reachable`). Above the last point (density 1) it is the last
        point's coverage.
        """
        if not self.reachable(density):
            return None
        x, y = self._points()
        return _interpolate(x, y, density)

    def density_at(self, coverage: float) -> float:
        """Head-mean density needed for a coverage, linearly interpolated along the mean curve (the
        forced blocks' density where they alone reach it)."""
        x, y = self._points()
        return _interpolate(y, x, coverage)

    def _points(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The head-mean curve, starting at the forced blocks' point when it is known."""
        x, y = self.mean_density, self.mean_coverage
        if self.forced_density is not None and self.forced_coverage is not None:
            start = torch.stack([self.forced_density.mean(), self.forced_coverage.mean()]).to(x.dtype)
            x, y = torch.cat([start[:1], x]), torch.cat([start[1:], y])
        return x, y

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: targets, the head-mean curve, the forced blocks' point and every head's curve."""
        forced = None
        if self.forced_density is not None and self.forced_coverage is not None:
            forced = {"density": float(self.forced_density.mean()), "coverage": float(self.forced_coverage.mean())}
        return {
            "permuter": self.permuter,
            "targets": list(self.targets),
            "mean": {"density": self.mean_density.tolist(), "coverage": self.mean_coverage.tolist()},
            "forced": forced,
            "heads": [
                {"layer": h.layer, "batch": h.batch, "head": h.head, "density": d.tolist(), "coverage": c.tolist()}
                for h, d, c in zip(self.heads, self.density, self.coverage)
            ],
        }


@dataclass(frozen=True, eq=False)
class CoverageCurves:
    """Coverage-density curves of several permuters on the same inputs.

    Attributes:
        curves: one `CoverageCurve` per permuter, in the order asked for.
        source: where the queries and keys came from.
        config: geometry used (block size, segment size, GQA mode).
    """

    curves: tuple[CoverageCurve, ...]
    source: str
    config: PBSConfig

    def __getitem__(self, permuter: str) -> CoverageCurve:
        for curve in self.curves:
            if curve.permuter == permuter:
                return curve
        raise KeyError(f"no curve for permuter {permuter!r}; have {[c.permuter for c in self.curves]}")

    def __iter__(self):
        return iter(self.curves)

    @property
    def permuters(self) -> list[str]:
        return [c.permuter for c in self.curves]

    def to_dict(self, summary_densities: Sequence[float] = (0.3, 0.5)) -> dict[str, Any]:
        """JSON-ready: meta, every curve, and the `summary` cells (``coverage`` null and
        ``unreachable`` true where the forced blocks alone are denser than the cell's density)."""
        return {
            "meta": {
                "analysis": "coverage_density",
                "source": self.source,
                "block_size": self.config.block_size,
                "segment_size": self.config.segment_size,
                "gqa": self.config.gqa,
                "selection": "oracle: per query block the fewest blocks whose exact mass reaches the target, plus forced blocks",
            },
            "curves": [c.to_dict() for c in self.curves],
            "summary": [
                {
                    "permuter": c.permuter,
                    "min_density": c.min_density,
                    "cells": [
                        {"density": d, "coverage": c.coverage_at(d), "unreachable": not c.reachable(d)}
                        for d in summary_densities
                    ],
                    "density_at_0.95": c.density_at(0.95),
                }
                for c in self.curves
            ],
        }

    def write_json(self, path: str | Path) -> Path:
        return write_json(self.to_dict(), path)

    def write_csv(self, path: str | Path) -> Path:
        """Long format: one row per (permuter, scope, target); scope ``mean`` or a head id."""
        return write_csv(["permuter", "scope", "layer", "batch", "head", "target", "density", "coverage"],
                         self._csv_rows(), path)

    def _csv_rows(self) -> Iterator[list[Any]]:
        for curve in self.curves:
            for t, d, c in zip(curve.targets, curve.mean_density.tolist(), curve.mean_coverage.tolist()):
                yield [curve.permuter, "mean", "", "", "", f"{t:g}", f"{d:.6f}", f"{c:.6f}"]
            for head, dens, cov in zip(curve.heads, curve.density.tolist(), curve.coverage.tolist()):
                for t, d, c in zip(curve.targets, dens, cov):
                    yield [curve.permuter, "head", head.layer, head.batch, head.head, f"{t:g}", f"{d:.6f}", f"{c:.6f}"]

    def summary(self, densities: Sequence[float] = (0.3, 0.5)) -> str:
        """A small table: head-mean coverage of every permuter at a few densities.

        A density below what the forced blocks alone reach cannot be selected: its cell reads
        ``n/a (forced ≥ X)`` with ``X`` the forced blocks' density, not a clamped coverage.
        """
        cells = [
            [
                f"{value:.3f}" if (value := curve.coverage_at(d)) is not None else f"n/a (forced ≥ {curve.min_density:.3f})"
                for d in densities
            ]
            for curve in self.curves
        ]
        widths = [max([9, *(len(row[i]) for row in cells)]) for i in range(len(densities))]
        header = f"{'permuter':24s}" + "".join(f" {f'cov@{d:g}':<{w}s}" for d, w in zip(densities, widths))
        lines = [header + "  density@0.95"]
        for curve, row in zip(self.curves, cells):
            line = "".join(f" {cell:>{w}s}" for cell, w in zip(row, widths))
            lines.append(f"{curve.permuter:24s}{line}  {curve.density_at(0.95):12.3f}")
        return "\n".join(lines)


def coverage_density_curves(
    qk: QKCapture | tuple[torch.Tensor, torch.Tensor],
    permuters: Sequence[PermuterLike] = DEFAULT_PERMUTERS,
    coverage_targets: Sequence[float] = DEFAULT_COVERAGE_TARGETS,
    config: PBSConfig | dict[str, Any] | str | None = None,
    *,
    cache: BlockMassCache | None = None,
    progress: bool = False,
) -> CoverageCurves:
    """Coverage reached at each block density, per permuter, with oracle block selection.

    Args:
        qk: a `QKCapture` or a ``(q, k)`` pair with ``q (B, Hq, Nq, D)`` and
            ``k (B, Hkv, Nk, D)``; every layer's heads are pooled.
        permuters: names, dicts or configs of the permuters to compare.
        coverage_targets: oracle targets in ``(0, 1]``; 1 (every allowed block) is always added.
        config: block size, segment size and GQA mode (the permuter field is ignored).
        cache: reuse block masses already computed (by another analysis) for the same capture.
        progress: show a progress bar on stderr.

    Returns:
        `CoverageCurves`; ``curves[name].coverage_at(0.3)`` reads the head-mean curve.

    Example:
        ```python
        import pbs
        from pbs.analysis import coverage_density_curves

        q, k, _ = pbs.testing.make_qkv(seq_len=1024, heads_q=2, heads_kv=1, head_dim=32)
        curves = coverage_density_curves((q, k), permuters=["identity", "last_block"])
        assert round(curves["identity"].mean_coverage[-1].item(), 4) == 1.0
        ```
    """
    targets = _check_targets(coverage_targets)
    if not permuters:
        raise ValueError("permuters must name at least one permuter")
    cache = cache if cache is not None else BlockMassCache(as_capture(qk), config)
    capture = cache.capture
    cache.fill(permuters, progress=progress)
    curves = []
    for permuter in permuters:
        densities, coverages, heads, forced_density, forced_coverage = [], [], [], [], []
        for index, layer_id in enumerate(capture.layer_ids):
            entry = cache.get(index, permuter)
            per_target = [entry.oracle_selection(t) for t in targets]
            densities.append(torch.stack([entry.density(s) for s in per_target], -1).flatten(0, 1))
            coverages.append(torch.stack([entry.coverage(s) for s in per_target], -1).flatten(0, 1))
            forced = entry.forced & entry.allowed
            forced_density.append(entry.density(forced).flatten())
            forced_coverage.append(entry.coverage(forced).flatten())
            b, h = entry.mass.shape[:2]
            heads.extend(HeadId(layer_id, bi, hi) for bi in range(b) for hi in range(h))
        curves.append(
            CoverageCurve(
                permuter=permuter_label(permuter),
                targets=targets,
                heads=tuple(heads),
                density=torch.cat(densities).cpu(),
                coverage=torch.cat(coverages).cpu(),
                forced_density=torch.cat(forced_density).cpu(),
                forced_coverage=torch.cat(forced_coverage).cpu(),
            )
        )
    return CoverageCurves(curves=tuple(curves), source=capture.source, config=cache.config)


def _check_targets(coverage_targets: Sequence[float]) -> tuple[float, ...]:
    values = [float(t) for t in coverage_targets]
    bad = [t for t in values if not 0.0 < t <= 1.0]
    if bad:
        raise ValueError(f"coverage_targets must lie in (0, 1], got {bad}")
    return tuple(sorted(set(values) | {1.0}))


def _interpolate(x: torch.Tensor, y: torch.Tensor, at: float) -> float:
    xs, ys = x.tolist(), y.tolist()
    if at <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if at <= x1:
            return y1 if x1 == x0 else y0 + (y1 - y0) * (at - x0) / (x1 - x0)
    return ys[-1]
