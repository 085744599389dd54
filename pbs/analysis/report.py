"""All three analyses in one call, written to a folder: what ``pbs analyze`` runs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pbs.analysis.coverage import DEFAULT_COVERAGE_TARGETS, DEFAULT_PERMUTERS, CoverageCurves, coverage_density_curves
from pbs.analysis.heads import HeadStatistics, head_statistics
from pbs.analysis.inputs import QKCapture, as_capture
from pbs.analysis.maps import AttentionMaps, SelectorLike, attention_maps
from pbs.analysis.mass import BlockMassCache, PermuterLike
from pbs.analysis.plotting import plot_attention_maps, plot_coverage_density, plot_head_statistics, require_matplotlib
from pbs.analysis.progress import ProgressBar
from pbs.components import permuter_registry
from pbs.config import PBSConfig


@dataclass(frozen=True, eq=False)
class AnalysisReport:
    """The results of `write_analysis` and the files it wrote.

    Attributes:
        curves: coverage-density curves of every permuter.
        head_stats: per-head sparsity gains.
        maps: the chosen head's attention maps before and after permutation.
        files: what was written, by role (``"coverage_density.png"``, ...), in writing order.
    """

    curves: CoverageCurves
    head_stats: HeadStatistics
    maps: AttentionMaps
    files: dict[str, Path]


def write_analysis(
    qk: QKCapture | tuple[torch.Tensor, torch.Tensor],
    out_dir: str | Path = "pbs-analysis",
    *,
    permuters: Sequence[PermuterLike] = DEFAULT_PERMUTERS,
    coverage_targets: Sequence[float] = DEFAULT_COVERAGE_TARGETS,
    coverage_target: float = 0.975,
    baseline: PermuterLike = "identity",
    permuter: PermuterLike = "last_block",
    tolerance: float = 0.01,
    head: int = 0,
    layer: int | None = None,
    selector: SelectorLike = "mean_pool",
    config: PBSConfig | dict[str, Any] | str | None = None,
    progress: bool = False,
) -> AnalysisReport:
    """Runs the coverage-density curves, the head statistics and the attention maps, and writes
    each one's PNG plus its data (JSON, and CSV for the tables) into ``out_dir``.

    Args:
        qk: a `QKCapture` or a ``(q, k)`` pair.
        out_dir: folder to write into (created if needed).
        permuters: permuters of the coverage-density curves.
        coverage_targets: oracle targets swept for the curves.
        coverage_target: coverage at which head densities are compared (paper: 0.975).
        baseline: order the head statistics and maps compare against (``identity``).
        permuter: the permutation under test (``last_block``).
        tolerance: ``|gain| <= tolerance`` counts as unchanged.
        head: query head of the attention maps.
        layer: layer id of the attention maps (default the first captured layer).
        selector: selector whose blocks the maps overlay (default ``mean_pool``, threshold 0.9).
        config: block size, segment size and GQA mode.
        progress: show a progress bar on stderr.

    Files written: ``coverage_density.{png,json,csv}``, ``head_stats.{png,json,csv}``,
    ``attention_map.{png,json}``.
    """
    require_matplotlib()  # fail before the slow part, not after it
    capture = as_capture(qk)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cache = BlockMassCache(capture, config)
    mass_permuters = [*permuters, baseline, permuter]
    unique = len({_key(p) for p in mass_permuters})
    bar = ProgressBar(capture.num_layers * unique + 2, "pbs analyze", enabled=progress)
    cache.fill(mass_permuters, progress=bar)

    curves = coverage_density_curves(capture, permuters, coverage_targets, cache=cache)
    stats = head_statistics(
        capture, coverage_target, permuter=permuter, baseline=baseline, tolerance=tolerance, cache=cache
    )
    maps = attention_maps(
        capture, head, layer=layer, permuters=(baseline, permuter), selector=selector, config=cache.config
    )
    bar.advance("attention maps")

    files: dict[str, Path] = {}
    files["coverage_density.png"] = plot_coverage_density(curves, out / "coverage_density.png", reference_coverage=coverage_target)
    files["coverage_density.json"] = curves.write_json(out / "coverage_density.json")
    files["coverage_density.csv"] = curves.write_csv(out / "coverage_density.csv")
    files["head_stats.png"] = plot_head_statistics(stats, out / "head_stats.png")
    files["head_stats.json"] = stats.write_json(out / "head_stats.json")
    files["head_stats.csv"] = stats.write_csv(out / "head_stats.csv")
    files["attention_map.png"] = plot_attention_maps(maps, out / "attention_map.png")
    files["attention_map.json"] = maps.write_json(out / "attention_map.json")
    bar.advance("pictures and data")
    bar.close()
    return AnalysisReport(curves=curves, head_stats=stats, maps=maps, files=files)


def _key(permuter: PermuterLike) -> str:
    return permuter_registry.parse(permuter).model_dump_json()
