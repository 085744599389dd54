"""Tile sweep of the antidiagonal share kernel on the GPU (pbs/kernels/antidiagonal.py).

    python3 benchmarks/sweep_antidiagonal.py --json $OUT/antidiagonal_sweep.json

Times ``antidiagonal_block_shares`` for all 32 heads (B=1, Hq=32, Hkv=8, D=128, bf16, block 128,
stride 8 or ``--stride``) with each ``gpu_tile`` variant (rows,keys,warps,stages), walking the logits
in two passes or (``--walks two one``) also in one, in a fresh process per variant so that a variant
that fails to compile or run cannot disturb the others; prints ms (benchmarks/results/kernel).

    python3 benchmarks/sweep_antidiagonal.py --stride 16 --lengths 131072 --variants 128,128,8,3 --walks two one
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: python3 benchmarks/sweep_antidiagonal.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import environment, save  # noqa: E402

VARIANTS = ["64,128,4,3", "128,128,8,3", "128,128,8,2", "128,64,4,3", "256,128,8,2"]

CHILD = r"""
import json, sys, torch, pbs
from pbs.kernels.antidiagonal import antidiagonal_block_shares
from pbs.planning import make_layout
from pbs.testing import benchmark_cuda
tile = tuple(int(x) for x in sys.argv[1].split(","))
stride = int(sys.argv[2])
one_pass = sys.argv[3] == "one"
out = {}
for n in [int(x) for x in sys.argv[4:]]:
    q = torch.randn(1, 32, n, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, n, 128, device="cuda", dtype=torch.bfloat16)
    layout = make_layout(q, k, pbs.PBSConfig(permuter="last_block"))  # segmented, as measured
    fn = lambda: antidiagonal_block_shares(q, k, layout, stride, 128 ** -0.5, gpu_tile=tile, one_pass=one_pass)
    out[n] = benchmark_cuda(fn, warmup=2, iters=5)
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--stride", type=int, default=8)
    parser.add_argument("--variants", nargs="+", default=VARIANTS, help="rows,keys,warps,stages per variant")
    parser.add_argument("--walks", nargs="+", choices=["two", "one"], default=["two"],
                        help="two: statistics, then shares (one_pass=False); one: one_pass=True (the default walk within its scratch budget)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for variant in args.variants:
        for walk in args.walks:
            argv = [sys.executable, "-c", CHILD, variant, str(args.stride), walk, *map(str, args.lengths)]
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=150)
            if proc.returncode:
                rows.append({"variant": variant, "walk": walk, "error": proc.stderr[-400:]})
            else:
                rows.append({"variant": variant, "walk": walk, "ms": json.loads(proc.stdout.strip().splitlines()[-1])})
            print(rows[-1], flush=True)
    if args.json:
        save({**environment("cuda"), "lengths": args.lengths, "stride": args.stride, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
