"""Where the capturable varlen call spends its time: a CUDA profile of its padding, planning and
unpadding on the mixed batch of `benchmarks/bench_capturable.py`, kernels sorted by GPU time, and
the eager path's planning of the same prompts beside it.

    python3 scripts/profile_capturable.py [--lengths 16384 32768 65536 131072]

``--attention`` times the one padded launch against each sequence's launch on its own rows of the
same lists (the eager path's shape), and the shortest sequence alone in list mode against cuDNN:
what of the launch's time (with the rows' way to the packed output) is the batch's and what is the
work's.
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


def attention_split(lengths: list[int], q, k, v, cu, config, scale: float) -> None:
    from pbs.kernels.hopper_attn import hopper_block_sparse_attention
    from pbs.layout import Layout, cdiv
    from pbs.types import BlockMask

    max_len = max(lengths)
    packed = capturable.capturable_backend(config, q, v, False).ragged_rows
    geometry, queries, k_pad, v_pad = capturable.pad_batch(q, k, v, cu, cu, max_len, max_len, config.block_size,
                                                           packed_queries=packed)
    q_pad = capturable.pad_packed(q, cu, geometry.padded_len_q)
    mask, _ = capturable.plan_ragged(config, geometry, queries, k_pad, scale, cu if packed else None)
    positions = geometry.query_positions()
    out = torch.empty_like(q)
    padded_ms = time_ms(lambda: capturable.attend_padded(config, queries, k_pad, v_pad, mask, positions, scale, out,
                                                         cu, False))
    alone = []
    for b, length in enumerate(lengths):
        tiles = cdiv(length, config.block_size)
        layout = Layout(1, q.shape[1], k.shape[1], length, length, config.block_size, config.block_size,
                        causal=True, segmented=False)
        rows = (slice(b, b + 1), slice(None), slice(0, tiles))
        own = BlockMask(mask.counts[rows].contiguous(), mask.indices[rows][..., :tiles].contiguous(), layout,
                        mask.full_counts[rows].contiguous())
        alone.append(tuple(x[b:b + 1, :, :length] for x in (q_pad, k_pad, v_pad)) + (own,))
    per_sequence = [time_ms(lambda a=a: hopper_block_sparse_attention(*a[:3], a[3], scale=scale)) for a in alone]
    first = alone[0]
    cudnn_ms = time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
        first[0], first[1], first[2], is_causal=True, enable_gqa=True))
    density = [float(a[3].counts.sum()) / float(a[3].layout.num_query_blocks * (a[3].layout.num_query_blocks + 1)
                                                / 2 * q.shape[1]) for a in alone]
    print(f"padded launch {padded_ms:.2f} ms; each sequence alone {[round(t, 2) for t in per_sequence]} "
          f"(sum {sum(per_sequence):.2f}); list density {[round(d, 3) for d in density]}; "
          f"cuDNN on sequence 0 {cudnn_ms:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--only-plan", action="store_true", help="profile planning only, with input shapes")
    parser.add_argument("--attention", action="store_true", help="the padded launch against each sequence's")
    args = parser.parse_args()
    views, (q, k, v, cu) = packed_prompts(args.lengths, 32, 8, 128)
    max_len = max(args.lengths)
    config = pbs.PBSConfig()
    scale = q.shape[-1] ** -0.5
    geometry, q_pad, k_pad, v_pad = capturable.pad_batch(q, k, v, cu, cu, max_len, max_len, config.block_size)
    if args.attention:
        attention_split(args.lengths, q, k, v, cu, config, scale)
        return
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
