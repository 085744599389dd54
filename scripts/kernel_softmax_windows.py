"""Whether the Gluon kernel's two consumer warpgroups compute their softmax at the same time.

Writes an instrumented copy of ``pbs/kernels/hopper_attn.py`` (into ``--workdir``) in which both
consumer warpgroups store ``%clock64`` six times in each step of the loop over a tile's blocks
(steps 1 to ``STEPS - 1``): when the step's keys are ready (after the wait for the producer's K
tile), when its products are issued (``S = Q K^T`` and the previous step's ``P V``), when its
scores are ready (after the wait for ``S``), when its exponentials are issued (after
``_softmax_step``), when the previous step's ``P V`` has retired (after ``_wait_pv``) and when its
weights are ready (after ``_weights``, the end of the step). The two warpgroups of a tile run on
one SM, so their clocks compare.

On the kernel benchmark's inputs (`benchmarks.common.kernel_plan`), in bf16 and e4m3
(``precision="fp8"``), it prints per point the median step (scores to the next step's scores,
first warpgroup), the median softmax window (scores to weights) and its three parts, the three
parts from the previous step's weights to the scores (first warpgroup), the median offset between
the warpgroups' scores of the same step, and the share of steps whose two windows overlap by more
than half of the shorter one. The stamps bound the order in which instructions issue, not when
their arithmetic ends: ptxas moves pure arithmetic across them (the accumulator's rescale and the
weights' conversion issue after the weights stamp, in the next part). One tile's first steps are
kept whole for a picture (`benchmarks/plot_softmax_windows.py`). Lock-step warpgroups show offsets
near 0 and overlaps near 1; a ping-pong, offsets near half a step and no overlap.

    python3 scripts/kernel_softmax_windows.py --json $OUT/softmax_windows.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    environment, instrumented_kernel, kernel_inputs, kernel_plan, launch_with_stamps, save,
)
from pbs.kernels import hopper_attn  # noqa: E402
from pbs.kernels._common import sm_count  # noqa: E402
from pbs.kernels.block_sparse_attn import prepare_call  # noqa: E402

STEPS = 64  # steps per tile stamped (the first STEPS - 1 of the loop)

# In each step: keys_ready, issued, scores, exponentials, pv_retired, weights (the slots' order
# keeps the softmax window's four first).
POINTS = ["scores", "exponentials", "pv_retired", "weights", "keys_ready", "issued"]
SOFTMAX = POINTS[:4]
# (anchor, which stamp): each stamp goes after the line that starts with its anchor, inside the
# loop over the blocks.
ANCHORS = [
    ("                s = _float_scores(warpgroup_mma_wait(1, deps=[s]), QK_INT8)", 0),
    ("                m_i, l_i, p_f32, alpha = _softmax_step(", 1),
    ("                acc = _wait_pv(acc, p, PV_FP8)", 2),
    ("                p = _weights(p_f32, p_layout, p_dtype, PV_FP8)", 3),
    ("                mbarrier.wait(k_ready.index(slot), phase)", 4),
    ("                step_scale = next_scale", 5),
]
SLOTS = len(POINTS)


COUNT_ANCHOR = "        n_unmasked = count\n"  # the tile's block count goes to its step 0 (never stamped)


def instrumented_source(src: str) -> str:
    """The kernel module's source with the six stamps per step and each tile's block count (see
    the module docstring)."""
    if src.count(COUNT_ANCHOR) != 1:
        raise SystemExit(f"anchor not found once in hopper_attn.py: {COUNT_ANCHOR!r}")
    cut = src.index(COUNT_ANCHOR) + len(COUNT_ANCHOR)
    src = (src[:cut] + f"        if WG == 0:\n            gl.store(ptrs[14] + rank.to(gl.int64) * {2 * STEPS * SLOTS}, "
           f"count.to(gl.int64))\n" + src[cut:])
    for anchor, which in ANCHORS:
        if src.count("\n" + anchor) != 1:
            raise SystemExit(f"anchor not found once in hopper_attn.py: {anchor!r}")
        cut = src.index("\n", src.index("\n" + anchor) + 1) + 1
        pad = " " * 16
        stamp = (f"{pad}if it < {STEPS}:\n{pad}    gl.store(ptrs[14] + ((rank.to(gl.int64) * 2 + WG) * {STEPS} + it) * {SLOTS}"
                 f" + {which}, gl.inline_asm_elementwise(\"mov.u64 $0, %clock64;\", \"=l,r\", [rank], "
                 f"dtype=gl.int64, is_pure=False, pack=1))\n")
        src = src[:cut] + stamp + src[cut:]
    return src


def summarize(stamps: torch.Tensor) -> dict:
    """Medians over every stamped step (1 to count - 1) of every tile.

    ``stamps``: ``(tiles, 2, STEPS, SLOTS)`` int64 by tile rank (warpgroup, step, point of
    ``POINTS``), the tile's block count at ``[:, 0, 0, 0]``."""
    s = stamps.double()
    steps = stamps[:, 0, 0, 0].clamp(max=STEPS)
    at = {point: POINTS.index(point) for point in POINTS}
    scores0, weights0 = s[:, 0, :, at["scores"]], s[:, 0, :, at["weights"]]
    scores1, weights1 = s[:, 1, :, at["scores"]], s[:, 1, :, at["weights"]]
    index = torch.arange(STEPS)
    stamped = (index[None, :] >= 1) & (index[None, :] < steps[:, None])  # steps 1 .. count - 1
    has_next = stamped & (index[None, :] + 1 < steps[:, None])
    period = (scores0[:, 1:] - scores0[:, :-1])[has_next[:, :-1]]
    window0, window1 = (weights0 - scores0)[stamped], (weights1 - scores1)[stamped]
    offset = (scores1 - scores0)[stamped]
    overlap = (torch.minimum(weights0, weights1) - torch.maximum(scores0, scores1)).clamp(min=0)[stamped]
    shorter = torch.minimum(window0, window1).clamp(min=1)

    def part(a: str, b: str) -> float:
        return float((s[:, 0, :, at[b]] - s[:, 0, :, at[a]])[stamped].median())

    # From the previous step's weights (step 1's previous step, 0, is not stamped) to the keys.
    has_previous = stamped & (index[None, :] >= 2)
    to_keys = (s[:, 0, 1:, at["keys_ready"]] - weights0[:, :-1])[has_previous[:, 1:]]
    return {"steps": int(stamped.sum()), "step_cycles": float(period.median()),
            "softmax_window_cycles_wg0": float(window0.median()), "softmax_window_cycles_wg1": float(window1.median()),
            "offset_cycles_median_abs": float(offset.abs().median()),
            "offset_over_step_median": float(offset.abs().median() / period.median()),
            "share_overlapping_over_half": float((overlap / shorter > 0.5).double().mean()),
            **{f"{a}->{b}_cycles_wg0": part(a, b) for a, b in zip(SOFTMAX, SOFTMAX[1:])},
            "weights->next keys_ready_cycles_wg0": float(to_keys.median()) if to_keys.numel() else float("nan"),
            "keys_ready->issued_cycles_wg0": part("keys_ready", "issued"),
            "issued->scores_cycles_wg0": part("issued", "scores")}


TIMELINE_STEPS = 12  # steps of one tile kept whole for a picture (benchmarks/plot_softmax_windows.py)


def timeline(stamps: torch.Tensor) -> dict:
    """One tile's stamps, whole, for a picture: the tile with the most stamped steps (the first such
    rank), steps 1 to ``TIMELINE_STEPS``, as cycles after its first warpgroup's first scores.

    Returns ``{"rank": r, "points": POINTS, "cycles": [[[...] per point] per step] per warpgroup}``."""
    steps = stamps[:, 0, 0, 0].clamp(max=STEPS)
    rank = int(steps.argmax())
    last = min(int(steps[rank]), TIMELINE_STEPS + 1)
    tile = stamps[rank, :, 1:last, :]
    return {"rank": rank, "points": POINTS, "cycles": (tile - tile[0, 0, 0]).tolist()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", nargs="+", default=["32768:1.0", "65536:0.3"], help="N:density")
    parser.add_argument("--precisions", nargs="+", default=["native", "fp8"], choices=["native", "fp8"])
    parser.add_argument("--workdir", default="/tmp/pbs_softmax_windows")
    parser.add_argument("--json")
    args = parser.parse_args()
    stamped = instrumented_kernel(instrumented_source(Path(hopper_attn.__file__).read_text()), args.workdir,
                                  "hopper_windows")
    result = {**environment("cuda"), "steps_stamped": STEPS, "rows": []}
    sms = sm_count(torch.device("cuda"))
    for spec in args.points:
        n, density = int(spec.split(":")[0]), float(spec.split(":")[1])
        q, k, v = kernel_inputs(n)
        plan = kernel_plan(q, k, density)
        kp, vp = plan.key_permutation.apply(k), plan.key_permutation.apply(v)
        for precision in args.precisions:
            call = prepare_call(q, kp, vp, plan.mask, None, plan.key_positions(), None, True, None)
            stamped.quantize_for_hopper(call, precision)
            tiles = call.counts.numel()
            stamps = torch.zeros(tiles * 2 * STEPS * SLOTS, dtype=torch.int64, device="cuda")
            launch_with_stamps(stamped, call, sms, stamps)
            stamps = stamps.view(tiles, 2, STEPS, SLOTS).cpu()
            row = {"n": n, "density": plan.density, "precision": precision, **summarize(stamps),
                   "timeline": timeline(stamps)}
            result["rows"].append(row)
            print(json.dumps({key: value for key, value in row.items() if key != "timeline"}), flush=True)
            call = stamps = None
        plan = kp = vp = q = k = v = None
        torch.cuda.empty_cache()
    if args.json:
        save(result, args.json)


if __name__ == "__main__":
    main()
