"""Quality-density frontiers of the measured methods, from the ``pbs quality`` reports in benchmarks/results/quality.

Default (held-out): per method, the excess loss on the repeated passage of the held-out 7000-token
copy probe (5000 filler tokens) against the density of that same sample, with the quality goal of
docs/quality.md (density <= 0.27, excess <= 0.10) shaded.

``--tuning``: the line-based methods on the tuning set, every report that measured the three copy
probes and the 4K documents. Two panels against each method's average density: the excess loss
on the copy with 3000 filler tokens (the probe that binds the lines) and on the documents, with
the goal's bars (+0.10, +0.03).

    python benchmarks/plot_quality_frontier.py --out docs/images/quality_frontier_heldout_copy.png
    python benchmarks/plot_quality_frontier.py --tuning --out docs/images/quality_frontier_tuning_lines.png
    python benchmarks/plot_quality_frontier.py --gemma-32k --out docs/images/quality_frontier_gemma3_32k_gpu.png

``--gemma-32k``: Gemma 3 at 32K from the GPU runs (``quality_gpu_heldout_long_32k_*_gemma3.json``):
excess loss on the two 32K documents against density, with issue 38's bar (density <= 0.55 at
+0.02 nats or less) shaded; each method once.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: python3 benchmarks/<this file>.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import save_figure  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "quality"
FILLER = "5000"


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finish(fig, ax, out: Path, rows: int, xlim, ylim, xlabel: str, ylabel: str, title: str) -> None:
    """Axes limits, labels, title, legend and grid of a one-panel frontier, then the file."""
    ax.set_xlim(*xlim)
    ax.set_ylim(*ylim)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    save_figure(fig, out, f"{rows} points")


def points() -> list[tuple[str, float, float]]:
    """``(method, density of the copy sample, excess copy loss)`` from every held-out report."""
    out = []
    for path in sorted(RESULTS.glob("quality_heldout*_smollm2.json")):
        report = json.loads(path.read_text())
        summary = {row["method"]: row for row in report["summary"]}
        dense = summary.get("dense", {}).get("copy_loss", {}).get(FILLER)
        if dense is None:
            continue
        copy_samples = {s["name"] for s in report["samples"] if s.get("filler") == int(FILLER)}
        for row in report["results"]:
            if row["method"] == "dense" or row["sample"] not in copy_samples:
                continue
            loss = summary[row["method"]]["copy_loss"][FILLER]
            out.append((row["method"], row["density"], loss - dense))
    return out


def short_label(config: dict) -> str:
    """A few characters for a method's selector: ``vs0.75+mp0.9``, ``lines cap0.05+mp0.9``, ..."""
    pbs = config.get("pbs", config)

    def selector(sel: dict) -> str:
        name = sel["name"]
        if name == "union":
            return "+".join(selector(member) for member in sel["selectors"])
        if name == "vertical_slash":
            vertical = f"/v{sel['vertical_threshold']}" if sel.get("vertical_threshold") else ""
            rows = f" {sel['last_rows']} rows" if sel.get("last_rows", 64) != 64 else ""
            return f"vs{sel.get('threshold', 0.9)}{vertical}{rows}"
        if name == "mean_pool":
            return f"mp{sel.get('threshold', 0.9)}"
        if name == "line_cap":
            kind = "lines" if sel.get("cap_keys", True) else "offsets"
            if sel.get("cap_fraction") is not None:
                return f"{kind} cap{sel['cap_fraction']}"
            return f"lines >={sel['min_share_ratio']}x uniform"
        if name == "head_choice":
            return f"head_choice {sel.get('min_coverage')}"
        return name

    block = pbs.get("block_size", 128)
    label = selector(pbs["selector"]) + (f", B={block}" if block != 128 else "")
    if config.get("skip_first_layers"):
        label += f", layers 0-{config['skip_first_layers'] - 1} dense"
    overrides = config.get("layer_overrides") or {}
    if overrides:
        layers = sorted(int(i) for i in overrides)
        first = next(iter(overrides.values()))
        label += f", layers {layers[0]}-{layers[-1]}: " + ("dense" if first is None else selector(first["selector"]))
    return label


def tuning_points(filler: str = "3000") -> list[tuple[str, float, float, float]]:
    """``(label, density, excess copy loss at filler, excess loss on 4K documents)`` on the tuning set."""
    out = []
    for path in sorted(RESULTS.glob("quality_tuning*_smollm2.json")):
        report = json.loads(path.read_text())
        settings = report["meta"]["settings"]
        if sorted(settings["fillers"]) != [1000, 3000, 5000] or settings["lengths"] != [4096]:
            continue
        summary = {row["method"]: row for row in report["summary"]}
        dense = summary["dense"]
        for method in report["methods"]:
            if method["config"] is None:
                continue
            row = summary[method["label"]]
            out.append((short_label(method["config"]), row["density"],
                        row["copy_loss"][filler] - dense["copy_loss"][filler], row["loss"]["4096"] - dense["loss"]["4096"]))
    return out


def plot_tuning(out: Path) -> None:
    plt = _pyplot()

    rows = tuning_points()
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    for ax, column, bar, what in ((axes[0], 2, 0.10, "copy with 3000 filler tokens"), (axes[1], 3, 0.03, "4K documents")):
        ax.axhline(bar, color="tab:red", lw=1, ls="--", label=f"goal: at most +{bar:.2f}")
        for row in rows:
            defaults = row[0] == "vs0.75+mp0.9"
            per_layer = "layers" in row[0]
            capped = "cap" in row[0] or ">=" in row[0]
            ax.scatter(row[1], row[column], marker="*" if defaults else ("D" if per_layer else "o"),
                       s=140 if defaults else 40, zorder=3,
                       color="tab:green" if defaults else ("tab:red" if per_layer else ("tab:purple" if capped else "tab:blue")))
            if column == 2 or row[column] > bar:  # below the documents' bar the points crowd: unlabelled
                ax.annotate(row[0], (row[1], row[column]), fontsize=7, xytext=(4, 3), textcoords="offset points")
        ax.set_xlabel("average density (tuning set: 4K documents and the three copy probes)")
        ax.set_ylabel(f"excess loss on the {what} (nats, vs dense)")
        if column == 3:
            ax.text(0.02, 0.02, "unlabelled points: the left panel's, all within the bar", transform=ax.transAxes,
                    fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=8)
    fig.suptitle("Line-based selections on the tuning set, SmolLM2-135M, CPU reference path; star: the defaults; "
                 "purple: capped lines; red diamonds: per-layer lines", fontsize=10)
    save_figure(fig, out, f"{len(rows)} points")


def gemma_32k_points() -> list[tuple[str, float, float]]:
    """``(label, density, excess loss at 32K)`` of every method in the GPU runs, each label once."""
    out = {}
    for path in sorted(RESULTS.glob("quality_gpu_heldout_long_32k_*_gemma3.json")):
        report = json.loads(path.read_text())
        for row in report["summary"]:
            # the gqa variants repeat their neighbours' points (gqa matters only for a permuter)
            if row["method"] != "dense" and row.get("delta_loss") is not None and "gqa" not in row["method"]:
                out.setdefault(row["method"], (row["density"], row["delta_loss"]))
    return [(label, density, delta) for label, (density, delta) in out.items()]


def plot_gemma_32k(out: Path) -> None:
    plt = _pyplot()

    rows = gemma_32k_points()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    ax.fill_between([0.0, 0.55], -0.01, 0.02, color="tab:green", alpha=0.12, label="issue 38's bar")
    for label, density, delta in rows:
        oracle = "oracle" in label
        permuted = "last_block" in label or "pbs_" in label
        color = "tab:green" if oracle else ("tab:blue" if permuted else "tab:orange")
        ax.scatter(density, delta, marker="*" if oracle else "o", s=110 if oracle else 40, color=color, zorder=3)
        short = (label.replace(" (exact block mass)", "").replace(" + mean_pool 0.90", " + mp")
                 .replace("selector ", "").replace(" (its defaults)", "").replace("last_block + ", "lb + "))
        ax.annotate(short[:32], (density, delta), fontsize=6.5, xytext=(4, 3 if delta > 0.012 else -9),
                    textcoords="offset points")
    _finish(fig, ax, out, len(rows), (0.25, 0.8), (-0.01, 0.12), "density (two held-out 32K documents)",
            "excess loss at 32K (nats, vs dense)",
            "Gemma 3 270M at 32K on an H200 (reference path, Python 3.12's texts)\n"
            "stars: oracle (true mass); blue: permuted (last_block); orange: unpermuted")


def plot_heldout_copy(out: Path) -> None:
    plt = _pyplot()

    rows = points()
    fig, ax = plt.subplots(figsize=(8.5, 5.5))
    ax.fill_between([0.15, 0.27], -0.05, 0.10, color="tab:green", alpha=0.12, label="goal")
    for method, density, excess in rows:
        oracle = "oracle" in method
        block64 = "B=64" in method
        lines = "vertical_slash" in method
        marker = "*" if oracle else ("s" if block64 else ("D" if lines else "o"))
        color = "tab:green" if oracle else ("tab:purple" if block64 else ("tab:orange" if lines else "tab:blue"))
        ax.scatter(density, excess, marker=marker, s=90 if oracle else 45, color=color, zorder=3)
        label = method.replace(" (shared, B=64 S=256)", ", B=64").replace("(rows_per_block=16)", "16")
        ax.annotate(label[:60], (density, excess), fontsize=6.5, xytext=(4, 3), textcoords="offset points")
    _finish(fig, ax, out, len(rows), (0.15, 0.55), (-0.05, 1.8), "density of the 7000-token copy sample",
            "excess loss on the repeated passage (nats, vs dense)",
            "Held-out copy probe (1000 + 5000 + 1000 tokens), SmolLM2-135M, CPU reference path\n"
            "stars: oracle (true mass); squares: block 64; diamonds: vertical_slash; circles: other, block 128")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/images/quality_frontier_heldout_copy.png"))
    parser.add_argument("--tuning", action="store_true", help="the tuning-set frontier of the line-based methods")
    parser.add_argument("--gemma-32k", action="store_true", help="Gemma 3 at 32K, from the GPU runs")
    args = parser.parse_args()
    if args.gemma_32k:
        plot_gemma_32k(args.out)
        return
    if args.tuning:
        plot_tuning(args.out)
        return
    plot_heldout_copy(args.out)


if __name__ == "__main__":
    main()
