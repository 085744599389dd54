"""What ``pbs quality`` measures: the quick plan it runs with no options, and the full sweep (``--full``).

* `QUICK`: the defaults and the paper's method (`pbs_paper`) against dense, on one held-out
  document at 4096 tokens and one held-out copy probe (1000 + 2000 + 1000 tokens), with the
  per-layer probe at three layers of the copy probe: minutes on a 2-core CPU;
* `FULL`: every built-in method family at every threshold (26 methods with the defaults, dense
  included), on both text sets, every document at 4K and 8K tokens, three copy probes and every
  layer probed: 15-35 hours on a 2-core CPU (the numbers of ``docs/quality.md``).

Each option that ``pbs quality`` is given overrides its plan's value; `resolve_plan` makes the
`Plan`, and `Plan.planned_samples` / `Plan.describe` say what it will run before any model loads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pbs.analysis.quality_texts import TextSet, text_sets


@dataclass(frozen=True)
class Plan:
    """The work of one ``pbs quality`` run (methods aside: see `pbs.cli.quality`).

    Attributes:
        full: the full sweep's values (``--full``) where an option was not given.
        texts: ``"tuning"``, ``"heldout"`` or ``"all"``.
        documents: documents per text set, the first ones (``None``: all).
        lengths: document lengths in tokens.
        fillers: copy-probe filler lengths in tokens.
        passage_tokens: copy-probe passage length in tokens.
        layer_probe: ``"copy"``, ``"document"`` or ``"none"``.
        probe_layers: the probed layer ids (``None``: see ``spread_layers``).
        spread_layers: with no ``probe_layers``, probe this many full-attention layers spread from the
            first to the last (``None``: all of them).
        sweep: the built-in method list is the full sweep (`default_methods`), not the quick one.
    """

    full: bool
    texts: str
    documents: int | None
    lengths: tuple[int, ...]
    fillers: tuple[int, ...]
    passage_tokens: int
    layer_probe: str
    probe_layers: tuple[int, ...] | None = None
    spread_layers: int | None = None
    sweep: bool = False
    given: frozenset[str] = field(default_factory=frozenset)

    def text_sets(self) -> list[TextSet]:
        """The text sets of ``texts``, each cut to its first ``documents`` documents."""
        sets = text_sets(self.texts)
        if self.documents is None:
            return sets
        return [replace(s, documents=s.documents[: self.documents]) for s in sets]

    def planned_samples(self) -> list[dict[str, Any]]:
        """The samples `pbs.analysis.quality_texts.build_samples` will build, as ``{name, set, kind,
        source(s), tokens}``, without reading or tokenizing a text (names match the samples')."""
        out: list[dict[str, Any]] = []
        for text_set in self.text_sets():
            for source in text_set.documents:
                for length in self.lengths:
                    out.append({"name": f"{text_set.name} doc {source} {length}", "set": text_set.name,
                                "kind": "document", "sources": [source], "tokens": length})
            for copy in text_set.copies:
                for filler in self.fillers:
                    out.append({"name": f"{text_set.name} copy {copy.passage} / {copy.filler} {filler}",
                                "set": text_set.name, "kind": "copy", "sources": [copy.passage, copy.filler],
                                "tokens": 2 * self.passage_tokens + filler})
        return out

    def layers_to_probe(self, full_attention_layers: Sequence[int]) -> list[int] | None:
        """The layer ids of the per-layer probe on a model with these full-attention layers
        (``None``: all of them, `run_quality`'s default)."""
        if self.probe_layers is not None:
            return list(self.probe_layers)
        layers = list(full_attention_layers)
        if self.spread_layers is None or len(layers) <= self.spread_layers:
            return None
        if self.spread_layers == 1:
            return [layers[0]]
        step = (len(layers) - 1) / (self.spread_layers - 1)
        return sorted({layers[round(i * step)] for i in range(self.spread_layers)})

    def settings(self) -> dict[str, Any]:
        """The plan as the report's ``meta["settings"]``."""
        return {"plan": "full" if self.full else "quick", "texts": self.texts, "documents": self.documents,
                "lengths": list(self.lengths), "fillers": list(self.fillers), "passage_tokens": self.passage_tokens,
                "layer_probe": self.layer_probe,
                "probe_layers": None if self.probe_layers is None else list(self.probe_layers),
                "spread_layers": self.spread_layers, "options_given": sorted(self.given)}

    def describe(self, method_labels: Sequence[str]) -> str:
        """One line: the methods, the samples and the per-layer probe (for stderr before the run)."""
        samples = self.planned_samples()
        docs = [s for s in samples if s["kind"] == "document"]
        copies = [s for s in samples if s["kind"] == "copy"]
        parts = []
        if docs:
            parts.append(f"{len(docs)} document{'s' if len(docs) != 1 else ''} "
                         f"({', '.join(str(n) for n in self.lengths)} tokens)")
        if copies:
            parts.append(f"{len(copies)} copy probe{'s' if len(copies) != 1 else ''} "
                         f"({self.passage_tokens} + {'/'.join(str(f) for f in self.fillers)} + "
                         f"{self.passage_tokens} tokens)")
        probe = "no per-layer probe" if self.layer_probe == "none" else (
            f"per-layer probe on the {self.layer_probe} sample at "
            + (f"layers {','.join(map(str, self.probe_layers))}" if self.probe_layers is not None else
               f"{self.spread_layers} layers" if self.spread_layers is not None else "every layer"))
        what = "the full sweep (--full)" if self.full else "the quick plan (the full sweep: --full)"
        methods = ", ".join(method_labels) if len(method_labels) <= 4 else f"{len(method_labels)} methods"
        return (f"{what}: {methods}; texts {self.texts}: {' and '.join(parts) or 'no samples'}; {probe}")


QUICK: dict[str, Any] = {
    "texts": "heldout", "documents": 1, "lengths": (4096,), "fillers": (2000,), "passage_tokens": 1000,
    "layer_probe": "copy", "probe_layers": None, "spread_layers": 3,
}
"""The values of the options not given, with no ``--full``: minutes on a 2-core CPU."""

FULL: dict[str, Any] = {
    "texts": "all", "documents": None, "lengths": (4096, 8192), "fillers": (1000, 3000, 5000),
    "passage_tokens": 1000, "layer_probe": "copy", "probe_layers": None, "spread_layers": None,
}
"""The values of the options not given, with ``--full``: the full sweep (hours on a CPU)."""


def resolve_plan(full: bool = False, *, sweep: bool | None = None, **given: Any) -> Plan:
    """The `Plan` of a run: each value of ``given`` that is not ``None`` wins, the others come from
    `FULL` (``full``) or `QUICK`.

    Args:
        full: ``--full``.
        sweep: whether the built-in method list is the full sweep (default: ``full``).
        **given: ``texts``, ``documents``, ``lengths``, ``fillers``, ``passage_tokens``,
            ``layer_probe``, ``probe_layers`` as the options gave them (``None``: not given).
    """
    unknown = set(given) - set(QUICK)
    if unknown:
        raise TypeError(f"resolve_plan: unknown settings {sorted(unknown)}")
    values = dict(FULL if full else QUICK)
    chosen = {key: value for key, value in given.items() if value is not None}
    values.update(chosen)
    if chosen.get("probe_layers") is not None:
        values["spread_layers"] = None
    for key in ("lengths", "fillers", "probe_layers"):
        if values[key] is not None:
            values[key] = tuple(values[key])
    return Plan(full=full, sweep=full if sweep is None else sweep, given=frozenset(chosen), **values)
