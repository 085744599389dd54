"""The quantized precisions against bf16, as a picture: speed-up and TF/s by density, per length.

Reads a `bench_fp8.py` result and draws, for each sequence length, every timed path's speed-up over
the Gluon kernel in bf16 (the time ``auto`` gets natively on Hopper; quantization included) and its
TF/s on the computed blocks, against the mask's density, with issue 38's targets (1.4x and 900
TF/s). A path is a precision on a kernel: ``fp8`` on Triton (``fp8_ms``) and on the Gluon kernel
(``fp8_hopper_ms``), and so on for every precision the file holds.

    python benchmarks/plot_fp8.py benchmarks/results/kernel/fp8_int8_gluon_h200_aad513e.json \
        --out docs/images/fp8_speedup_h200.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: python3 benchmarks/<this file>.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import save_figure  # noqa: E402

BASELINE = "bf16_hopper_ms"  # the Gluon kernel in bf16
SPEEDUP_TARGET, TFLOPS_TARGET = 1.4, 900.0  # issue 38's, at 64K and more with density 0.3 or more
KERNELS = {"_hopper": "Gluon", "": "Triton"}  # key infix -> label


def paths(points: list[dict]) -> list[tuple[str, str]]:
    """``(key prefix, label)`` of every precision-on-a-kernel the points time, e.g.
    ``("fp8_hopper", "fp8, Gluon")``; the bf16 baselines are not paths."""
    found = []
    for key in points[0]:
        for infix, kernel in KERNELS.items():
            suffix = f"{infix}_attention_ms"
            if key.endswith(suffix) and not key.startswith("bf16"):
                precision = key[: -len(suffix)]
                if f"{precision}{infix}_ms" in points[0]:
                    found.append((f"{precision}{infix}", f"{precision}, {kernel}"))
                break
    return sorted(found, key=lambda path: (path[1].split(", ")[1], path[1]))


def series(points: list[dict], n: int, prefix: str) -> tuple[list[float], list[float], list[float]]:
    """Densities, speed-ups over the bf16 Gluon kernel and TF/s on the computed blocks of one path
    at length ``n`` (points without the path or the baseline are skipped), by density."""
    rows = sorted((p["density"], p[BASELINE] / p[f"{prefix}_ms"], p[f"{prefix}_tflops_blocks"])
                  for p in points if p["n"] == n and f"{prefix}_ms" in p and BASELINE in p)
    return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("result", type=Path, help="a bench_fp8.py JSON file")
    parser.add_argument("--out", type=Path, default=Path("docs/images/fp8_speedup.png"))
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(args.result.read_text())
    points = result["points"]
    lengths = sorted({p["n"] for p in points})
    drawn = paths(points)
    fig, axes = plt.subplots(2, len(lengths), figsize=(3.2 * len(lengths), 6.4), sharey="row", squeeze=False)
    precisions = sorted({label.split(", ")[0] for _, label in drawn})
    colors = {prefix: f"C{precisions.index(label.split(', ')[0])}" for prefix, label in drawn}  # a precision, one color
    for column, n in enumerate(lengths):
        speed_ax, tflops_ax = axes[0][column], axes[1][column]
        for prefix, label in drawn:
            densities, speedups, tflops = series(points, n, prefix)
            style = dict(marker="o", color=colors[prefix], linestyle="-" if prefix.endswith("_hopper") else ":")  # kernel
            speed_ax.plot(densities, speedups, label=label, **style)
            tflops_ax.plot(densities, tflops, **style)
        speed_ax.axhline(1.0, color="black", linewidth=0.6)
        speed_ax.axhline(SPEEDUP_TARGET, color="tab:red", linestyle="--", linewidth=1)
        tflops_ax.axhline(TFLOPS_TARGET, color="tab:red", linestyle="--", linewidth=1)
        speed_ax.set_title(f"N = {n // 1024}K", fontsize=10)
        tflops_ax.set_xlabel("density")
        for ax in (speed_ax, tflops_ax):
            ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("speed-up over bf16 (Gluon kernel)")
    axes[1][0].set_ylabel("TF/s on the computed blocks")
    handles, labels = axes[0][0].get_legend_handles_labels()
    handles.append(plt.Line2D([], [], color="tab:red", linestyle="--"))
    labels.append(f"issue 38's targets ({SPEEDUP_TARGET}x, {TFLOPS_TARGET:.0f} TF/s)")
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize=8)
    fig.suptitle(f"Quantized precisions against bf16, quantization included: {result.get('device', '')}, "
                 f"revision {str(result.get('git_revision', '?'))[:7]}", fontsize=10)
    save_figure(fig, args.out, f"{len(drawn)} paths at {len(lengths)} lengths", dpi=120, rect=(0, 0.07, 1, 1))


if __name__ == "__main__":
    main()
