"""``pbs.attention`` with the defaults against cuDNN, as a picture: time ratio by length.

Reads a `bench_defaults.py` result and draws, for flat and structured inputs, the ratio pbs / cuDNN
of each protocol that the file holds (events on an idle GPU, events with the GPU busy, back-to-back
wall time) against the sequence length, with the 1.03 target and the A/A spread of the idle-GPU
protocol (cuDNN against itself).

    python benchmarks/plot_defaults.py benchmarks/results/defaults/defaults_h100_launch_first.json \
        --out docs/images/defaults_vs_cudnn_h100.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: python3 benchmarks/<this file>.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import save_figure  # noqa: E402

PROTOCOLS = {  # row key -> label
    "ratio_events": "events, idle GPU",
    "ratio_busy": "events, GPU busy (layer loop)",
    "ratio_wall": "wall, back to back",
}


def series(rows: list[dict], kind: str, key: str) -> tuple[list[int], list[float]]:
    """Lengths and ratios of one input kind and protocol (rows without the key are skipped)."""
    points = sorted((r["seq_len"], r[key]) for r in rows if r.get("input") == kind and key in r)
    return [n for n, _ in points], [x for _, x in points]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("result", type=Path, help="a bench_defaults.py JSON file")
    parser.add_argument("--out", type=Path, default=Path("docs/images/defaults_vs_cudnn.png"))
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(args.result.read_text())
    rows = [r for r in result["rows"] if "error" not in r]
    target = result.get("target_ratio", 1.03)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, kind in zip(axes, ("flat", "structured")):
        lengths, aa = series(rows, kind, "ratio_events_aa")
        if lengths:
            ax.fill_between(lengths, [min(x, 1.0) for x in aa], [max(x, 1.0) for x in aa], color="grey", alpha=0.25,
                            label="A/A spread (cuDNN vs itself, idle)")
        for key, label in PROTOCOLS.items():
            lengths, ratios = series(rows, kind, key)
            if lengths:
                ax.plot(lengths, ratios, marker="o", label=label)
        ax.axhline(target, color="tab:red", linestyle="--", linewidth=1, label=f"target {target}")
        ax.axhline(1.0, color="black", linewidth=0.6)
        ax.set_xscale("log", base=2)
        ticks = sorted({r["seq_len"] for r in rows})
        ax.set_xticks(ticks, [f"{n // 1024}K" for n in ticks])
        ax.set_xlabel("sequence length")
        ax.set_title(f"{kind} inputs" + (" (dense below 32K, dense by the probe above)" if kind == "flat"
                                         else " (dense below 32K, sparse from 32K)"), fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("pbs.attention time / cuDNN time")
    axes[1].legend(fontsize=8, loc="lower left")
    fig.suptitle(f"pbs.attention(q, k, v) with the defaults against cuDNN SDPA, {result.get('device', '')}, "
                 f"revision {result.get('git_revision', '?')}", fontsize=10)
    save_figure(fig, args.out, f"{len(rows)} rows", dpi=120)


if __name__ == "__main__":
    main()
