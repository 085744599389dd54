"""``pbs quality`` with an experimental ``vertical_slash`` whose slash threshold counts only the far
offsets.

``vertical_slash`` keeps the fewest offsets whose shares reach ``threshold`` of the last rows'
attention, near offsets included. The offsets below ``segment_size`` fall inside the on-diagonal
segment, which planning forces anyway, so in a head whose attention is mostly local they spend the
threshold on blocks that cost nothing and leave few far lines (where a copy reads), while in a
diffuse head they spend little of it. This script registers ``far_lines``: the near offsets are
all kept, and the far ones are kept by the cumulative rule over the far offsets' shares alone
(renormalized), so ``threshold`` is the share of each head's *far* attention that its kept far
lines hold. Keys (vertical lines) follow ``vertical_slash`` unchanged.

It hands the rest of its command line to ``pbs quality`` (a ``--methods`` file may then name
``far_lines``). Reference only; not part of the library (docs/quality.md has the measurement).

    python3 benchmarks/quality_far_lines.py --print-methods > far_lines_methods.json   # or: --print-methods second / gemma
    python3 benchmarks/quality_far_lines.py quality --texts heldout --documents 3 --lengths 4096 \\
        --fillers 1000 3000 5000 --layer-probe none --no-pictures --methods far_lines_methods.json --out pbs-quality-far
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

import torch

if __package__ in (None, ""):  # run as a file
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pbs.components import SelectionInputs, SelectorConfig, register_selector  # noqa: E402
from pbs.reference.threshold_select import select_by_cumulative_threshold  # noqa: E402
from pbs.selectors import vertical_slash  # noqa: E402


def far_offsets(slash: torch.Tensor, threshold: float, near: int) -> torch.Tensor:
    """``(B, h, Nk)`` bool: every offset below ``near``, and the fewest offsets at or above it whose
    shares reach ``threshold`` of those offsets' total share (zero shares never kept)."""
    far = slash.clone()
    far[..., :near] = 0.0
    total = far.sum(-1, keepdim=True)
    shares = torch.where(total > 0, far / total.clamp(min=torch.finfo(far.dtype).tiny), far)
    keep = select_by_cumulative_threshold(shares, shares > 0, threshold)
    keep[..., :near] = True
    return keep


@register_selector
class FarLinesSelector(SelectorConfig):
    """``vertical_slash`` with its slash threshold over the far offsets (see the module docstring)."""

    name: Literal["far_lines"] = "far_lines"
    threshold: float = 0.6
    vertical_threshold: float = 0.75
    last_rows: int = 64

    def select(self, inputs: SelectionInputs) -> torch.Tensor:
        heads = slice(0, inputs.layout.heads_q)
        reversed_source_k = inputs.source_k.flip(2) if inputs.source_k is not None else None
        probs, last_position = vertical_slash.last_rows_attention(inputs, self.last_rows, heads, reversed_source_k)
        vertical, slash = vertical_slash.vertical_and_slash_scores(probs.flip(-1), last_position)
        keys = select_by_cumulative_threshold(vertical, vertical > 0, self.vertical_threshold)
        offsets = far_offsets(slash, self.threshold, inputs.layout.segment_size)
        return vertical_slash.blocks_of_lines(keys, offsets, inputs, heads)


def _union(far: dict) -> dict:
    return {"permuter": "none", "selector": {"name": "union", "selectors": [
        {"name": "far_lines", **far}, {"name": "mean_pool", "threshold": 0.9}]}}


def _per_depth(far: dict, first_layers: int = 5) -> dict:
    """The defaults in the first layers, the far lines' union after them (SmolLM2: 30 layers)."""
    import pbs
    from pbs.integrations.transformers import PBSIntegrationConfig

    integration = PBSIntegrationConfig(pbs=pbs.PBSConfig.model_validate(_union(far)), min_seq_len=1,
                                       layer_overrides={i: pbs.PBSConfig() for i in range(first_layers)})
    return integration.model_dump(mode="json")


METHODS = [
    "dense",
    {"label": "far lines 0.4 or mean_pool 0.9", "config": _union({"threshold": 0.4}), "family": "far_lines"},
    {"label": "far lines 0.25 or mean_pool 0.9", "config": _union({"threshold": 0.25}), "family": "far_lines"},
    {"label": "layers 0-4 defaults, then far lines 0.25 or mean_pool 0.9", "config": _per_depth({"threshold": 0.25}),
     "family": "far_lines"},
]
"""The first measured run (write them to a file with ``--print-methods``)."""

METHODS_SECOND = [
    "dense",
    {"label": "far lines 0.1 or mean_pool 0.9", "config": _union({"threshold": 0.1}), "family": "far_lines"},
    {"label": "far lines 0.1, keys 0.5, or mean_pool 0.9", "config": _union({"threshold": 0.1, "vertical_threshold": 0.5}),
     "family": "far_lines"},
    {"label": "far lines 0.25, keys 0.5, or mean_pool 0.9",
     "config": _union({"threshold": 0.25, "vertical_threshold": 0.5}), "family": "far_lines"},
]
"""The second run: fewer far lines, and fewer keys (``--print-methods second``)."""

METHODS_GEMMA = [
    "dense",
    {"label": "far lines 0.1 or mean_pool 0.9", "config": _union({"threshold": 0.1}), "family": "far_lines"},
    {"label": "far lines 0.25 or mean_pool 0.9", "config": _union({"threshold": 0.25}), "family": "far_lines"},
]
"""Gemma 3 at 32K, beside the defaults and the oracle measured before (``--print-methods gemma``)."""

PRINTED = {"": METHODS, "second": METHODS_SECOND, "gemma": METHODS_GEMMA}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--print-methods"]:
        import json

        print(json.dumps(PRINTED[" ".join(sys.argv[2:])], indent=1))
        raise SystemExit(0)
    from pbs.cli import main

    raise SystemExit(main(sys.argv[1:]))
