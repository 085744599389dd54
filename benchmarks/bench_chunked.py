"""Chunked prefill of one long prompt against one-shot prefill, and each chunk's kernel against its ideal.

Protocol: one prompt of ``--seq-len`` tokens (structured synthetic inputs, `pbs.testing.make_qkv`),
Hq=32, Hkv=8, D=128, bf16, causal. A chunked prefill of chunk size C runs ``pbs.attention`` on the
queries ``[s, s + C)`` against the keys ``[0, s + C)`` for every chunk (the cached-prefix path,
``Nq < Nk``, bottom-right causal), as a serving engine does with the growing KV cache. Times are
CUDA-event medians with the L2 flushed before each call (`benchmarks.common.time_ms`).

For each config (the defaults, ``pbs_paper``, and ``budget`` at a fixed density of 0.2):

* ``total_ms``: the sum of the chunk calls (planning included), against the one-shot call;
* per chunk: ``kernel_ms`` (`pbs.run` of the chunk's plan: attention only, planning excluded),
  ``full_ms`` (the same chunk at full density through the same backend) and ``ratio_to_ideal`` =
  ``kernel_ms / (density * full_ms)``: 1.0 means the sparse kernel costs exactly its share of the
  work; a short chunk whose programs leave SMs idle shows up as a ratio well above 1.

Dense baselines: cuDNN SDPA one-shot, and per chunk PyTorch's ``varlen_attn`` with bottom-right
causal alignment where this torch has it (``cu_seq_q`` and ``cu_seq_k`` of one sequence).

    python benchmarks/bench_chunked.py --json benchmarks/results/serving/chunked_h100.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: python3 benchmarks/bench_chunked.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pbs  # noqa: E402
from benchmarks.common import environment, save, time_ms, torch_varlen, wall_clock_ms  # noqa: E402
from pbs.dense import dense_attention_sdpa  # noqa: E402

HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128
FULL = {"permuter": "none", "selector": {"name": "budget", "density": 1.0}, "dense_fallback": {"min_seq_len": 0}}
CONFIGS = {
    "defaults": None,
    "pbs_paper": "pbs_paper",
    # dense_fallback off: the point is the sparse kernel at a known density, not the fallback.
    "budget_0.2": {"permuter": "none", "selector": {"name": "budget", "density": 0.2},
                   "dense_fallback": {"min_seq_len": 0, "max_density": 1.0, "max_planned_density": 1.0}},
}


def chunk_bounds(seq_len: int, chunk: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of the query chunks; the last may be shorter."""
    return [(s, min(s + chunk, seq_len)) for s in range(0, seq_len, chunk)]


def torch_varlen_chunk(q, k, v):
    """PyTorch's dense varlen attention of one chunk ``(1, H, N, D)`` (`benchmarks.common.torch_varlen`),
    or None where it does not run."""
    q_p, k_p, v_p = (x[0].transpose(0, 1).contiguous() for x in (q, k, v))
    nq, nk = q_p.shape[0], k_p.shape[0]
    cu_q, cu_k = (torch.tensor([0, n], dtype=torch.int32, device=q.device) for n in (nq, nk))
    return torch_varlen(q_p, k_p, v_p, cu_q, cu_k, nq, nk)


def measure_chunks(q, k, v, chunk: int, config, full_ms_cache: dict, budget_ms: float, timer=time_ms) -> dict:
    """Times every chunk's call and kernel for one chunk size and config, by ``timer``."""
    rows, total_ms = [], 0.0
    for start, end in chunk_bounds(q.shape[2], chunk):
        qc, kc, vc = q[:, :, start:end], k[:, :, :end], v[:, :, :end]
        call_ms = timer(lambda: pbs.attention(qc, kc, vc, config), budget_ms=budget_ms)
        total_ms += call_ms
        _, plan = pbs.attention(qc, kc, vc, config, return_plan=True)
        row = {"start": start, "end": end, "call_ms": call_ms}
        if plan is None or plan.fallback:
            row["ran"] = "dense"
        else:
            key = (start, end, plan.backend)
            if key not in full_ms_cache:
                full_plan = pbs.plan(qc, kc, {**FULL, "backend": plan.backend})
                full_ms_cache[key] = timer(lambda: pbs.run(full_plan, qc, kc, vc), budget_ms=budget_ms)
            kernel_ms = timer(lambda: pbs.run(plan, qc, kc, vc), budget_ms=budget_ms)
            full_ms = full_ms_cache[key]
            row.update(ran=plan.backend, density=plan.density, kernel_ms=kernel_ms, full_ms=full_ms,
                       ratio_to_ideal=kernel_ms / (plan.density * full_ms))
        rows.append(row)
    return {"chunk": chunk, "total_ms": total_ms, "chunks": rows}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=131072)
    parser.add_argument("--chunks", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--budget-ms", type=float, default=300.0, help="timing budget per measured call")
    parser.add_argument("--device", default="cuda",
                        help="cpu: a smoke run of the script's logic (fp32, wall-clock times, reference backend)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    timer, dtype = (wall_clock_ms, torch.float32) if args.device == "cpu" else (time_ms, torch.bfloat16)
    q, k, v = pbs.testing.make_qkv(batch=1, heads_q=HEADS_Q, heads_kv=HEADS_KV, seq_len=args.seq_len,
                                   head_dim=HEAD_DIM, dtype=dtype, device=args.device, seed=0)
    scale = HEAD_DIM**-0.5
    result = {**environment(args.device), "seq_len": args.seq_len, "chunks": args.chunks,
              "shape": {"heads_q": HEADS_Q, "heads_kv": HEADS_KV, "head_dim": HEAD_DIM, "dtype": str(dtype).removeprefix("torch."),
                        "causal": True},
              "configs": {name: CONFIGS[name] for name in args.configs}, "rows": []}
    cudnn_ms = timer(lambda: dense_attention_sdpa(q, k, v, scale=scale))
    result["cudnn_one_shot_ms"] = cudnn_ms
    print(f"cuDNN one-shot {args.seq_len}: {cudnn_ms:.2f} ms", flush=True)
    for chunk in args.chunks:
        calls = []
        for s, e in chunk_bounds(args.seq_len, chunk):
            calls.append(torch_varlen_chunk(q[:, :, s:e], k[:, :, :e], v[:, :, :e]))
            if calls[-1] is None:
                break
        if all(c is not None for c in calls):
            dense_ms = sum(timer(c, budget_ms=args.budget_ms) for c in calls)
            result.setdefault("torch_varlen_chunked_ms", {})[str(chunk)] = dense_ms
            print(f"torch varlen_attn (dense) in {chunk} chunks: {dense_ms:.2f} ms", flush=True)
        del calls
    full_ms_cache: dict = {}
    for name in args.configs:
        config = CONFIGS[name]
        one_shot_ms = timer(lambda: pbs.attention(q, k, v, config))
        _, plan = pbs.attention(q, k, v, config, return_plan=True)
        row = {"config": name, "one_shot_ms": one_shot_ms, "one_shot_over_cudnn": one_shot_ms / cudnn_ms,
               "one_shot_density": None if plan is None else plan.density, "chunked": []}
        print(f"{name}: one-shot {one_shot_ms:.2f} ms ({one_shot_ms / cudnn_ms:.3f}x cuDNN)", flush=True)
        for chunk in args.chunks:
            measured = measure_chunks(q, k, v, chunk, config, full_ms_cache, args.budget_ms, timer)
            measured["total_over_one_shot"] = measured["total_ms"] / one_shot_ms
            row["chunked"].append(measured)
            sparse = [c for c in measured["chunks"] if "ratio_to_ideal" in c]
            worst = max((c["ratio_to_ideal"] for c in sparse), default=float("nan"))
            print(f"  chunks of {chunk}: total {measured['total_ms']:.2f} ms ({measured['total_over_one_shot']:.3f}x "
                  f"one-shot), {len(sparse)}/{len(measured['chunks'])} chunks sparse, worst kernel/ideal {worst:.3f}",
                  flush=True)
        result["rows"].append(row)
    if args.json:
        save(result, args.json)
    return result


if __name__ == "__main__":
    main()
