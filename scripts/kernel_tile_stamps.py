"""Where the Gluon kernel's time goes, tile by tile, and its device time against another revision.

Writes an instrumented copy of ``pbs/kernels/hopper_attn.py`` (into ``--workdir``) whose first
consumer warpgroup stores ``%clock64`` at ten points of every tile (received, Q ready, first
scores, loop end, last P V, output slot free, output in shared memory, TMA store issued, its read
done, tile end) with the tile's block count and SM. On the kernel benchmark's inputs it then prints
the median cycles between consecutive points, the median gap between one SM's tiles and the share
of each SM's span spent inside tiles. With ``--before`` (a copy of the module from another
revision) it also times both kernels alternately with the GPU kept busy while the host launches
(device time) and idle (what the kernel benchmark's protocol sees: host time included).

The anchors below name lines of the kernel's consumer; an edit there that moves them stops the
script with the anchor it could not find.

    python3 scripts/kernel_tile_stamps.py --before /tmp/hopper_before.py --json $OUT/stamps.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import kernel_plan as make_plan  # noqa: E402
from benchmarks.common import (  # noqa: E402
    BUSY_GPU_CYCLES, environment, instrumented_kernel, kernel_inputs, launch_with_stamps, load_module_file, save,
)
from pbs.kernels import hopper_attn  # noqa: E402
from pbs.kernels._common import sm_count  # noqa: E402
from pbs.kernels.block_sparse_attn import prepare_call  # noqa: E402
from pbs.testing import benchmark_cuda_interleaved  # noqa: E402

POINTS = ["received", "q_ready", "first_scores", "loop_end", "last_pv", "slot_free", "in_shared", "tma_issued",
          "read_done", "end"]
SLOTS = 16  # int64 per tile: the ten points, then the block count (14) and the SM (15)

# (anchor, point, indent, where): the stamp goes after the anchor's line ("after") or before it.
ANCHORS = [
    ("        n_unmasked = count\n", 0, 8, "after"),
    ("        mbarrier.wait(q_ready, t & 1)\n", 1, 8, "after"),
    ("            s = _float_scores(warpgroup_mma_wait(0, deps=[s]), QK_INT8)\n"
     "            _release_keys(k_empty, o_staged, slot, count == 1",
     2, 12, "after_first_line"),
    ("            mbarrier.arrive(q_empty)\n            mbarrier.wait(v_ready.index(prev_slot), prev_phase)\n", 3, 12,
     "after_first_line"),
    ("            acc = _wait_pv(acc, p, PV_FP8)\n            mbarrier.arrive(v_empty.index(prev_slot))\n        else:",
     4, 12, "after_first_line"),
    ("                mbarrier.wait(o_staged, staged & 1)\n", 5, 16, "after"),
    ("                _partition_barrier()\n", 6, 16, "after"),
    ("                _tma_store(o_desc, [i_b, i_hq, row0 + WG * HALF, 0], staging)\n", 7, 16, "after"),
    ("                tma.store_wait(0)\n", 8, 16, "after"),
    ("        t += 1\n        rank = _next_tile(t, tile_ids, tile_ready, tile_empty)", 9, 8, "before"),
]
END = len(POINTS) - 1


def _stamp(point: int, indent: int) -> str:
    pad = " " * indent
    return (f"{pad}if WG == 0:\n{pad}    gl.store(ptrs[14] + rank.to(gl.int64) * {SLOTS} + {point}, "
            f"gl.inline_asm_elementwise(\"mov.u64 $0, %clock64;\", \"=l,r\", [rank], dtype=gl.int64, "
            f"is_pure=False, pack=1))\n")


def instrumented_source(src: str) -> str:
    """The kernel module's source with the stamps in (see the module docstring)."""
    for anchor, point, indent, where in ANCHORS:
        if src.count(anchor) != 1:
            raise SystemExit(f"anchor not found once in hopper_attn.py: {anchor!r}")
        at = src.index(anchor)
        if where == "after":
            cut = at + len(anchor)
        elif where == "after_first_line":
            cut = src.index("\n", at) + 1
        else:
            cut = at
        extra = _stamp(point, indent)
        if point == END:
            pad = " " * indent
            extra += (f"{pad}if WG == 0:\n{pad}    gl.store(ptrs[14] + rank.to(gl.int64) * {SLOTS} + 14, "
                      f"count.to(gl.int64))\n{pad}if WG == 0:\n{pad}    gl.store(ptrs[14] + rank.to(gl.int64) * "
                      f"{SLOTS} + 15, gl.inline_asm_elementwise(\"mov.u32 $0, %smid;\", \"=r,r\", [rank], "
                      f"dtype=gl.int32, is_pure=False, pack=1).to(gl.int64))\n")
        src = src[:cut] + extra + src[cut:]
    return src


def summarize(stamps: torch.Tensor) -> dict:
    """Median cycles between consecutive points (tiles with blocks), gaps between an SM's tiles."""
    s = stamps.double()
    counts, sms = s[:, 14], s[:, 15]
    with_blocks = counts > 0
    result = {"mean_count": float(counts.mean())}
    for a, b in zip(POINTS, POINTS[1:]):
        i, j = POINTS.index(a), POINTS.index(b)
        result[f"{a}->{b}"] = float((s[with_blocks, j] - s[with_blocks, i]).median())
    result["tile"] = float((s[with_blocks, END] - s[with_blocks, 0]).median())
    gaps, busy, span = [], 0.0, 0.0
    for sm in sms.unique():
        rows = s[sms == sm]
        rows = rows[rows[:, 0].argsort()]
        gaps.append(rows[1:, 0] - rows[:-1, END])
        busy += float((rows[:, END] - rows[:, 0]).sum())
        span += float(rows[-1, END] - rows[0, 0])
    result["gap_between_tiles"] = float(torch.cat(gaps).median())
    result["busy_share_of_span"] = busy / span
    result["span_cycles_per_sm"] = span / len(sms.unique())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="a copy of pbs/kernels/hopper_attn.py to time against (device time)")
    parser.add_argument("--points", nargs="+", default=["16384:0.1", "16384:1.0", "65536:0.1"], help="N:density")
    parser.add_argument("--workdir", default="/tmp/pbs_tile_stamps")
    parser.add_argument("--json")
    args = parser.parse_args()
    stamped = instrumented_kernel(instrumented_source(Path(hopper_attn.__file__).read_text()), args.workdir,
                                  "hopper_stamps")
    before = load_module_file("hopper_before", args.before) if args.before else None
    result = {**environment("cuda"), "points": POINTS, "before": args.before, "rows": []}
    sms = sm_count(torch.device("cuda"))
    for spec in args.points:
        n, density = int(spec.split(":")[0]), float(spec.split(":")[1])
        q, k, v = kernel_inputs(n)
        plan = make_plan(q, k, density)
        kp, vp = plan.key_permutation.apply(k), plan.key_permutation.apply(v)
        call = prepare_call(q, kp, vp, plan.mask, None, plan.key_positions(), None, True, None)
        row = {"n": n, "density": plan.density}
        if before is not None:
            fns = {"before": lambda: before.launch_hopper(call, sms), "after": lambda: hopper_attn.launch_hopper(call, sms)}
            row["device_ms"] = benchmark_cuda_interleaved(fns, iters=30, busy_gpu_cycles=BUSY_GPU_CYCLES)
            row["idle_gpu_ms"] = benchmark_cuda_interleaved(fns, iters=30)
        stamps = torch.zeros(call.counts.numel() * SLOTS, dtype=torch.int64, device="cuda")
        launch_with_stamps(stamped, call, sms, stamps)
        row["cycles"] = summarize(stamps.view(-1, SLOTS).cpu())
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        call = plan = kp = vp = None
        torch.cuda.empty_cache()
    if args.json:
        save(result, args.json)


if __name__ == "__main__":
    main()
