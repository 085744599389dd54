"""Where the capturable varlen call spends its time: a CUDA profile of its padding, planning and
unpadding on the mixed batch of `benchmarks/bench_capturable.py`, kernels sorted by GPU time, and
the eager path's planning of the same prompts beside it.

    python3 scripts/profile_capturable.py [--lengths 16384 32768 65536 131072]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pbs  # noqa: E402
from benchmarks.common import packed_prompts, time_ms  # noqa: E402
from pbs.serving import capturable  # noqa: E402


def table(fn, label: str, rows: int, shapes: bool = False) -> None:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU], record_shapes=shapes) as prof:
        fn()
        torch.cuda.synchronize()
    print(f"== {label}: {time_ms(fn):.2f} ms (median, CUDA events)")
    print(prof.key_averages(group_by_input_shape=shapes).table(sort_by="cuda_time_total", row_limit=rows,
                                                               max_name_column_width=40, max_shapes_column_width=90))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--only-plan", action="store_true", help="profile planning only, with input shapes")
    args = parser.parse_args()
    views, (q, k, v, cu) = packed_prompts(args.lengths, 32, 8, 128)
    max_len = max(args.lengths)
    config = pbs.PBSConfig()
    scale = q.shape[-1] ** -0.5
    geometry, q_pad, k_pad, v_pad = capturable.pad_batch(q, k, v, cu, cu, max_len, max_len, config.block_size)
    if args.only_plan:
        table(lambda: capturable.plan_ragged(config, geometry, q_pad, k_pad, scale), "plan_ragged", args.rows, True)
        return
    table(lambda: capturable.pad_batch(q, k, v, cu, cu, max_len, max_len, config.block_size), "pad", args.rows)
    table(lambda: capturable.plan_ragged(config, geometry, q_pad, k_pad, scale), "plan_ragged", args.rows)
    table(lambda: [pbs.plan(*view[:2]) for view in views], "eager pbs.plan per prompt", args.rows)
    out = torch.empty_like(q)
    table(lambda: pbs.varlen_attention(q, k, v, cu, cu, max_len, max_len), "eager varlen", args.rows)
    table(lambda: pbs.varlen_attention(q, k, v, cu, cu, max_len, max_len, out=out, capturable=True),
          "capturable varlen", args.rows)


if __name__ == "__main__":
    main()
