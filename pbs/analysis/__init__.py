"""Analyses of what permutation does to block sparsity (the paper's Figure 1, Table 5, Figure 3).

* `coverage_density_curves`: attention coverage reached at each block density, per permuter,
  with oracle block selection on the exact attention mass.
* `head_statistics`: per head, the density needed for a coverage target with and without
  permutation; heads helped / unchanged / harmed.
* `attention_maps`: one head's block attention before and after permutation with a
  selector's blocks, for `plot_attention_maps`.
* `write_analysis`: all three, as PNG pictures plus JSON/CSV data (``pbs analyze``).

Inputs are a `QKCapture` (or a ``(q, k)`` pair): from `synthetic_capture`, from a
file (`load_capture`) or from a transformers model (`capture_qk`). Pictures need
matplotlib: ``pip install "pbs-attn[analysis]"``.
"""

from pbs.analysis.coverage import (
    DEFAULT_COVERAGE_TARGETS,
    DEFAULT_PERMUTERS,
    CoverageCurve,
    CoverageCurves,
    HeadId,
    coverage_density_curves,
)
from pbs.analysis.heads import HeadStat, HeadStatistics, head_statistics
from pbs.analysis.hf_capture import capture_qk, capture_qk_from_pretrained
from pbs.analysis.inputs import QKCapture, as_capture, load_capture, save_capture, synthetic_capture
from pbs.analysis.maps import AttentionMapPanel, AttentionMaps, attention_maps
from pbs.analysis.mass import BlockMassCache, PermutedMass, permuted_block_mass
from pbs.analysis.plotting import plot_attention_maps, plot_coverage_density, plot_head_statistics
from pbs.analysis.progress import ProgressBar
from pbs.analysis.report import AnalysisReport, write_analysis

__all__ = [
    "DEFAULT_COVERAGE_TARGETS",
    "DEFAULT_PERMUTERS",
    "AnalysisReport",
    "AttentionMapPanel",
    "AttentionMaps",
    "BlockMassCache",
    "CoverageCurve",
    "CoverageCurves",
    "HeadId",
    "HeadStat",
    "HeadStatistics",
    "PermutedMass",
    "ProgressBar",
    "QKCapture",
    "as_capture",
    "attention_maps",
    "capture_qk",
    "capture_qk_from_pretrained",
    "coverage_density_curves",
    "head_statistics",
    "load_capture",
    "permuted_block_mass",
    "plot_attention_maps",
    "plot_coverage_density",
    "plot_head_statistics",
    "save_capture",
    "synthetic_capture",
    "write_analysis",
]
