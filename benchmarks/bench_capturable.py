"""`pbs.varlen_attention(..., capturable=True)` eagerly and replayed from a CUDA graph, against the
eager varlen path it stands in for.

Protocol: the mixed batch of `benchmarks/bench_varlen.py` (structured prompts of 16K, 32K, 64K and
128K tokens, Hq 32, Hkv 8, D 128, bf16, causal, defaults) and a short batch (1K-4K) where the host
work that a graph removes is a larger share. Each batch is captured once at its maxima; the graph
is replayed with the same lengths (what is timed) and, for the correctness line, with the prompts
in another order (new lengths per slot). Timed with CUDA events after warm-up, L2 flushed
(`benchmarks.common.time_ms`); the eager call and the graph are timed in alternation, ``ROUNDS``
times, and ``graph_over_eager`` is the median of the rounds' ratios, so that the card's clock
drift over a run (its kernels run for seconds at a time) does not favour whichever is timed first:

* ``eager``: `pbs.varlen_attention` as it runs by default (per sequence, host read of the lengths);
* ``capturable``: the same call with ``capturable=True``, run eagerly;
* ``graph``: that call replayed from a CUDA graph;
* ``cudnn``: SDPA (cuDNN first) prompt by prompt, dense;
* ``stages_ms``: the capturable call's stages run one by one (padding, planning, attention with
  the rows written packed) and the eager path's planning of the same prompts (`pbs.plan` per prompt).

    python benchmarks/bench_capturable.py --json benchmarks/results/serving/capturable_h100.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: python3 benchmarks/bench_capturable.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pbs  # noqa: E402
from benchmarks.common import environment, graph_of, packed_prompts, save, time_ms  # noqa: E402
from pbs.dense import dense_attention_sdpa  # noqa: E402
from pbs.serving import capturable  # noqa: E402

BATCHES = {"long": [16384, 32768, 65536, 131072], "short": [1024, 2048, 3072, 4096]}
ROUNDS = 5


def stage_times(q, k, v, cu, max_len, views) -> dict:
    """Median ms of each stage of the capturable call (`pbs.serving.capturable`), run eagerly, and
    of the eager path's planning (`pbs.plan` on each prompt)."""
    config = pbs.PBSConfig()
    scale = q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    # The Gluon kernel (ragged_rows) reads the packed queries: only K and V are padded then.
    packed = capturable.capturable_backend(config, q, v, False).ragged_rows
    starts = cu if packed else None

    def pad():
        return capturable.pad_batch(q, k, v, cu, cu, max_len, max_len, config.block_size, packed_queries=packed)

    geometry, queries, k_pad, v_pad = pad()
    mask, _ = capturable.plan_ragged(config, geometry, queries, k_pad, scale, starts)
    positions = geometry.query_positions()
    return {
        "pad_ms": time_ms(pad),
        "plan_ms": time_ms(lambda: capturable.plan_ragged(config, geometry, queries, k_pad, scale, starts)),
        # The launch and the rows' way to the packed output (written by the kernel, or copied).
        "attention_ms": time_ms(lambda: capturable.attend_padded(config, queries, k_pad, v_pad, mask, positions,
                                                                 scale, out, cu, False)),
        "eager_plan_per_prompt_ms": time_ms(lambda: [pbs.plan(*view[:2]) for view in views]),
    }


def measure(lengths: list[int]) -> dict:
    views, (q, k, v, cu) = packed_prompts(lengths, 32, 8, 128)
    max_len = max(lengths)
    out = torch.empty_like(q)
    scale = q.shape[-1] ** -0.5

    def capturable():
        return pbs.varlen_attention(q, k, v, cu, cu, max_len, max_len, out=out, capturable=True)

    def eager():
        return pbs.varlen_attention(q, k, v, cu, cu, max_len, max_len)

    capturable_ms = time_ms(capturable)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    graph = graph_of(capturable)
    peak_gib = (torch.cuda.max_memory_allocated() - before) / 2**30
    rounds = [(time_ms(eager, repeats=1), time_ms(graph.replay, repeats=1)) for _ in range(ROUNDS)]
    eager_ms = statistics.median(e for e, _ in rounds)
    graph_ms = statistics.median(g for _, g in rounds)
    ratio = statistics.median(g / e for e, g in rounds)
    cudnn_ms = time_ms(lambda: [dense_attention_sdpa(*view, scale=scale) for view in views])

    # Correctness: the prompts in reverse order through the same graph (each slot gets new lengths).
    reversed_views, (q2, k2, v2, cu2) = packed_prompts(lengths[::-1], 32, 8, 128)
    for buffer, value in ((q, q2), (k, k2), (v, v2), (cu, cu2)):
        buffer.copy_(value)
    graph.replay()
    replayed = out.clone()
    expected = pbs.varlen_attention(q2, k2, v2, cu2, cu2, max_len, max_len, capturable=True)
    eager = pbs.varlen_attention(q2, k2, v2, cu2, cu2, max_len, max_len)
    agree = ((replayed.float() - eager.float()).abs() <= 2e-2).float().mean().item()
    stages = stage_times(q2, k2, v2, cu2, max_len, reversed_views)
    row = {
        "lengths": lengths, "stages_ms": stages, "eager_ms": eager_ms, "capturable_ms": capturable_ms, "graph_ms": graph_ms,
        "rounds_eager_graph_ms": rounds, "cudnn_per_prompt_ms": cudnn_ms, "graph_over_eager": ratio,
        "graph_over_cudnn": graph_ms / cudnn_ms, "graph_extra_peak_gib": peak_gib,
        "replay_new_lengths_max_abs_diff_vs_capturable_eager": (replayed.float() - expected.float()).abs().max().item(),
        "replay_share_within_2e-2_of_eager": agree,
    }
    print(f"{lengths}: eager {eager_ms:.2f} ms, capturable {capturable_ms:.2f} ms, graph {graph_ms:.2f} ms "
          f"({row['graph_over_eager']:.3f}x eager, {row['graph_over_cudnn']:.3f}x cuDNN {cudnn_ms:.2f} ms); "
          f"replay vs eager agree {agree:.5f}; stages {stages}", flush=True)
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", nargs="+", default=list(BATCHES), choices=list(BATCHES))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    result = {**environment("cuda"), "config": "defaults",
              "shape": {"heads_q": 32, "heads_kv": 8, "head_dim": 128, "dtype": "bfloat16", "causal": True},
              "rows": [measure(BATCHES[name]) for name in args.batches]}
    if args.json:
        save(result, args.json)
    return result


if __name__ == "__main__":
    main()
