"""Copy-recall frontier of every measured method on the held-out 7000-token copy probe.

Reads the held-out ``pbs quality`` reports in benchmarks/results (``quality_heldout*_smollm2.json``)
and plots, per method, the excess loss on the repeated passage (5000 filler tokens) against the
density of that same sample, with the quality goal of docs/quality.md (density <= 0.27, excess <= 0.10)
shaded.

    python benchmarks/plot_quality_frontier.py --out docs/images/quality_frontier_heldout_copy.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
FILLER = "5000"


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/images/quality_frontier_heldout_copy.png"))
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    ax.set_xlim(0.15, 0.55)
    ax.set_ylim(-0.05, 1.8)
    ax.set_xlabel("density of the 7000-token copy sample")
    ax.set_ylabel("excess loss on the repeated passage (nats, vs dense)")
    ax.set_title("Held-out copy probe (1000 + 5000 + 1000 tokens), SmolLM2-135M, CPU reference path\n"
                 "stars: oracle (true mass); squares: block 64; diamonds: vertical_slash; circles: other, block 128", fontsize=9)
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=130)
    print(f"{len(rows)} points -> {args.out}")


if __name__ == "__main__":
    main()
