"""Per-layer coverage of the true attention mass against density, for each block-selection estimator.

Runs the real model once (dense), captures every layer's post-RoPE queries and keys on one sample
of the quality harness (default: the tuning set's copy probe, 1000 + 5000 + 1000 tokens), then
plans every method at several thresholds on those tensors and measures, per layer:

* density: selected / causally allowed blocks;
* coverage: the share of the exact attention mass (on the same permuted tensors) that the selected
  blocks hold, averaged over heads and query rows;
* the copy span's coverage: the same, over the query blocks of the repeated passage only.

No attention output is computed, so this is fast enough to sweep (minutes on a CPU), and it tells
whether an estimator finds the blocks that matter before the slower loss runs of ``pbs quality``.

    python benchmarks/estimator_coverage.py --out benchmarks/results/estimators/estimator_coverage_tuning.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: python3 benchmarks/estimator_coverage.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pbs  # noqa: E402
from benchmarks.common import environment, save  # noqa: E402
from pbs.analysis.hf_capture import capture_qk  # noqa: E402
from pbs.analysis.quality_models import load_model  # noqa: E402
from pbs.analysis.quality_texts import TEXT_SETS, TextLibrary, build_samples  # noqa: E402
from pbs.planning import build_plan  # noqa: E402
from pbs.reference import block_attention_mass  # noqa: E402

METHODS: dict[str, tuple[dict, str, tuple[float, ...]]] = {
    # label: (config without the threshold, threshold field, thresholds)
    "oracle none": ({"permuter": "none", "selector": {"name": "oracle"}}, "coverage", (0.8, 0.9, 0.95)),
    "oracle last_block": ({"permuter": "last_block", "gqa": "per_head", "selector": {"name": "oracle"}}, "coverage", (0.8, 0.9, 0.95)),
    "mean_pool none": ({"permuter": "none", "selector": {"name": "mean_pool"}}, "threshold", (0.8, 0.9, 0.95)),
    "mean_pool last_block": ({"permuter": "last_block", "gqa": "per_head", "selector": {"name": "mean_pool"}}, "threshold", (0.8, 0.9, 0.95)),
    "antidiagonal none": ({"permuter": "none", "selector": {"name": "antidiagonal"}}, "threshold", (0.8, 0.9, 0.95)),
    "sampled_rows8 none": ({"permuter": "none", "selector": {"name": "sampled_rows", "rows_per_block": 8}}, "threshold", (0.8, 0.9, 0.95)),
    "sampled_rows4 none": ({"permuter": "none", "selector": {"name": "sampled_rows", "rows_per_block": 4}}, "threshold", (0.8, 0.9, 0.95)),
    "sampled_rows8 last_block": ({"permuter": "last_block", "gqa": "per_head", "selector": {"name": "sampled_rows", "rows_per_block": 8}}, "threshold", (0.8, 0.9, 0.95)),
    "vertical_slash none": ({"permuter": "none", "selector": {"name": "vertical_slash"}}, "threshold", (0.6, 0.75, 0.9)),
    # mean_pool 0.9 alone in the heads where it covers the last rows, with vertical_slash 0.75 elsewhere
    # (min_coverage above 1: the union in every head)
    "head_choice none": ({"permuter": "none", "selector": {"name": "head_choice"}}, "min_coverage", (0.8, 0.85, 0.9, 0.95, 1.01)),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", choices=sorted(TEXT_SETS), default="tuning")
    parser.add_argument("--filler", type=int, default=5000)
    parser.add_argument("--passage-tokens", type=int, default=1000)
    parser.add_argument("--methods", nargs="+", choices=sorted(METHODS), default=list(METHODS))
    parser.add_argument("--layers", type=int, nargs="+", help="layer ids (default all)")
    parser.add_argument("--out", type=Path, help="JSON output path")
    parser.add_argument("--plot", type=Path, help="PNG of per-layer coverage and density at tau 0.9")
    parser.add_argument("--from-json", type=Path, help="only plot / print an earlier --out file")
    args = parser.parse_args()
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        print(format_table(saved["summary"]))
        if args.plot:
            plot_layers(saved["rows"], args.plot)
        return 0
    began = time.perf_counter()

    loaded = load_model()
    library = TextLibrary(loaded.tokenize)
    sample = [s for s in build_samples([TEXT_SETS[args.texts]], library, lengths=(), fillers=(args.filler,),
                                       passage_tokens=args.passage_tokens) if s.kind == "copy"][0]
    print(f"capturing q/k of {sample.name} ({sample.length} tokens) ...", file=sys.stderr, flush=True)
    capture = capture_qk(loaded.model, sample.input_ids[None], layers=args.layers)
    copy_lo, copy_hi = sample.copy_span
    rows: list[dict] = []
    for layer_pos, layer in enumerate(capture.layer_ids):
        q, k = capture.queries[layer_pos], capture.keys[layer_pos]
        masses: dict[str, torch.Tensor] = {}
        for label in args.methods:
            base, field, thresholds = METHODS[label]
            for tau in thresholds:
                config = pbs.PBSConfig(**{**base, "selector": {**base["selector"], field: tau}}, backend="reference")
                plan, q_perm, _, _ = build_plan(q, k, config, q.shape[-1] ** -0.5)
                perm_key = config.permuter.name + config.gqa
                if perm_key not in masses:
                    k_perm = plan.key_permutation.apply(k)
                    masses[perm_key] = block_attention_mass(
                        q_perm, k_perm, plan.query_positions(), plan.key_positions(), plan.layout
                    )
                mass = masses[perm_key]
                selected = plan.mask.to_dense()
                kept = (mass * selected).sum(-1)  # (B, H, Tq): coverage per query block
                bs = plan.layout.block_size
                copy_blocks = slice(copy_lo // bs + 1, copy_hi // bs)
                rows.append({
                    "layer": layer, "method": label, "threshold": tau, "density": plan.density,
                    "coverage": float(kept.mean()), "copy_coverage": float(kept[..., copy_blocks].mean()),
                    "min_head_coverage": float(kept.mean(-1).min()),
                })
        summary = [r for r in rows if r["layer"] == layer and r["threshold"] == 0.9]
        print(f"layer {layer}: " + "  ".join(f"{r['method']} d={r['density']:.2f} c={r['coverage']:.3f}/{r['copy_coverage']:.3f}" for r in summary),
              file=sys.stderr, flush=True)

    table = aggregate(rows)
    print(format_table(table))
    if args.out:
        save({
            "benchmark": "estimator_coverage", **environment("cpu"), "model": loaded.info, "sample": sample.describe(),
            "wall_s": time.perf_counter() - began, "summary": table, "rows": rows,
        }, args.out)
        print(f"wrote {args.out}", file=sys.stderr)
    if args.plot:
        plot_layers(rows, args.plot)
    return 0


def plot_layers(rows: list[dict], path: Path, threshold: float = 0.9) -> None:
    """Coverage of the true mass (top) and density (bottom) per layer, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    for method in methods:
        sel = sorted((r for r in rows if r["method"] == method and r["threshold"] == threshold), key=lambda r: r["layer"])
        style = "--" if method.startswith("oracle") else "-"
        layers = [r["layer"] for r in sel]
        top.plot(layers, [r["coverage"] for r in sel], style, marker="o", label=method)
        bottom.plot(layers, [r["density"] for r in sel], style, marker="o", label=method)
    top.set_ylabel("coverage of the true mass")
    top.axhline(threshold, color="grey", lw=0.8)
    bottom.set_ylabel("density")
    bottom.set_xlabel("layer")
    top.set_title(f"Estimated against true attention mass, threshold / coverage {threshold}")
    top.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def aggregate(rows: list[dict]) -> list[dict]:
    """Mean over layers per (method, threshold), and the worst layer's coverage."""
    out = []
    keys = sorted({(r["method"], r["threshold"]) for r in rows}, key=lambda x: (list(METHODS).index(x[0]), x[1]))
    for method, tau in keys:
        sel = [r for r in rows if r["method"] == method and r["threshold"] == tau]
        out.append({
            "method": method, "threshold": tau,
            "density": sum(r["density"] for r in sel) / len(sel),
            "coverage": sum(r["coverage"] for r in sel) / len(sel),
            "copy_coverage": sum(r["copy_coverage"] for r in sel) / len(sel),
            "worst_layer_coverage": min(r["coverage"] for r in sel),
        })
    return out


def format_table(table: list[dict]) -> str:
    lines = ["| method | tau | density | coverage | copy coverage | worst layer |", "|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['method']} | {r['threshold']} | {r['density']:.3f} | {r['coverage']:.3f} | "
                     f"{r['copy_coverage']:.3f} | {r['worst_layer_coverage']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
