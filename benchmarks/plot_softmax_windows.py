"""The two consumer warpgroups of the Gluon kernel, step by step, as a picture.

Reads a `scripts/kernel_softmax_windows.py` result (its ``timeline`` of one tile per row) and draws,
for each row (length, density, precision), both warpgroups' steps on a clock axis: from the step's
keys ready to its products issued, to its scores ready, to its exponentials issued, then to the
previous ``P V`` retired, then to its weights ready (the white gap is the rest of the step: the
accumulator's rescale, the weights' conversion, the wait for the next keys). Lock-step warpgroups
show their bars one above the other; a ping-pong, staggered by half a step.

    python benchmarks/plot_softmax_windows.py benchmarks/results/kernel/h200_softmax_windows_six_stamps.json \
        --out docs/images/softmax_windows.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: python3 benchmarks/<this file>.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import save_figure  # noqa: E402

PHASES = (  # (from point, to point, label, colour)
    ("keys_ready", "issued", "keys ready -> products issued", "tab:olive"),
    ("issued", "scores", "-> scores ready", "tab:green"),
    ("scores", "exponentials", "-> exponentials issued", "tab:orange"),
    ("exponentials", "pv_retired", "-> previous P V retired", "tab:grey"),
    ("pv_retired", "weights", "-> weights ready", "tab:blue"),
)


def bars(timeline: dict, warpgroup: int, start: str, end: str) -> list[tuple[float, float]]:
    """``(start, length)`` in cycles of one phase in every step of one warpgroup."""
    if start not in timeline["points"]:  # a result from the script's four-stamp version
        return []
    i, j = timeline["points"].index(start), timeline["points"].index(end)
    return [(step[i], step[j] - step[i]) for step in timeline["cycles"][warpgroup]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("result", type=Path, help="a kernel_softmax_windows.py JSON file")
    parser.add_argument("--out", type=Path, default=Path("docs/images/softmax_windows.png"))
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(args.result.read_text())
    rows = [row for row in result["rows"] if "timeline" in row]
    if not rows:
        raise SystemExit(f"{args.result} has no timeline (made by kernel_softmax_windows.py before it kept one)")
    fig, axes = plt.subplots(len(rows), 1, figsize=(10, 1.6 * len(rows) + 1.0), squeeze=False)
    for ax, row in zip(axes[:, 0], rows):
        for warpgroup in (0, 1):
            for start, end, label, colour in PHASES:
                ax.broken_barh(bars(row["timeline"], warpgroup, start, end), (warpgroup - 0.35, 0.7), color=colour,
                               label=label if warpgroup == 0 else None)
        ax.set_yticks([0, 1], ["warpgroup 0", "warpgroup 1"])
        ax.invert_yaxis()
        precision = "e4m3" if row["precision"] == "fp8" else "bf16"
        ax.set_title(f"{precision}, N = {row['n'] // 1024}K, density {row['density']:.1f}: offset "
                     f"{row['offset_over_step_median']:.2f} of a step, overlapping in "
                     f"{row['share_overlapping_over_half']:.1%} of steps", fontsize=9)
    axes[-1, 0].set_xlabel(f"SM cycles from the tile's first stamped step ({result.get('device', 'GPU')})")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", fontsize=8, ncol=5, frameon=False)
    save_figure(fig, args.out, "softmax windows", rect=(0, 0.07, 1, 1))


if __name__ == "__main__":
    main()
