"""A mixed batch of long prompts through `pbs.varlen_attention` against the same prompts one by one.

Protocol: prompts of 16K, 32K, 64K and 128K tokens (structured synthetic inputs, `pbs.testing.make_qkv`,
one seed per prompt), packed along the token axis; Hq=32, Hkv=8, D=128, bf16, causal. Timed with
CUDA events after warm-up, L2 flushed before each call (`benchmarks.common.time_ms`):

* ``varlen``: `pbs.varlen_attention` on the packed batch (defaults, and the preset ``pbs_paper``);
* ``loop``: `pbs.attention` on each prompt in turn, the same configs;
* ``cudnn``: SDPA (cuDNN first) on each prompt in turn, dense;
* ``torch_varlen``: PyTorch's ``torch.nn.attention.varlen.varlen_attn`` on the packed batch (dense),
  where this torch has it (K/V repeated to the query heads if it has no GQA).

    python benchmarks/bench_varlen.py --json benchmarks/results/serving/varlen_h100.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: python3 benchmarks/bench_varlen.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pbs  # noqa: E402
from benchmarks.common import environment, packed_prompts, save, time_ms, torch_varlen  # noqa: E402
from pbs.dense import dense_attention_sdpa  # noqa: E402

HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    views, (q, k, v, cu) = packed_prompts(args.lengths, HEADS_Q, HEADS_KV, HEAD_DIM)
    max_len = max(args.lengths)
    result = {**environment("cuda"), "lengths": args.lengths,
              "shape": {"heads_q": HEADS_Q, "heads_kv": HEADS_KV, "head_dim": HEAD_DIM, "dtype": "bfloat16",
                        "causal": True}, "rows": []}
    scale = HEAD_DIM**-0.5
    cudnn_ms = time_ms(lambda: [dense_attention_sdpa(*view, scale=scale) for view in views])
    result["cudnn_per_prompt_ms"] = cudnn_ms
    print(f"cuDNN, prompt by prompt: {cudnn_ms:.2f} ms", flush=True)
    baseline = torch_varlen(q, k, v, cu, cu, max_len, max_len)
    result["torch_varlen_ms"] = time_ms(baseline) if baseline is not None else None
    if baseline is not None:
        print(f"torch varlen_attn (dense): {result['torch_varlen_ms']:.2f} ms", flush=True)
    for name, config in (("defaults", None), ("pbs_paper", "pbs_paper")):
        varlen_ms = time_ms(lambda: pbs.varlen_attention(q, k, v, cu, cu, max_len, max_len, config))
        loop_ms = time_ms(lambda: [pbs.attention(*view, config) for view in views])
        row = {"config": name, "varlen_ms": varlen_ms, "loop_ms": loop_ms, "varlen_over_loop": varlen_ms / loop_ms,
               "varlen_over_cudnn": varlen_ms / cudnn_ms}
        result["rows"].append(row)
        print(f"{name}: varlen {varlen_ms:.2f} ms, loop {loop_ms:.2f} ms ({row['varlen_over_loop']:.3f}x), "
              f"{row['varlen_over_cudnn']:.3f}x cuDNN", flush=True)
    if args.json:
        save(result, args.json)
    return result


if __name__ == "__main__":
    main()
