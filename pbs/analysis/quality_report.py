"""Writing a `QualityReport` (`pbs.analysis.quality_results`, which also holds its summary): JSON,
markdown and pictures.

* ``<name>.json``: everything (per sample, per layer, the summary, the texts' hashes);
* ``<name>.md``: one table per text set, the GPU agreement, a per-layer table;
* ``<name>_loss_density.png``: long-text loss and copy loss against density, one curve per method
  family over its thresholds, dense as a horizontal line, the oracle dashed;
* ``<name>_layers.png``: per-layer coverage and attention error of each family at one threshold.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from statistics import mean
from typing import Any

from pbs.analysis.quality_methods import Method
from pbs.analysis.quality_results import QualityReport, summarize


def gpu_agreement(report: QualityReport) -> dict[str, float] | None:
    """Largest differences between the GPU backend and the reference over every (method, sample)."""
    if not report.gpu:
        return None
    out = {}
    for key in ("loss", "copy_loss", "density"):
        diffs = [abs(r[key] - r[f"{key}_reference"]) for r in report.gpu if key in r and f"{key}_reference" in r]
        if diffs:
            out[f"max_abs_{key}_diff"] = max(diffs)
    return out


# --------------------------------------------------------------------------------------------
# Markdown


def _fmt(value: float | None, digits: int = 3, signed: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def markdown_tables(report: QualityReport, summary: list[dict[str, Any]] | None = None) -> str:
    """The report as markdown: a table per text set, the GPU agreement and a per-layer table."""
    summary = summarize(report) if summary is None else summary
    meta = report.meta
    model = meta.get("model", {})
    env = meta.get("environment", {})
    lines = [
        f"Model: {model.get('name', '?')} ({model.get('layers', '?')} layers, {model.get('heads_q', '?')} query / "
        f"{model.get('heads_kv', '?')} KV heads, head dim {model.get('head_dim', '?')}), {model.get('dtype', '?')} on "
        f"{meta.get('device', '?')}; Python {env.get('python', '?')}, torch {env.get('torch', '?')}, "
        f"transformers {env.get('transformers', '?')}. PBS rows ran `backend=\"reference\"`.",
        "",
        "Losses are mean next-token losses in nats. `loss N`: documents cut to N tokens; `copy F`: the loss on the "
        "repeated passage with F filler tokens between the copies; `Δ` columns: against dense on the same set "
        "(`worst Δcopy`: the largest excess at any filler length). `density`: selected over causally allowed "
        "blocks, averaged over layers and samples. `layer err` / `coverage`: per-layer attention error against "
        "dense on the dense run's inputs, and the share of the exact attention mass inside the selected blocks, "
        "averaged over layers.",
    ]
    settings = meta.get("settings", {})
    if settings.get("plan") == "quick" and not settings.get("options_given"):  # older reports lack the key
        # The methods are not among the plan's options: a run with --methods still has the quick samples.
        lines += ["", "The quick plan's samples (no text, length or probe option given): one document and one copy "
                      "probe per text set; `pbs quality --full` runs the full sweep of methods, texts and lengths "
                      "(hours on a CPU)."]
    for text_set in dict.fromkeys(e["set"] for e in summary):
        entries = [e for e in summary if e["set"] == text_set]
        lengths = list(dict.fromkeys(k for e in entries for k in e["loss"]))
        fillers = list(dict.fromkeys(k for e in entries for k in e["copy_loss"]))
        header = ["method", "density", *[f"loss {n}" for n in lengths], "Δloss", *[f"copy {f}" for f in fillers],
                  "worst Δcopy", "layer err", "coverage"]
        lines += ["", f"### Texts: {text_set}", "", "| " + " | ".join(header) + " |",
                  "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
        for e in entries:
            cells = [e["method"].replace("|", "\\|"), _fmt(e["density"])]
            cells += [_fmt(e["loss"][n]) for n in lengths]
            cells.append(_fmt(e["delta_loss"], signed=True))
            cells += [_fmt(e["copy_loss"].get(f)) for f in fillers]
            cells += [_fmt(e["worst_delta_copy"], signed=True), _fmt(e["layer_rel_error"]), _fmt(e["layer_coverage"])]
            lines.append("| " + " | ".join(cells) + " |")
        dense = next((e for e in entries if e["method"] == "dense"), None)
        if dense is not None and dense["first_loss"]:
            first = ", ".join(f"{_fmt(v)}" for v in dense["first_loss"].values())
            lines += ["", f"Dense loss on the *first* copy of the passage (nothing to copy from yet): {first}."]
    chunked_table = _chunked_table(report, summary)
    if chunked_table:
        lines += ["", *chunked_table]
    agreement = gpu_agreement(report)
    if agreement:
        lines += ["", "### GPU backend against the reference", "",
                  "Every PBS method also ran with `backend=\"auto\"` (dense fallback off) on the same tokens: "
                  + ", ".join(f"{k.removeprefix('max_abs_').removesuffix('_diff')} differs by at most {v:.2e}"
                              for k, v in agreement.items()) + "."]
    layer_table = _layer_table(report)
    if layer_table:
        lines += ["", *layer_table]
    if report.skipped_methods:
        lines += ["", "Left out (not registered in this version): " + "; ".join(report.skipped_methods) + "."]
    return "\n".join(lines) + "\n"


def _chunked_table(report: QualityReport, summary: list[dict[str, Any]]) -> list[str]:
    """Chunked prefill against one-shot: every chunked method beside its one-shot twin, per set."""
    from pbs.analysis.quality_methods import one_shot_label

    pairs = [(m, one_shot_label(m)) for m in report.methods if m.chunk_size is not None]
    if not pairs:
        return []
    by_key = {(e["method"], e["set"]): e for e in summary}
    lines = ["### Chunked prefill against one-shot", "",
             "Each method read again in chunks of `chunk` tokens against the growing KV cache (every chunk after the "
             "first attends with `Nq < Nk`; its planner sees only the chunk's queries, over every cached key). "
             "`Δ` columns: chunked minus the same method in one pass, on the same tokens; the density is that of all "
             "of a layer's calls together.", "",
             "| set | method | chunk | density one-shot | density chunked | Δloss | Δcopy (per filler) |",
             "|---|---|---:|---:|---:|---:|---|"]
    for text_set in dict.fromkeys(e["set"] for e in summary):
        for method, twin in pairs:
            chunk, whole = by_key.get((method.label, text_set)), by_key.get((twin, text_set))
            if chunk is None or whole is None:
                continue
            delta_loss = (chunk["loss_mean"] - whole["loss_mean"]
                          if chunk["loss_mean"] is not None and whole["loss_mean"] is not None else None)
            copies = [_fmt(v - whole["copy_loss"][f], signed=True) for f, v in chunk["copy_loss"].items()
                      if v is not None and whole["copy_loss"].get(f) is not None]
            lines.append(f"| {text_set} | {twin.replace('|', chr(92) + '|')} | {method.chunk_size} | "
                         f"{_fmt(whole['density'])} | {_fmt(chunk['density'])} | {_fmt(delta_loss, signed=True)} | "
                         f"{' / '.join(copies) or '-'} |")
    return lines


def _representative_methods(methods: list[Method], target: float = 0.9) -> list[Method]:
    """Per family, the method whose threshold is nearest ``target`` (dense excluded). Methods
    without a threshold (a ``union``, a fixed budget) are not points of one curve: each keeps its
    own entry, even where several share a family name."""
    chosen: dict[str, Method] = {}
    for m in methods:
        if m.is_dense or m.chunk_size is not None:  # the per-layer probe measures one-shot methods only
            continue
        if m.threshold is None:
            chosen[f"label:{m.label}"] = m
            continue
        best = chosen.get(m.family)
        if best is None or abs(m.threshold - target) < abs(best.threshold - target):
            chosen[m.family] = m
    return list(chosen.values())


def _layer_means(report: QualityReport, label: str, key: str) -> dict[int, float]:
    values: dict[int, list[float]] = defaultdict(list)
    for row in report.layers:
        if row["method"] == label:
            values[row["layer"]].append(row[key])
    return {layer: mean(v) for layer, v in sorted(values.items())}


def _layer_table(report: QualityReport) -> list[str]:
    if not report.layers:
        return []
    methods = _representative_methods(report.methods)
    if not methods:
        return []
    coverage = {m.label: _layer_means(report, m.label, "coverage") for m in methods}
    error = {m.label: _layer_means(report, m.label, "rel_error") for m in methods}
    layers = sorted({layer for c in coverage.values() for layer in c})
    samples = ", ".join(report.meta.get("layer_samples", []))
    lines = [f"### Per layer: coverage / attention error (on {samples})", "",
             "| layer | " + " | ".join(m.label.replace("|", "\\|") for m in methods) + " |",
             "|---:|" + "|".join(["---:"] * len(methods)) + "|"]
    for layer in layers:
        cells = [f"{_fmt(coverage[m.label].get(layer), 2)} / {_fmt(error[m.label].get(layer), 2)}" for m in methods]
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    return lines


# --------------------------------------------------------------------------------------------
# Pictures


def plot_loss_density(report: QualityReport, path: str | Path, *, text_set: str | None = None,
                      summary: list[dict[str, Any]] | None = None, dpi: int = 120) -> Path:
    """Long-text loss and copy loss against density: a curve per family, dense as a line.

    Args:
        text_set: the set to draw (default: ``heldout`` if measured, else the first set).
    """
    from pbs.analysis.plotting import _new_figure, _save

    summary = summarize(report) if summary is None else summary
    sets = list(dict.fromkeys(e["set"] for e in summary))
    if not sets:
        raise ValueError("the report has no results to draw")
    text_set = text_set or ("heldout" if "heldout" in sets else sets[0])
    entries = [e for e in summary if e["set"] == text_set]
    panels = [("loss_mean", "long-text loss (nats)"), ("copy_mean", "copy loss (nats), second passage")]
    panels = [p for p in panels if any(e[p[0]] is not None for e in entries)]
    fig = _new_figure(6.0 * len(panels) + 2.5, 4.8)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    families = list(dict.fromkeys(e["family"] for e in entries if e["family"] != "dense"))
    oracle = {m.family for m in report.methods if m.is_oracle}
    colours = _colours(len(families))
    for ax, (key, ylabel) in zip(axes, panels):
        dense = next((e for e in entries if e["method"] == "dense"), None)
        if dense is not None and dense[key] is not None:
            ax.axhline(dense[key], color="black", linewidth=1.2, label="dense")
        for family, colour in zip(families, colours):
            points = sorted(
                ((e["density"], e[key], e["threshold"]) for e in entries
                 if e["family"] == family and e[key] is not None and e["density"] is not None),
                key=lambda p: p[0],
            )
            if not points:
                continue
            style = "--" if family in oracle else "-"
            ax.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", markersize=4,
                    color=colour, label=family)
            for x, y, threshold in points:
                if threshold is not None:
                    ax.annotate(f"{threshold:g}", (x, y), textcoords="offset points", xytext=(3, 3), fontsize=6,
                                color=colour)
        ax.set_xlabel("density (selected / causally allowed blocks)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    model = report.meta.get("model", {}).get("name", "model")
    fig.suptitle(f"{model}: loss against density ({text_set} texts; numbers are thresholds)", fontsize=10)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right center", fontsize=7)
    return _save(fig, path, dpi)


def plot_layers(report: QualityReport, path: str | Path, *, threshold: float = 0.9, dpi: int = 120) -> Path:
    """Per-layer coverage and attention error of each family at the threshold nearest ``threshold``."""
    from pbs.analysis.plotting import _new_figure, _save

    if not report.layers:
        raise ValueError("the report has no per-layer probes to draw")
    methods = _representative_methods(report.methods, threshold)
    fig = _new_figure(13.0, 4.6)
    axes = fig.subplots(1, 2)
    for ax, (key, ylabel) in zip(axes, [("coverage", "coverage of the exact attention mass"),
                                        ("rel_error", "attention error ||out - dense|| / ||dense||")]):
        for m, colour in zip(methods, _colours(len(methods))):
            values = _layer_means(report, m.label, key)
            ax.plot(list(values), list(values.values()), "--" if m.is_oracle else "-", marker=".", color=colour,
                    label=m.label)
        ax.set_xlabel("layer")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    fig.suptitle(f"per layer, on {', '.join(report.meta.get('layer_samples', []))}", fontsize=9)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right center", fontsize=7)
    return _save(fig, path, dpi)


def _colours(n: int) -> list[Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


def report_file_names(name: str = "quality", *, pictures: bool = True) -> list[str]:
    """The names of the files `write_report` may write into its folder (the layer picture only
    where the report has per-layer rows): what ``pbs quality`` checks before it runs."""
    names = [f"{name}.json", f"{name}.md"]
    return names + ([f"{name}_loss_density.png", f"{name}_layers.png"] if pictures else [])


def write_report(report: QualityReport, out: str | Path, name: str = "quality", *, pictures: bool = True) -> dict[str, Path]:
    """Writes ``<name>.json``, ``<name>.md`` and (with matplotlib) the pictures into ``out``.

    Returns:
        ``{"json": ..., "markdown": ..., "loss_density": ..., "layers": ...}`` for the files written.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = report.to_json()
    paths: dict[str, Path] = {}
    paths["json"] = out / f"{name}.json"
    paths["json"].write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    paths["markdown"] = out / f"{name}.md"
    paths["markdown"].write_text(markdown_tables(report, data["summary"]), encoding="utf-8")
    if pictures:
        paths["loss_density"] = plot_loss_density(report, out / f"{name}_loss_density.png", summary=data["summary"])
        if report.layers:
            paths["layers"] = plot_layers(report, out / f"{name}_layers.png")
    return paths
