"""``pbs quality`` with an experimental variant of ``vertical_slash`` whose lines are capped.

In the diffuse early layers of SmolLM2 (layers 1-10) the union of the defaults keeps 0.7-0.9 of the
blocks where exact block masses (the oracle at coverage 0.95) need 0.5-0.6: the lines' cumulative
rule keeps hundreds of offsets there, a wide band that mean pooling covers anyway. This script
registers ``line_cap``, the ``vertical_slash`` selection with either

* ``cap_fraction``: at most that fraction of the keys and of the offsets kept (the top ones by
  share; MInference's fixed vertical and slash budgets, as a fraction of ``Nk``), or
* ``min_share_ratio``: only lines whose share is at least that multiple of a uniform share,

and hands the rest of its command line to ``pbs quality`` (a ``--methods`` file may then name
``line_cap``). The variant is not part of the library: it lost the copy on the tuning set
(docs/quality.md, "Lowering the union's density: negative results").

    python3 benchmarks/quality_line_caps.py --print-methods > line_caps_methods.json   # or: --print-methods second
    python3 benchmarks/quality_line_caps.py quality --full --texts tuning --lengths 4096 --fillers 1000 3000 5000 \\
        --layer-probe none --no-pictures --methods line_caps_methods.json --out pbs-quality-line-caps
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Literal

import torch

if __package__ in (None, ""):  # run as a file
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pbs.components import SelectionInputs, SelectorConfig, register_selector  # noqa: E402
from pbs.reference.threshold_select import select_by_cumulative_threshold  # noqa: E402
from pbs.selectors import vertical_slash  # noqa: E402

def _capped_unions(runs: tuple[tuple[str, dict], ...]) -> list:
    """``dense``, then the union of ``line_cap`` (with each run's knobs) and ``mean_pool`` 0.9."""
    return ["dense", *({"config": {"permuter": "none", "selector": {"name": "union", "selectors": [
        {"name": "line_cap", **knobs}, {"name": "mean_pool", "threshold": 0.9}]}}, "label": label, "family": "line_cap"}
        for label, knobs in runs)]


METHODS = _capped_unions((("U cap0.05", {"cap_fraction": 0.05}), ("U cap0.02", {"cap_fraction": 0.02}),
                          ("U peak8", {"min_share_ratio": 8.0})))
"""The methods of the first measured run (write them to a file with ``--print-methods``)."""

METHODS_SECOND = _capped_unions((("U offsets cap0.05", {"cap_fraction": 0.05, "cap_keys": False}),
                                 ("U cap0.1", {"cap_fraction": 0.1})))
"""The second run: offsets capped with every kept key, and a looser cap (``--print-methods second``)."""


def capped_lines(scores: torch.Tensor, threshold: float, cap_fraction: float | None,
                 min_share_ratio: float | None) -> torch.Tensor:
    """The cumulative rule of `vertical_slash.kept_lines` on ``(B, h, Nk)`` scores, then the cap."""
    keep = select_by_cumulative_threshold(scores, scores > 0, threshold)
    if cap_fraction is not None:
        top = scores.topk(max(1, math.ceil(cap_fraction * scores.shape[-1])), dim=-1).indices
        keep = keep & torch.zeros_like(keep).scatter_(-1, top, True)
    if min_share_ratio is not None:
        allowed = (scores > 0).sum(-1, keepdim=True).clamp(min=1)
        keep = keep & (scores >= min_share_ratio / allowed)
    return keep


@register_selector
class LineCapSelector(SelectorConfig):
    """``vertical_slash`` with capped lines (reference only; see the module docstring)."""

    name: Literal["line_cap"] = "line_cap"
    threshold: float = 0.75
    cap_fraction: float | None = None
    min_share_ratio: float | None = None
    cap_keys: bool = True
    last_rows: int = 64

    def select(self, inputs: SelectionInputs) -> torch.Tensor:
        heads = slice(0, inputs.layout.heads_q)
        reversed_source_k = inputs.source_k.flip(2) if inputs.source_k is not None else None
        probs, last_position = vertical_slash.last_rows_attention(inputs, self.last_rows, heads, reversed_source_k)
        # last_rows_attention returns the keys reversed; the public scores take them in order.
        scores = vertical_slash.vertical_and_slash_scores(probs.flip(-1), last_position)
        vertical, slash = scores
        offsets = capped_lines(slash, self.threshold, self.cap_fraction, self.min_share_ratio)
        keys = (capped_lines(vertical, self.threshold, self.cap_fraction, self.min_share_ratio) if self.cap_keys
                else capped_lines(vertical, self.threshold, None, None))  # the plain cumulative rule
        return vertical_slash.blocks_of_lines(keys, offsets, inputs, heads)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--print-methods"]:
        import json

        print(json.dumps(METHODS_SECOND if sys.argv[2:] == ["second"] else METHODS, indent=1))
        raise SystemExit(0)
    from pbs.cli import main

    raise SystemExit(main(sys.argv[1:]))
