"""A mixed batch through `pbs.varlen_attention` with its keys and values in a paged cache, against
the same batch packed contiguously.

Protocol: prompts of 16K, 32K, 64K and 128K tokens (structured synthetic inputs,
`pbs.testing.make_qkv`, one seed per prompt), Hq=32, Hkv=8, D=128, bf16, causal, the queries
packed along the token axis. The paged runs copy each prompt's keys and values into a cache of
``--page-sizes`` rows per page (16, 64 and 128 by default), its pages handed out in a random order (``torch.randperm``, as a
serving engine's allocator leaves them after a while), and call `pbs.varlen_attention` with
``block_table`` and ``seqused_k``. Times are CUDA-event medians with the L2 flushed before each
call (`benchmarks.common.time_ms`), planning included. For the defaults and ``pbs_paper``:

* ``contiguous_ms`` and ``paged_ms`` (per page size): ``backend="auto"``, what a user gets. On
  Hopper the Gluon kernel runs the planned prompts, contiguous and at pages of 16 rows or more
  (pages below 128 rows by one TMA copy per page). A prompt that the dense fallback takes by length runs cuDNN
  SDPA contiguous, and every block on the page-reading kernel paged;
* ``contiguous_triton_ms`` and ``paged_triton_ms``: ``backend="triton"`` for both (no dense
  fallback: that policy is ``auto``'s), so their ratio is what reading pages in place costs one
  kernel and its planners.

    python benchmarks/bench_paged.py --json benchmarks/results/serving/paged_h100.json
    python benchmarks/bench_paged.py --device cpu --lengths 300 700 --json /tmp/paged_smoke.json  # smoke
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: python3 benchmarks/bench_paged.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pbs  # noqa: E402
from benchmarks.common import environment, save, time_ms, wall_clock_ms  # noqa: E402

SHAPE = {"cuda": (32, 8, 128), "cpu": (4, 2, 32)}  # (Hq, Hkv, D); the cpu smoke run keeps it small
CONFIGS = {"defaults": None, "pbs_paper": "pbs_paper"}


def packed_batch(lengths: list[int], device: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Packed ``q (T, Hq, D)``, ``k, v (T, Hkv, D)`` and ``cu_seq`` of the prompts."""
    heads_q, heads_kv, head_dim = SHAPE[device]
    prompts = [pbs.testing.make_qkv(batch=1, heads_q=heads_q, heads_kv=heads_kv, seq_len=n, head_dim=head_dim,
                                    dtype=dtype, device=device, seed=i) for i, n in enumerate(lengths)]
    q, k, v = (torch.cat([p[j][0].transpose(0, 1) for p in prompts]).contiguous() for j in range(3))
    bounds = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
    return q, k, v, bounds.to(torch.int32).to(device)


def paged_cache(k: torch.Tensor, v: torch.Tensor, lengths: list[int], page_size: int, seed: int = 0):
    """``k, v`` ``(T, Hkv, D)`` copied into caches ``(num_pages, page_size, Hkv, D)`` whose pages
    are handed out in a random order, the ``(N, max_pages)`` int32 block table and ``seqused_k``."""
    device = k.device
    pages = [-(-n // page_size) for n in lengths]
    order = torch.randperm(sum(pages), generator=torch.Generator().manual_seed(seed))
    block_table = torch.zeros(len(lengths), max(pages), dtype=torch.int32)
    rows = []  # the cache row of every packed token
    first = 0
    for i, (n, used) in enumerate(zip(lengths, pages)):
        block_table[i, :used] = order[first:first + used].to(torch.int32)
        first += used
        t = torch.arange(n)
        rows.append(block_table[i, t // page_size].long() * page_size + t % page_size)
    rows = torch.cat(rows).to(device)
    caches = []
    for x in (k, v):
        cache = torch.zeros(sum(pages) * page_size, x.shape[1], x.shape[2], dtype=x.dtype, device=device)
        cache[rows] = x
        caches.append(cache.view(sum(pages), page_size, x.shape[1], x.shape[2]))
    seqused_k = torch.tensor(lengths, dtype=torch.int32, device=device)
    return caches[0], caches[1], block_table.to(device), seqused_k


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--budget-ms", type=float, default=1000.0, help="timing budget per measured call")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: a smoke run of the script's logic (fp32, small heads, wall-clock times; "
                             "the triton rows run on the reference backend)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    timer, dtype = (time_ms, torch.bfloat16) if args.device == "cuda" else (wall_clock_ms, torch.float32)
    q, k, v, cu_seq_q = packed_batch(args.lengths, args.device, dtype)
    max_len = max(args.lengths)
    heads_q, heads_kv, head_dim = SHAPE[args.device]
    result = {**environment(args.device), "lengths": args.lengths, "page_sizes": args.page_sizes,
              "shape": {"heads_q": heads_q, "heads_kv": heads_kv, "head_dim": head_dim,
                        "dtype": str(dtype).removeprefix("torch."), "causal": True}, "rows": []}
    paged = {size: paged_cache(k, v, args.lengths, size) for size in args.page_sizes}
    kernel_backend = "triton" if args.device == "cuda" else "reference"
    for name in args.configs:
        preset = CONFIGS[name]
        config = pbs.PBSConfig.from_preset(preset) if preset else pbs.PBSConfig()
        same_kernel = pbs.PBSConfig.model_validate({**config.model_dump(), "backend": kernel_backend})
        contiguous_ms = timer(lambda: pbs.varlen_attention(q, k, v, cu_seq_q, cu_seq_q, max_len, max_len, config),
                              budget_ms=args.budget_ms)
        triton_ms = timer(lambda: pbs.varlen_attention(q, k, v, cu_seq_q, cu_seq_q, max_len, max_len, same_kernel),
                          budget_ms=args.budget_ms)
        row = {"config": name, "contiguous_ms": contiguous_ms, "contiguous_triton_ms": triton_ms, "paged": []}
        print(f"{name}: contiguous {contiguous_ms:.2f} ms (auto), {triton_ms:.2f} ms ({kernel_backend})", flush=True)
        for size, (k_cache, v_cache, block_table, seqused_k) in paged.items():
            paged_ms = timer(lambda: pbs.varlen_attention(q, k_cache, v_cache, cu_seq_q, None, max_len, max_len, config,
                                                          block_table=block_table, seqused_k=seqused_k),
                             budget_ms=args.budget_ms)
            paged_triton_ms = timer(lambda: pbs.varlen_attention(q, k_cache, v_cache, cu_seq_q, None, max_len, max_len,
                                                                 same_kernel, block_table=block_table,
                                                                 seqused_k=seqused_k),
                                    budget_ms=args.budget_ms)
            entry = {"page_size": size, "paged_ms": paged_ms, "paged_over_contiguous": paged_ms / contiguous_ms,
                     "paged_triton_ms": paged_triton_ms, "paged_over_contiguous_triton": paged_triton_ms / triton_ms}
            row["paged"].append(entry)
            print(f"  page_size {size}: paged {paged_ms:.2f} ms = {entry['paged_over_contiguous']:.3f}x contiguous "
                  f"(auto); on {kernel_backend} {paged_triton_ms:.2f} ms = "
                  f"{entry['paged_over_contiguous_triton']:.3f}x contiguous", flush=True)
        result["rows"].append(row)
    if args.json:
        save(result, args.json)
    return result


if __name__ == "__main__":
    main()
