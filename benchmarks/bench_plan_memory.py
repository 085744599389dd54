"""Peak extra GPU memory of ``pbs.plan`` (and, for information, of ``pbs.attention``) for one layer.

One attention layer: B=1, Hq=32, Hkv=8, D=128, bf16, causal, block 128, segment 256, at N = 128K
and 512K. For each config the script measures, with the CUDA caching allocator's statistics,

    peak  max_memory_allocated() during the call - memory_allocated() before it
    kept  memory_allocated() after the call - before it (what the returned plan or output holds)

in MiB and as a fraction of ``q.nbytes + k.nbytes + v.nbytes`` (the layer's inputs). The target
is a ``pbs.plan`` peak of at most 0.25 x the inputs (PASS/FAIL per length and config).
``pbs.attention`` (dense fallback off, so always sparse) is reported as information only: its peak
includes the permuted K/V copies and the output, which is as large as q.

Configs (all with ``check_finite=False``):

    defaults                 PBSConfig() (preset vertical_slash_pooled: no permutation, union of
                             vertical_slash 0.75 and mean_pool 0.9)
    last_block+mean_pool     the previous defaults (last_block permutation, mean_pool, threshold 0.9)
    antidiagonal             XAttention-style antidiagonal selection (stride 8), identity permuter
    last_block+antidiagonal  last_block permutation with the antidiagonal selector

Inputs are plain ``torch.randn`` on the GPU: ``pbs.testing.make_qkv`` builds float64 tensors of
the full size on the host (16 GiB for q alone at 512K) and is slow there, and the plan's buffers
do not depend on the values. Random inputs give near-uniform attention, so the densities (and the
``pbs.attention`` run times) are high; only the memory numbers are the point. A plan at
``--warmup-len`` for every config runs first, so Triton compilation is not counted. About 1 minute
on an H200.

    python3 benchmarks/bench_plan_memory.py --json benchmarks/results/planning/plan_memory_h200.json

CPU dry run (checks the script's logic only; memory numbers are null there, as the statistics
exist only for CUDA):

    python3 benchmarks/bench_plan_memory.py --device cpu --lengths 2048 --heads-q 4 --heads-kv 2 \\
        --head-dim 32 --warmup-len 1024 --json /tmp/plan_memory_cpu.json
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: python3 benchmarks/bench_plan_memory.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pbs  # noqa: E402
from benchmarks.common import environment, save  # noqa: E402
from pbs.config import PBSConfig  # noqa: E402

DEFAULT_LENGTHS = [131072, 524288]
METHODS = {
    "defaults": {},
    "last_block+mean_pool": {"permuter": "last_block", "selector": {"name": "mean_pool", "threshold": 0.9}},
    "antidiagonal": {"permuter": "identity", "selector": {"name": "antidiagonal", "threshold": 0.9, "stride": 8}},
    "last_block+antidiagonal": {"permuter": "last_block", "selector": {"name": "antidiagonal", "threshold": 0.9, "stride": 8}},
}
# Dense fallback off: pbs.attention always runs the sparse path, whose memory is the question here.
FALLBACK_OFF = {"min_seq_len": 0, "max_density": None}
TARGET_FRACTION = 0.25  # pbs.plan peak extra memory, as a fraction of q + k + v
MIB = 2**20
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "planning" / "plan_memory_h200.json"


def make_inputs(n: int, args, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random bf16 ``q (1, Hq, n, D)``, ``k`` and ``v (1, Hkv, n, D)`` made directly on ``device``."""
    gen = torch.Generator(device=device).manual_seed(n)

    def randn(heads: int) -> torch.Tensor:
        return torch.randn(1, heads, n, args.head_dim, device=device, dtype=torch.bfloat16, generator=gen)

    return randn(args.heads_q), randn(args.heads_kv), randn(args.heads_kv)


def measure(fn: Callable[[], object], device: torch.device) -> tuple[object, int | None, int | None]:
    """``(result, peak, kept)``: bytes allocated beyond the starting point at the peak of ``fn()``
    and after it (``result`` still alive). None and None on CPU, which has no allocator statistics."""
    if device.type != "cuda":
        return fn(), None, None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    return result, torch.cuda.max_memory_allocated() - base, torch.cuda.memory_allocated() - base


def warm_up(args, configs: dict, device: torch.device) -> None:
    """Runs every measured call once at ``--warmup-len``, so kernel compilation is not measured."""
    q, k, v = make_inputs(args.warmup_len, args, device)
    for config in configs.values():
        pbs.plan(q, k, config)
        pbs.attention(q, k, v, config)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def measure_length(n: int, args, configs: dict, device: torch.device) -> list[dict]:
    """Rows for every config and both calls (plan, attention) at one length."""
    q, k, v = make_inputs(n, args, device)
    qkv_bytes = q.nbytes + k.nbytes + v.nbytes
    rows = []
    for name, config in configs.items():
        calls = {"plan": lambda: pbs.plan(q, k, config), "attention": lambda: pbs.attention(q, k, v, config)}
        for call, fn in calls.items():
            row = {"n": n, "config": name, "call": call, "qkv_bytes": qkv_bytes, "peak_bytes": None, "kept_bytes": None}
            start = time.perf_counter()
            try:
                result, row["peak_bytes"], row["kept_bytes"] = measure(fn, device)
                if call == "plan":
                    row["density"] = result.density
                del result
            except Exception as exc:  # noqa: BLE001 - record (e.g. out of memory) and go on
                row["error"] = f"{type(exc).__name__}: {exc}"
            row["wall_s"] = time.perf_counter() - start
            for what in ("peak", "kept"):
                b = row[f"{what}_bytes"]
                row[f"{what}_mib"] = None if b is None else b / MIB
                row[f"{what}_fraction"] = None if b is None else b / qkv_bytes
            # The target is on pbs.plan's peak; attention rows are information.
            row["passed"] = (None if row["peak_fraction"] is None else row["peak_fraction"] <= TARGET_FRACTION) if call == "plan" else None
            if device.type == "cuda":
                torch.cuda.empty_cache()
            rows.append(row)
            print(f"N={n} {name} {call}: peak {_fmt(row['peak_mib'], '.1f')} MiB ({_fmt(row['peak_fraction'], '.3f')} x qkv), "
                  f"kept {_fmt(row['kept_mib'], '.1f')} MiB{'  ERROR ' + row['error'] if 'error' in row else ''}", flush=True)
    return rows


def _fmt(x, spec: str) -> str:
    return "-" if x is None else f"{x:{spec}}"


def print_table(result: dict) -> None:
    """One line per (N, config, call), then PASS/FAIL of the plan rows against the target."""
    print(f"\n{result['device']}, torch {result['torch']}, triton {result['triton']}, CUDA {result['cuda']}")
    head = (f"{'N':>7} | {'config':<24} | {'call':<9} | {'q+k+v MiB':>9} | {'peak MiB':>9} | {'peak/qkv':>8} | "
            f"{'kept MiB':>9} | {'kept/qkv':>8} | {'density':>7}")
    print(f"{head}\n{'-' * len(head)}")
    for r in result["rows"]:
        print(f"{r['n']:>7} | {r['config']:<24} | {r['call']:<9} | {r['qkv_bytes'] / MIB:9.0f} | {_fmt(r['peak_mib'], '.1f'):>9} | "
              f"{_fmt(r['peak_fraction'], '.3f'):>8} | {_fmt(r['kept_mib'], '.1f'):>9} | {_fmt(r['kept_fraction'], '.3f'):>8} | "
              f"{_fmt(r.get('density'), '.3f'):>7}" + (f"  error: {r['error']}" if "error" in r else ""))
    print(f"\nTarget: pbs.plan peak extra memory <= {TARGET_FRACTION} x (q + k + v)")
    for r in (r for r in result["rows"] if r["call"] == "plan"):
        verdict = "n/a " if r["passed"] is None else ("PASS" if r["passed"] else "FAIL")
        print(f"{verdict} N={r['n']} {r['config']}: peak {_fmt(r['peak_fraction'], '.3f')} x qkv")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: a dry run of the same code path with memory numbers null (logic check only)")
    parser.add_argument("--lengths", type=int, nargs="+", default=DEFAULT_LENGTHS)
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--heads-q", type=int, default=32)
    parser.add_argument("--heads-kv", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--warmup-len", type=int, default=16384, help="length of the untimed warm-up calls")
    parser.add_argument("--json", default=None, help=f"output file (default on CUDA: {DEFAULT_JSON}; on CPU: none)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device; use --device cpu for a dry run")
    json_path = args.json or (str(DEFAULT_JSON) if device.type == "cuda" else None)

    configs = {name: PBSConfig(check_finite=False, dense_fallback=FALLBACK_OFF, **METHODS[name]) for name in args.methods}
    result = {
        **environment(device),
        "shape": {"batch": 1, "heads_q": args.heads_q, "heads_kv": args.heads_kv, "head_dim": args.head_dim,
                  "dtype": "bfloat16", "causal": True, "inputs": "torch.randn on the device"},
        "measure": ("peak = torch.cuda.max_memory_allocated() during the call - memory_allocated() before; "
                    "kept = memory_allocated() after the call (result alive) - before"),
        "target": f"pbs.plan peak <= {TARGET_FRACTION} x (q.nbytes + k.nbytes + v.nbytes)",
        "configs": {name: config.model_dump(mode="json") for name, config in configs.items()},
        "warmup_len": args.warmup_len,
        "rows": [],
    }
    warm_up(args, configs, device)
    for n in args.lengths:
        result["rows"] += measure_length(n, args, configs, device)
        if json_path:  # after every length, so a run cut short still leaves its numbers
            save(result, json_path)
    print_table(result)
    if json_path:
        save(result, json_path)
        print(f"wrote {json_path}")


if __name__ == "__main__":
    main()
