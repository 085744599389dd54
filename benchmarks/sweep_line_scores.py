"""Launch-parameter sweep of the ``vertical_slash`` line kernels on the GPU (pbs/kernels/vertical_slash.py).

    python3 benchmarks/sweep_line_scores.py --json $OUT/line_scores_sweep.json
    python3 benchmarks/sweep_line_scores.py --kernel kept_lines --json $OUT/kept_lines_sweep.json

The part of the defaults' planning that does not shrink with a chunk's queries, for B=1, Hq=32,
Hkv=8, D=128, bf16, in a fresh process per variant; prints ms per length
(benchmarks/results/planning):

* ``--kernel row_lines`` (default): `pbs.kernels.vertical_slash.line_scores` (the last 64 queries
  against every key), each variant ``key_tile,programs_per_sm,warps,stages,heads_per_program`` of
  its ``_row_lines`` launch (the module's ``KEY_TILE``, ``PROGRAMS_PER_SM`` and
  ``LINES_HEADS_PER_PROGRAM``, which ``_row_stats`` shares; warps and stages passed to the launch;
  without the fifth, 1 head);
* ``--kernel kept_lines``: `pbs.kernels.vertical_slash.kept_line_blocks` on those scores (the
  cumulative threshold of both kinds of line: one program per line), each variant
  ``tile,warps,digit_bits,compact_after`` of its ``_kept_lines`` launch (the module's
  ``KEPT_LINES_TILES``, ``KEPT_LINES_WARPS``, ``KEPT_LINES_DIGIT_BITS`` and
  ``KEPT_LINES_COMPACT_AFTER``; without the third, 4 bits; without the fourth or 0, no compaction).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: python3 benchmarks/sweep_line_scores.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import environment, save  # noqa: E402

# The first variant of each list is the module's default launch.
VARIANTS = {
    "row_lines": ["64,8,4,2,2", "64,8,4,2,1", "64,8,8,2,2", "64,8,8,2,4", "64,2,8,2,4", "64,4,4,2,2", "64,8,4,3,2",
                  "32,8,4,2,2"],
    "kept_lines": ["8192,16,4,3", "8192,16,4", "8192,16,4,2", "8192,16,4,4", "8192,16,2,6", "8192,8,4,3",
                   "4096,16,4,3", "8192,16,2"],
}

# Run in the child process: the inputs, then one kernel's variant set up by a body below.
PRELUDE = r"""
import json, sys, torch, pbs
import pbs.kernels.vertical_slash as vs
from pbs.planning import make_layout
from pbs.testing import benchmark_cuda
variant = [int(x) for x in sys.argv[1].split(",")]
lengths = [int(x) for x in sys.argv[2:]]


def inputs(n):
    q = torch.randn(1, 32, n, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, n, 128, device="cuda", dtype=torch.bfloat16)
    return q, k, make_layout(q, k, pbs.PBSConfig())


class WithLaunchOptions:
    # A kernel whose launches take `options` (warps, stages) over the launcher's own.
    def __init__(self, kernel, **options):
        self.kernel, self.options = kernel, options

    def __getitem__(self, grid):
        return lambda *a, **kw: self.kernel[grid](*a, **{**kw, **self.options})
"""

ROW_LINES = PRELUDE + r"""
key_tile, per_sm, warps, stages, heads = variant if len(variant) == 5 else (*variant, 1)
vs.KEY_TILE, vs.PROGRAMS_PER_SM, vs.LINES_HEADS_PER_PROGRAM = key_tile, per_sm, heads
vs._row_lines = WithLaunchOptions(vs._row_lines, num_warps=warps, num_stages=stages)
out = {}
for n in lengths:
    q, k, layout = inputs(n)
    out[n] = benchmark_cuda(lambda: vs.line_scores(q, k, layout, 128 ** -0.5, 64), warmup=3, iters=10)
print(json.dumps(out))
"""

KEPT_LINES = PRELUDE + r"""
tile, warps, bits, compact_after = (*variant, *(None, None, 4, 0)[len(variant):])
vs.KEPT_LINES_TILES = (tile, tile)
vs.KEPT_LINES_WARPS = warps
vs.KEPT_LINES_DIGIT_BITS = bits
vs.KEPT_LINES_COMPACT_AFTER = compact_after or None
out = {}
for n in lengths:
    q, k, layout = inputs(n)
    scores = vs.line_scores(q, k, layout, 128 ** -0.5, 64)
    out[n] = benchmark_cuda(lambda: vs.kept_line_blocks(scores, 0.75, None, 128), warmup=3, iters=10)
print(json.dumps(out))
"""

CHILDREN = {"row_lines": ROW_LINES, "kept_lines": KEPT_LINES}
FIELDS = {"row_lines": "key_tile,programs_per_sm,warps,stages,heads_per_program", "kept_lines": "tile,warps,digit_bits,compact_after"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--kernel", choices=list(CHILDREN), default="row_lines")
    parser.add_argument("--variants", nargs="+", default=None, help="default: VARIANTS[--kernel]")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for variant in args.variants or VARIANTS[args.kernel]:
        argv = [sys.executable, "-c", CHILDREN[args.kernel], variant, *map(str, args.lengths)]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        if proc.returncode:
            rows.append({"variant": variant, "error": proc.stderr[-400:]})
        else:
            rows.append({"variant": variant, "ms": json.loads(proc.stdout.strip().splitlines()[-1])})
        print(rows[-1], flush=True)
    result = {**environment("cuda"), "kernel": args.kernel, "lengths": args.lengths,
              "variant_fields": FIELDS[args.kernel], "rows": rows}
    if args.json:
        save(result, args.json)


if __name__ == "__main__":
    main()
