"""Head-level sparsity gain of a permutation (the paper's Appendix C, Table 5).

For every (layer, batch, head): the block density the oracle needs to reach a coverage target
without permutation (the baseline) and with it, and the absolute sparsity gain
``Delta_s = density_baseline - density_permuted``. A head is *helped* when ``Delta_s > tolerance``,
*harmed* when ``Delta_s < -tolerance`` and *unchanged* otherwise (the paper: 97.5% coverage, a
tolerance of one percentage point).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from pbs.analysis.coverage import HeadId
from pbs.analysis.inputs import QKCapture, as_capture
from pbs.analysis.mass import BlockMassCache, PermuterLike, permuter_label
from pbs.analysis.result_files import write_csv, write_json
from pbs.config import PBSConfig

Category = Literal["helped", "unchanged", "harmed"]
CATEGORIES: tuple[Category, ...] = ("helped", "unchanged", "harmed")


@dataclass(frozen=True)
class HeadStat:
    """One head's densities at the coverage target, with and without permutation.

    Attributes:
        layer, batch, head: which head.
        density_baseline: oracle density reaching the target in the baseline order.
        density_permuted: the same after permutation.
        coverage_baseline, coverage_permuted: coverage actually reached (at least the target).
        gain: ``density_baseline - density_permuted`` (positive: permutation made the head sparser).
        category: ``"helped"``, ``"unchanged"`` or ``"harmed"``.
    """

    layer: int
    batch: int
    head: int
    density_baseline: float
    density_permuted: float
    coverage_baseline: float
    coverage_permuted: float
    gain: float
    category: Category

    @property
    def head_id(self) -> HeadId:
        return HeadId(self.layer, self.batch, self.head)


@dataclass(frozen=True, eq=False)
class HeadStatistics:
    """Per-head sparsity gains and their helped / unchanged / harmed counts.

    Attributes:
        heads: one `HeadStat` per (layer, batch, head).
        coverage_target: the coverage every density is measured at.
        baseline: label of the baseline permuter (normally ``identity``).
        permuter: label of the permuter under test.
        tolerance: ``|gain| <= tolerance`` counts as unchanged.
        source: where the queries and keys came from.
    """

    heads: tuple[HeadStat, ...]
    coverage_target: float
    baseline: str
    permuter: str
    tolerance: float
    source: str

    @property
    def counts(self) -> dict[Category, int]:
        """Number of heads per category; the values add up to ``len(heads)``."""
        return {c: sum(1 for h in self.heads if h.category == c) for c in CATEGORIES}

    @property
    def mean_gain(self) -> float:
        return sum(h.gain for h in self.heads) / len(self.heads)

    @property
    def mean_density_baseline(self) -> float:
        return sum(h.density_baseline for h in self.heads) / len(self.heads)

    @property
    def mean_density_permuted(self) -> float:
        return sum(h.density_permuted for h in self.heads) / len(self.heads)

    def summary(self) -> str:
        """A Table 5 style summary: counts and fractions per category, and the mean densities."""
        n = len(self.heads)
        tol = f"{self.tolerance:g}"
        criteria = {"helped": f"gain > {tol}", "unchanged": f"|gain| <= {tol}", "harmed": f"gain < -{tol}"}
        lines = [
            f"head statistics: {self.permuter} vs {self.baseline} at coverage {self.coverage_target:g}, {n} heads",
            f"  {'category':10s} {'criterion':16s} {'count':>5s} {'fraction':>9s}",
        ]
        for category, count in self.counts.items():
            lines.append(f"  {category:10s} {criteria[category]:16s} {count:5d} {100 * count / n:8.1f}%")
        lines.append(
            f"  mean density {self.baseline} {self.mean_density_baseline:.3f}, {self.permuter} "
            f"{self.mean_density_permuted:.3f}, mean gain {self.mean_gain:+.3f}"
        )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "meta": {
                "analysis": "head_statistics",
                "source": self.source,
                "coverage_target": self.coverage_target,
                "baseline": self.baseline,
                "permuter": self.permuter,
                "tolerance": self.tolerance,
            },
            "counts": self.counts,
            "mean": {
                "density_baseline": self.mean_density_baseline,
                "density_permuted": self.mean_density_permuted,
                "gain": self.mean_gain,
            },
            "heads": [asdict(h) for h in self.heads],
        }

    def write_json(self, path: str | Path) -> Path:
        return write_json(self.to_dict(), path)

    def write_csv(self, path: str | Path) -> Path:
        """One row per head, the columns `HeadStat`'s fields."""
        rows = ([f"{v:.6f}" if isinstance(v, float) else v for v in asdict(h).values()] for h in self.heads)
        return write_csv(list(HeadStat.__dataclass_fields__), rows, path)


def head_statistics(
    qk: QKCapture | tuple[torch.Tensor, torch.Tensor],
    coverage_target: float = 0.975,
    permuter: PermuterLike = "last_block",
    baseline: PermuterLike = "identity",
    tolerance: float = 0.01,
    config: PBSConfig | dict[str, Any] | str | None = None,
    *,
    cache: BlockMassCache | None = None,
    progress: bool = False,
) -> HeadStatistics:
    """Density each head needs for ``coverage_target`` with and without permutation.

    Args:
        qk: a `QKCapture` or a ``(q, k)`` pair (``q (B, Hq, Nq, D)``,
            ``k (B, Hkv, Nk, D)``).
        coverage_target: in ``(0, 1]``; the paper uses 0.975.
        permuter: the permutation under test (paper default ``last_block``).
        baseline: the order it is compared with (``identity``: no permutation).
        tolerance: ``|gain| <= tolerance`` counts as unchanged (the paper: 0.01).
        config: block size, segment size and GQA mode.
        cache: reuse block masses already computed for the same capture.
        progress: show a progress bar on stderr.

    Returns:
        `HeadStatistics` with one row per (layer, batch, query head).

    Example:
        >>> import pbs
        >>> from pbs.analysis import head_statistics
        >>> q, k, _ = pbs.testing.make_qkv(seq_len=1024, heads_q=2, heads_kv=1, head_dim=32)
        >>> stats = head_statistics((q, k))
        >>> sum(stats.counts.values())
        2
    """
    if not 0.0 < coverage_target <= 1.0:
        raise ValueError(f"coverage_target must be in (0, 1], got {coverage_target}")
    if not tolerance >= 0.0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    cache = cache if cache is not None else BlockMassCache(as_capture(qk), config)
    capture = cache.capture
    cache.fill([baseline, permuter], progress=progress)
    rows = []
    for index, layer_id in enumerate(capture.layer_ids):
        measured = []
        for which in (baseline, permuter):
            entry = cache.get(index, which)
            selected = entry.oracle_selection(coverage_target)
            measured.append((entry.density(selected), entry.coverage(selected)))
        (d_base, c_base), (d_perm, c_perm) = measured
        gain = d_base - d_perm
        b, h = gain.shape
        for bi in range(b):
            for hi in range(h):
                g = float(gain[bi, hi])
                rows.append(
                    HeadStat(
                        layer=layer_id,
                        batch=bi,
                        head=hi,
                        density_baseline=float(d_base[bi, hi]),
                        density_permuted=float(d_perm[bi, hi]),
                        coverage_baseline=float(c_base[bi, hi]),
                        coverage_permuted=float(c_perm[bi, hi]),
                        gain=g,
                        category=_categorise(g, tolerance),
                    )
                )
    return HeadStatistics(
        heads=tuple(rows),
        coverage_target=float(coverage_target),
        baseline=permuter_label(baseline),
        permuter=permuter_label(permuter),
        tolerance=float(tolerance),
        source=capture.source,
    )


def _categorise(gain: float, tolerance: float) -> Category:
    if gain > tolerance:
        return "helped"
    if gain < -tolerance:
        return "harmed"
    return "unchanged"
