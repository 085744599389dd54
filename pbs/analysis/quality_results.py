"""What a ``pbs quality`` run measured: `QualityReport`, and `summarize`, its means per method and text set.

`QualityReport.to_json` is what ``quality.json`` holds (the summary included); `pbs.analysis.quality`
fills a report, `pbs.analysis.quality_report` writes it as JSON, markdown and pictures.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from statistics import mean
from typing import Any

from pbs.analysis.quality_methods import Method

REPORT_VERSION = 1
SET_ORDER = ("heldout", "tuning")


@dataclass
class QualityReport:
    """Everything ``pbs quality`` measured; `to_json` is what ``quality.json`` holds.

    Attributes:
        meta: model, versions, settings, texts (source id -> SHA-256 prefix and token count).
        methods: the rows.
        skipped_methods: default families left out, and why.
        samples: descriptions of the token sequences (name, set, kind, spans).
        results: one dict per (method, sample): losses, density, seconds.
        layers: one dict per (method, probe sample, layer): rel_error, coverage, density.
        gpu: one dict per (method, sample) of the GPU backend run, with the reference's numbers
            beside it; empty without CUDA.
    """

    meta: dict[str, Any]
    methods: list[Method]
    skipped_methods: list[str] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    results: list[dict[str, Any]] = field(default_factory=list)
    layers: list[dict[str, Any]] = field(default_factory=list)
    gpu: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "QualityReport":
        """The report that `to_json` wrote (its summary is recomputed), e.g. to write its markdown again."""
        from pbs.integrations.dispatch import PBSIntegrationConfig

        methods = [Method(label=m["label"], family=m["family"], threshold=m["threshold"],
                          config=None if m["config"] is None else PBSIntegrationConfig.model_validate(m["config"]),
                          chunk_size=m.get("chunk_size")) for m in data["methods"]]
        return cls(meta=data["meta"], methods=methods, skipped_methods=data.get("skipped_methods", []),
                   samples=data.get("samples", []), results=data.get("results", []), layers=data.get("layers", []),
                   gpu=data.get("gpu", []))

    def to_json(self) -> dict[str, Any]:
        return {
            "version": REPORT_VERSION,
            "meta": self.meta,
            "methods": [m.to_json() for m in self.methods],
            "skipped_methods": self.skipped_methods,
            "samples": self.samples,
            "summary": summarize(self),
            "results": self.results,
            "layers": self.layers,
            "gpu": self.gpu,
        }


def _mean(values: list[float]) -> float | None:
    return mean(values) if values else None


def summarize(report: QualityReport) -> list[dict[str, Any]]:
    """One entry per (method, text set): the means the tables and pictures show.

    Keys: ``method``, ``family``, ``threshold``, ``set``; ``density`` (mean over the set's samples);
    ``loss`` (length -> mean document loss), ``loss_mean`` (over every document sample) and
    ``delta_loss`` (minus dense's); ``copy_loss`` and ``first_loss`` (filler -> mean loss on the
    second / first passage), ``copy_mean`` and ``worst_delta_copy`` (the largest excess over dense
    at any filler length); ``layer_rel_error``, ``layer_coverage``, ``layer_density`` (means over
    layers and probe samples; None without probes).
    """
    by_key: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for row in report.results:
        by_key[(row["method"], row["set"])].append(row)
    layer_rows: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for row in report.layers:
        layer_rows[(row["method"], row["set"])].append(row)
    sets = [s for s in SET_ORDER if any(r["set"] == s for r in report.results)]
    sets += sorted({r["set"] for r in report.results} - set(sets))
    summary = []
    # dense first, so every other row can be compared with it
    ordered = sorted(report.methods, key=lambda m: not m.is_reference)
    for text_set in sets:
        dense_entry = None
        for method in ordered:
            rows = by_key.get((method.label, text_set), [])
            if not rows:
                continue
            docs = [r for r in rows if r["kind"] == "document"]
            copies = [r for r in rows if r["kind"] == "copy"]
            lengths = sorted({r["tokens"] for r in docs})
            fillers = sorted({r["filler"] for r in copies})
            entry: dict[str, Any] = {
                "method": method.label,
                "family": method.family,
                "threshold": method.threshold,
                "set": text_set,
                "density": _mean([r["density"] for r in rows]),
                "loss": {str(n): _mean([r["loss"] for r in docs if r["tokens"] == n]) for n in lengths},
                "loss_mean": _mean([r["loss"] for r in docs]),
                "copy_loss": {str(f): _mean([r["copy_loss"] for r in copies if r["filler"] == f]) for f in fillers},
                "first_loss": {str(f): _mean([r["first_loss"] for r in copies if r["filler"] == f]) for f in fillers},
                "copy_mean": _mean([r["copy_loss"] for r in copies]),
            }
            layers = layer_rows.get((method.label, text_set), [])
            entry["layer_rel_error"] = _mean([r["rel_error"] for r in layers])
            entry["layer_coverage"] = _mean([r["coverage"] for r in layers])
            entry["layer_density"] = _mean([r["density"] for r in layers])
            if method.is_reference:
                dense_entry = entry
            _add_deltas(entry, dense_entry)
            summary.append(entry)
    return summary


def _add_deltas(entry: dict[str, Any], dense: dict[str, Any] | None) -> None:
    entry["delta_loss"] = None
    entry["worst_delta_copy"] = None
    if dense is None:
        return
    if entry["loss_mean"] is not None and dense["loss_mean"] is not None:
        entry["delta_loss"] = entry["loss_mean"] - dense["loss_mean"]
    deltas = [
        value - dense["copy_loss"][f]
        for f, value in entry["copy_loss"].items()
        if value is not None and dense["copy_loss"].get(f) is not None
    ]
    entry["worst_delta_copy"] = max(deltas) if deltas else None
