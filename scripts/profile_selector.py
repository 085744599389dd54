"""Where a selector's planning time goes on the GPU: torch.profiler's top CUDA kernels and host time.

    python3 scripts/profile_selector.py --selector '{"name": "vertical_slash", "threshold": 0.6}' --n 16384 131072
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import pbs
from pbs.testing import make_qkv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--selector", default='{"name": "vertical_slash", "threshold": 0.6}')
    parser.add_argument("--permuter", default="none")
    parser.add_argument("--n", type=int, nargs="+", default=[16384, 131072])
    parser.add_argument("--rows", type=int, default=25, help="profiler table rows")
    args = parser.parse_args()
    config = pbs.PBSConfig(permuter=args.permuter, selector=json.loads(args.selector),
                           dense_fallback={"min_seq_len": 0, "max_density": None})
    for n in args.n:
        q, k, _ = make_qkv(batch=1, heads_q=32, heads_kv=8, seq_len=n, head_dim=128, dtype=torch.bfloat16,
                           device="cuda", seed=0)
        for _ in range(3):
            pbs.plan(q, k, config)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            pbs.plan(q, k, config)
        torch.cuda.synchronize()
        print(f"N={n}: plan {1e3 * (time.perf_counter() - start) / 5:.3f} ms wall per call")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            pbs.plan(q, k, config)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
