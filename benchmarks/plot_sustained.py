"""A rested GPU against a busy one, as a picture: each back-to-back call's time over the first
call's, and the SM clock meanwhile, from a `bench_sustained.py` result.

Left: call ``i``'s time over call 0's, for pbs's attention kernel (solid) and cuDNN (dashed), one
colour per length. Right: the SM clock ``nvidia-smi`` read every 50 ms during each sequence.

    python benchmarks/plot_sustained.py benchmarks/results/defaults/sustained_h200_46eff0f.json \
        --out docs/images/sustained_h200.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: python3 benchmarks/<this file>.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import save_figure  # noqa: E402

CALLS = {"pbs_run": ("pbs (attention kernel, defaults' plan)", "-"), "cudnn": ("cuDNN dense", "--")}


def relative(times: list[float]) -> list[float]:
    """Each call's time over the first call's."""
    return [t / times[0] for t in times]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("result", type=Path, help="a bench_sustained.py JSON file")
    parser.add_argument("--out", type=Path, default=Path("docs/images/sustained.png"))
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(args.result.read_text())
    fig, (times_ax, clock_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for colour, point in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], result["points"]):
        n = f"{point['seq_len'] // 1024}K"
        for name, (label, style) in CALLS.items():
            if name not in point:
                continue
            calls = point[name]["calls_ms"]
            times_ax.plot(range(len(calls)), relative(calls), style, color=colour, label=f"{n}, {label}")
            clocks = [clock for clock, _ in point[name].get("samples", [])]
            if clocks:
                seconds = [i * 0.05 for i in range(len(clocks))]
                clock_ax.plot(seconds, clocks, style, color=colour, label=f"{n}, {label}")
    times_ax.set(xlabel="call, back to back after a rest", ylabel="time over the first call's",
                 title=f"{result.get('device', '')}: each call against the first, after a rest")
    clock_ax.set(xlabel="seconds into the sequence", ylabel="SM clock (MHz)", title="SM clock at the power cap")
    times_ax.axhline(1.0, color="grey", lw=0.5)
    times_ax.legend(fontsize=7)
    clock_ax.legend(fontsize=7)
    save_figure(fig, args.out, "sustained calls")


if __name__ == "__main__":
    main()
