"""Where planning time goes on the GPU: wall time per plan, the GPU's busy time (sum of kernel
durations) and launch count, torch.profiler's top CUDA kernels, and the host's top functions.

    python3 scripts/profile_selector.py --selector '{"name": "vertical_slash", "threshold": 0.6}' --n 16384 131072
    python3 scripts/profile_selector.py --defaults --n 16384 32768 131072   # PBSConfig() with planning forced
    python3 scripts/profile_selector.py --defaults --n 131072 --chunk 8192  # the last 8K queries (chunked prefill)

Where the wall time is well above the GPU's busy time, planning is host-bound (launch overhead):
the host table then says which Python functions pay for it.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch

import pbs
from pbs.testing import make_qkv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--selector", default='{"name": "vertical_slash", "threshold": 0.6}')
    parser.add_argument("--permuter", default="none")
    parser.add_argument("--defaults", action="store_true", help="profile PBSConfig() (selector/permuter ignored)")
    parser.add_argument("--n", type=int, nargs="+", default=[16384, 131072])
    parser.add_argument("--chunk", type=int, default=None,
                        help="plan only the last CHUNK queries against all N keys (a chunk of chunked prefill)")
    parser.add_argument("--rows", type=int, default=25, help="profiler table rows")
    parser.add_argument("--host-rows", type=int, default=30, help="cProfile rows")
    args = parser.parse_args()
    no_fallback = {"min_seq_len": 0, "max_density": None}
    if args.defaults:
        config = pbs.PBSConfig(dense_fallback=no_fallback)
    else:
        config = pbs.PBSConfig(permuter=args.permuter, selector=json.loads(args.selector), dense_fallback=no_fallback)
    print(config.model_dump_json())
    for n in args.n:
        q, k, _ = make_qkv(batch=1, heads_q=32, heads_kv=8, seq_len=n, head_dim=128, dtype=torch.bfloat16,
                           device="cuda", seed=0)
        if args.chunk is not None:
            q = q[:, :, -args.chunk:]
        for _ in range(3):
            pbs.plan(q, k, config)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            pbs.plan(q, k, config)
        torch.cuda.synchronize()
        wall = 1e3 * (time.perf_counter() - start) / 5
        torch.cuda.synchronize()
        start = time.perf_counter()
        pbs.plan(q, k, config)
        host = 1e3 * (time.perf_counter() - start)  # returns once the work is queued (no sync inside)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            pbs.plan(q, k, config)
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        busy = sum(e.device_time for e in kernels) / 1e3
        print(f"N={n}, Nq={q.shape[2]}: plan {wall:.3f} ms wall per call, host {host:.3f} ms to queue one plan, "
              f"GPU busy {busy:.3f} ms in {len(kernels)} kernels")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(5):
            pbs.plan(q, k, config)
        profiler.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.host_rows)
        print(f"host functions over 5 plans at N={n} (tottime):")
        print(text.getvalue())
        del q, k


if __name__ == "__main__":
    main()
