"""PNG pictures of the three analyses, drawn with matplotlib (an optional dependency).

matplotlib is imported only when a picture is drawn. Figures are built with the object-oriented
API on an Agg canvas, never through ``pyplot``, so drawing needs no display and leaves the user's
own matplotlib backend and global state alone.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch

from pbs.analysis.coverage import CoverageCurves
from pbs.analysis.heads import HeadStatistics
from pbs.analysis.maps import AttentionMaps

INSTALL_HINT = 'pip install "pbs-attn[analysis]"'

_CATEGORY_COLOURS = {"helped": "#2a9d4b", "unchanged": "#9a9a9a", "harmed": "#d1342f"}


def require_matplotlib() -> Any:
    """Imports matplotlib or raises an ImportError that names the extra to install."""
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
        from matplotlib.figure import Figure  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"drawing the analysis pictures needs matplotlib: {INSTALL_HINT}") from exc
    return matplotlib


def _new_figure(width: float, height: float) -> Any:
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: str | Path, dpi: int) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, format="png")
    return path


def plot_coverage_density(
    curves: CoverageCurves,
    path: str | Path,
    *,
    reference_coverage: float | None = None,
    show_heads: bool = False,
    title: str | None = None,
    dpi: int = 120,
) -> Path:
    """Head-mean coverage against block density, one line per permuter (Figure 1).

    Args:
        curves: from `coverage_density_curves`.
        path: PNG file to write.
        reference_coverage: draw a dotted horizontal line at this coverage (e.g. 0.975).
        show_heads: also draw every head's curve, faintly.
        title: figure title; default names the workload.
        dpi: resolution.
    """
    fig = _new_figure(6.4, 4.6)
    ax = fig.add_subplot()
    colours = _permuter_colours(curves.permuters)
    low = 1.0
    for curve in curves:
        colour = colours[curve.permuter]
        if show_heads:
            for d, c in zip(curve.density.tolist(), curve.coverage.tolist()):
                ax.plot(d, c, color=colour, alpha=0.15, linewidth=0.7)
        style = "--" if curve.permuter == "identity" else "-"
        ax.plot(
            curve.mean_density.tolist(), curve.mean_coverage.tolist(), style,
            color=colour, marker="o", markersize=2.5, linewidth=1.6, label=curve.permuter,
        )
        low = min(low, float(curve.mean_coverage.min()))
    if reference_coverage is not None:
        ax.axhline(reference_coverage, color="#555555", linestyle=":", linewidth=1.0)
        ax.annotate(f"coverage {reference_coverage:g}", (0.99, reference_coverage), xycoords=("axes fraction", "data"),
                    ha="right", va="bottom", fontsize=8, color="#555555")
    ax.set_xlim(0.0, 1.02)
    ax.set_ylim(max(0.0, (int(low * 10) / 10) - 0.02), 1.005)
    ax.set_xlabel("block density (selected / causally allowed blocks)")
    ax.set_ylabel("attention coverage (head mean)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize=8, title="permuter", title_fontsize=8)
    cfg = curves.config
    ax.set_title(
        title or f"Coverage vs density, oracle selection (B={cfg.block_size}, S={cfg.segment_size})\n"
        f"{_short_source(curves.source)}",
        fontsize=9,
    )
    return _save(fig, path, dpi)


def plot_head_statistics(stats: HeadStatistics, path: str | Path, *, title: str | None = None, dpi: int = 120) -> Path:
    """Per-head sparsity gain: bars for one layer, a layer-by-head heat map for several.

    Args:
        stats: from `head_statistics`.
        path: PNG file to write.
        title: figure title; default states the comparison and the counts.
        dpi: resolution.
    """
    layers = sorted({h.layer for h in stats.heads})
    heads = sorted({h.head for h in stats.heads})
    # Batch entries of one head are averaged: the picture is about heads, not prompts.
    gain = torch.zeros(len(layers), len(heads), dtype=torch.float64)
    count = torch.zeros_like(gain)
    for h in stats.heads:
        i, j = layers.index(h.layer), heads.index(h.head)
        gain[i, j] += h.gain
        count[i, j] += 1
    gain = gain / count.clamp(min=1)
    counts = stats.counts
    default_title = (
        f"Sparsity gain {stats.baseline} - {stats.permuter} at coverage {stats.coverage_target:g}\n"
        f"helped {counts['helped']}, unchanged {counts['unchanged']}, harmed {counts['harmed']} "
        f"(tolerance {stats.tolerance:g})"
    )
    if len(layers) == 1:
        fig = _new_figure(max(4.8, 0.35 * len(heads) + 2), 3.8)
        ax = fig.add_subplot()
        values = gain[0].tolist()
        colours = [_CATEGORY_COLOURS[_category(v, stats.tolerance)] for v in values]
        ax.bar(heads, values, color=colours)
        for level in (stats.tolerance, -stats.tolerance):
            ax.axhline(level, color="#555555", linestyle=":", linewidth=0.8)
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_xlabel(f"query head (layer {layers[0]})")
        ax.set_ylabel("density saved (absolute)")
        ax.set_xticks(heads)
        ax.grid(True, axis="y", alpha=0.3)
    else:
        fig = _new_figure(max(5.0, 0.25 * len(heads) + 2.5), max(3.5, 0.22 * len(layers) + 1.8))
        ax = fig.add_subplot()
        limit = max(float(gain.abs().max()), stats.tolerance, 1e-6)
        image = ax.imshow(gain.numpy(), cmap="RdBu", vmin=-limit, vmax=limit, aspect="auto", interpolation="nearest")
        ax.set_xlabel("query head")
        ax.set_ylabel("layer")
        ax.set_yticks(range(len(layers)), [str(layer) for layer in layers])
        fig.colorbar(image, ax=ax, label="density saved (absolute)")
    ax.set_title(title or default_title, fontsize=9)
    return _save(fig, path, dpi)


def plot_attention_maps(maps: AttentionMaps, path: str | Path, *, title: str | None = None, dpi: int = 120) -> Path:
    """Block attention maps side by side (log colour scale), each selected block marked in red.

    The selection is its own layer: one semi-transparent red square per selected block, inset so
    the map shows between neighbours. An unselected block inside a selected region stays unmarked
    (an outline of the region would surround it too). Axes count blocks, with integer ticks.

    Args:
        maps: from `attention_maps`.
        path: PNG file to write.
        title: figure title; default names the head and the selector.
        dpi: resolution.
    """
    return _save(attention_map_figure(maps, title=title), path, dpi)


def attention_map_figure(maps: AttentionMaps, *, title: str | None = None) -> Any:
    """The matplotlib ``Figure`` that `plot_attention_maps` saves (Agg canvas, no pyplot)."""
    matplotlib = require_matplotlib()
    from matplotlib.collections import PatchCollection
    from matplotlib.colors import LogNorm
    from matplotlib.patches import Rectangle
    from matplotlib.ticker import MaxNLocator

    n = len(maps.panels)
    fig = _new_figure(3.9 * n + 0.9, 4.3)
    axes = fig.subplots(1, n, squeeze=False)[0]
    positive = [float(p.mass[p.allowed & (p.mass > 0)].min()) for p in maps.panels if bool((p.allowed & (p.mass > 0)).any())]
    vmax = max(float(p.mass.max()) for p in maps.panels)
    # Blocks with mass below 1e-6 of the largest are indistinguishable on the page: clip there so
    # underflowed zeros do not stretch the scale over thirty decades.
    vmin = max(min(positive, default=vmax * 1e-6), vmax * 1e-6)
    norm = LogNorm(vmin=vmin, vmax=vmax)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="white")
    image = None
    for ax, panel in zip(axes, maps.panels):
        # Blank: blocks in the future, and blocks of the diagonal segment that hold no visible key
        # in this order (exactly zero mass); neither carries attention.
        blank = ~panel.allowed | (panel.mass == 0)
        shown = panel.mass.clamp(min=vmin).masked_fill(blank, float("nan")).numpy()
        image = ax.imshow(shown, cmap=cmap, norm=norm, interpolation="nearest")
        blocks = max(panel.selected.shape)
        squares = [Rectangle((x, y), w, h) for x, y, w, h in selection_squares(panel.selected)]
        ax.add_collection(PatchCollection(
            squares, facecolor=(1.0, 0.1, 0.1, 0.25), edgecolor="#ff2020",
            linewidth=0.8 if blocks <= 32 else 0.4, gid="selection",
        ))
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"{panel.permuter}\ncoverage {panel.coverage:.3f}, density {panel.density:.3f}", fontsize=9)
        ax.set_xlabel(f"key block ({maps.block_size} tokens)")
        ax.set_ylabel("query block")
    fig.colorbar(image, ax=list(axes), shrink=0.8, label="block attention mass (log)")
    fig.suptitle(
        title or f"Layer {maps.layer}, head {maps.head}: blocks selected by {maps.selector} in red",
        fontsize=10,
    )
    return fig


def selection_squares(selected: torch.Tensor, inset: float = 0.1) -> list[tuple[float, float, float, float]]:
    """``(x, y, width, height)`` of one square per selected cell of a ``(rows, cols)`` grid drawn by
    imshow (cell ``(i, j)`` spans ``j - 0.5 .. j + 0.5``), inset by ``inset`` on every side."""
    side = 1.0 - 2 * inset
    return [(j - 0.5 + inset, i - 0.5 + inset, side, side) for i, j in selected.nonzero().tolist()]


def _permuter_colours(names: list[str]) -> dict[str, Any]:
    require_matplotlib()
    import matplotlib

    palette = matplotlib.colormaps["tab10"].colors
    colours: dict[str, Any] = {}
    others = itertools.cycle(palette[1:] + palette[:1])
    for name in names:
        colours[name] = "black" if name == "identity" else next(others)
    return colours


def _category(gain: float, tolerance: float) -> str:
    return "helped" if gain > tolerance else "harmed" if gain < -tolerance else "unchanged"


def _short_source(source: str, limit: int = 90) -> str:
    return source if len(source) <= limit else "..." + source[-(limit - 3):]
