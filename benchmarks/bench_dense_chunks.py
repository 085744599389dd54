"""Dense attention of a chunk after a cached prefix: PBS's dense path against SDPA.

A causal call with fewer queries than keys (chunked prefill, a prompt after a cached prefix) is
aligned bottom-right. SDPA serves that alignment with FlashAttention-2 (the memory-efficient kernel
where flash cannot run), not cuDNN, so `pbs.dense.dense_attention` runs such calls with the Gluon
kernel in dense mode on Hopper. For
each ``(Nq, Nk)`` this times, CUDA events with the L2 flushed, in rotation
(`pbs.testing.benchmark_cuda_interleaved`):

* ``sdpa_ms``: `pbs.dense.dense_attention_sdpa` (what the dense path ran before);
* ``dense_ms``: `pbs.dense.dense_attention` (what it runs now);
* ``attention_ms``: `pbs.attention` with the defaults (the length rule or the probe decides);

and the largest absolute difference between the first two outputs. B=1, Hq=32, Hkv=8, D=128, bf16.

``--structured`` draws the inputs from `pbs.testing.make_qkv` (heavy-hitter keys and slash lines, so
the probe lets calls plan) instead of random ones, and adds ``sparse_ms``: `pbs.attention` with every
dense rule off, planning included, and its planned density. Where ``sparse_ms`` exceeds ``dense_ms``
at few queries, planning against every key costs more than the kernel saves: what a rule on the
number of queries would need to know.

    python3 benchmarks/bench_dense_chunks.py --json $OUT/dense_chunks.json
    python3 benchmarks/bench_dense_chunks.py --structured --shapes 512x32768 1024x32768 2048x32768 \
        1024x131072 2048x131072 4096x131072 --json $OUT/dense_chunks_structured.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: python3 benchmarks/bench_dense_chunks.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pbs  # noqa: E402
from benchmarks.common import environment, save  # noqa: E402
from pbs.dense import dense_attention, dense_attention_sdpa  # noqa: E402
from pbs.testing import benchmark_cuda_interleaved  # noqa: E402

HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128
SHAPES = [(2048, 30720), (8192, 16384), (8192, 24576), (16384, 16384), (16384, 32768), (8192, 65536)]
# Both sides of `dense_kernel_available`'s rule (the kernel's tiles fill every SM): 1024 queries of
# 32 heads are 256 tiles (the Gluon kernel), 512 are 128 (SDPA on an H100/H200's 132 SMs).
EDGE_SHAPES = [(1024, 32768), (512, 32768)]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=[f"{nq}x{nk}" for nq, nk in SHAPES + EDGE_SHAPES],
                        help="NqxNk pairs (queries are the last Nq of Nk positions)")
    parser.add_argument("--structured", action="store_true",
                        help="structured inputs (pbs.testing.make_qkv) and the planned sparse call beside")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    scale = HEAD_DIM**-0.5
    result = {**environment("cuda"), "shape": {"heads_q": HEADS_Q, "heads_kv": HEADS_KV, "head_dim": HEAD_DIM,
                                               "dtype": "bfloat16", "causal": True},
              "inputs": "structured" if args.structured else "random", "rows": []}
    no_dense_rule = pbs.PBSConfig(dense_fallback=pbs.DenseFallback(min_seq_len=0, max_density=None,
                                                                   max_planned_density=None, probe_blocks=0))
    print(f"{'Nq':>6} {'Nk':>6} | {'SDPA (ms)':>9} {'dense (ms)':>10} {'x':>5} | {'pbs.attention':>13} | max |diff|")
    for shape in args.shapes:
        nq, nk = (int(x) for x in shape.split("x"))
        if args.structured:
            q, k, v = pbs.testing.make_qkv(heads_q=HEADS_Q, heads_kv=HEADS_KV, seq_len=nk, seq_len_q=nq,
                                           head_dim=HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        else:
            gen = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn((1, HEADS_Q, nq, HEAD_DIM), generator=gen, device="cuda", dtype=torch.bfloat16)
            k = torch.randn((1, HEADS_KV, nk, HEAD_DIM), generator=gen, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
        diff = (dense_attention(q, k, v, scale=scale).float() - dense_attention_sdpa(q, k, v, scale=scale).float())
        calls = {
            "sdpa_ms": lambda: dense_attention_sdpa(q, k, v, scale=scale),
            "dense_ms": lambda: dense_attention(q, k, v, scale=scale),
            "attention_ms": lambda: pbs.attention(q, k, v),
        }
        extra = {}
        if args.structured:
            calls["sparse_ms"] = lambda: pbs.attention(q, k, v, no_dense_rule)
            extra["sparse_density"] = pbs.plan(q, k, no_dense_rule).density
        times = benchmark_cuda_interleaved(calls, warmup=3, iters=15)
        row = {"seq_len_q": nq, "seq_len_k": nk, **times, **extra, "max_abs_diff": diff.abs().max().item()}
        result["rows"].append(row)
        sparse = f" | sparse {row['sparse_ms']:.3f} at {row['sparse_density']:.3f}" if args.structured else ""
        print(f"{nq:>6} {nk:>6} | {row['sdpa_ms']:>9.3f} {row['dense_ms']:>10.3f} {row['sdpa_ms'] / row['dense_ms']:>5.2f} | "
              f"{row['attention_ms']:>13.3f} | {row['max_abs_diff']:.4f}{sparse}", flush=True)
    if args.json:
        save(result, args.json)
    return result


if __name__ == "__main__":
    main()
