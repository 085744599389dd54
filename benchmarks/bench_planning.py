"""Timing breakdown of PBS-Attn (permutation, block selection, attention) against cuDNN dense attention.

The paper's Table "perm_overhead" (Appendix, "Analysis on the Permutation Overhead") split into
the same columns, on our implementation: B=1, Hq=32, Hkv=8, D=128, bf16, causal, segment 256,
block 128, threshold 0.9, inputs from ``pbs.testing.make_qkv`` (structured synthetic attention).
Per length N and method it measures

    permutation_ms   run_permuter + the K/V gather (permute_keys_and_values)
    selection_ms     run_selector on the already-permuted tensors
    attention_ms     the block-sparse kernel alone (backend "auto": the Gluon kernel on Hopper) on the precomputed plan
    density          selected / causally allowed blocks of that plan
    sparse_total_ms  pbs.attention end to end with the dense fallback off (always sparse)
    auto_total_ms    pbs.attention with the default dense fallback (what a user gets), and the
                     path it took: "sparse", "dense (length)" or "dense (density)"
    dense_ms         cuDNN SDPA dense causal attention (benchmarks.common.cudnn_dense)

and derives ``planning_ms`` (permutation + selection), ``overhead_pct`` (planning / sparse total,
the paper's "Overhead" column), ``planning_vs_dense_pct`` (planning / dense), ``speedup_sparse``
and ``speedup_auto`` (dense time / total time). Methods:

    vertical_slash_pooled    PBS defaults (the preset of that name): no permutation, the union of
                             vertical_slash 0.75 and mean_pool 0.9
    last_block+mean_pool     the paper's method (previous defaults): last_block key permutation,
                             mean_pool selection; compared with the paper's own table
    xattention               XAttention-style antidiagonal selection (stride 8), no permutation
    last_block+antidiagonal  PBS with the antidiagonal selector
    (and sampled_rows, vertical_slash alone: see METHODS)

Every time is a median of CUDA-event timings after warm-up with the L2 cache flushed before each
run (benchmarks.common.time_ms: median of --repeats medians, each over 5-50 runs fitting --budget-ms).
Targets checked (PASS/FAIL): (a) permutation + selection <= 1.5% of dense at 128K and <= 0.4 ms
at 16K (required of the defaults, reported for the others); (b) auto total >= 0.95 x
dense speed at every N. About 3 minutes on an H200 at the default lengths.

    python3 benchmarks/bench_planning.py --json benchmarks/results/planning/planning_h200.json
    python3 benchmarks/bench_planning.py --lengths 32768 --methods last_block+mean_pool

Densities only, planned on the CPU reference path (no GPU, no timing; what
benchmarks/results/planning/planning_densities_paper_rules_cpu.json holds):

    python3 benchmarks/bench_planning.py --densities-only --lengths 4096 8192 16384 32768 \\
        --json benchmarks/results/planning/planning_densities_cpu.json

CPU dry run (checks the script's logic only; its times mean nothing: wall-clock timing, SDPA's CPU
kernel instead of cuDNN, the reference backend instead of Triton):

    python3 benchmarks/bench_planning.py --device cpu --lengths 512 1024 --heads-q 4 --heads-kv 2 \\
        --head-dim 32 --block 64 --segment 128 --json /tmp/planning_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a file: python3 benchmarks/bench_planning.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pbs  # noqa: E402
from benchmarks.common import cudnn_dense, environment, save, time_ms  # noqa: E402
from pbs.backends import AttentionCall, CallSpec, get_backend, planning_family, resolve_backend  # noqa: E402
from pbs.config import PBSConfig  # noqa: E402
from pbs.planning import make_layout, permute_keys_and_values, run_permuter, run_selector  # noqa: E402
from pbs.testing import make_qkv  # noqa: E402
from pbs.types import Plan  # noqa: E402

DEFAULT_LENGTHS = [4096, 8192, 16384, 32768, 65536, 131072]
METHODS = {
    "last_block+mean_pool": {"permuter": "last_block", "selector": {"name": "mean_pool", "threshold": 0.9}},
    "xattention": {"permuter": "none", "selector": {"name": "antidiagonal", "threshold": 0.9, "stride": 8}},
    "last_block+antidiagonal": {"permuter": "last_block", "selector": {"name": "antidiagonal", "threshold": 0.9, "stride": 8}},
    "last_block+antidiagonal16_0.97": {"permuter": "last_block",
                                       "selector": {"name": "antidiagonal", "threshold": 0.97, "stride": 16}},
    "sampled_rows4": {"permuter": "none", "selector": {"name": "sampled_rows", "rows_per_block": 4, "threshold": 0.9}},
    "last_block+sampled_rows4": {"permuter": "last_block", "selector": {"name": "sampled_rows", "rows_per_block": 4, "threshold": 0.9}},
    # The presets of the same names (pbs.config.PRESETS): lines alone, lines OR pooled blocks, and
    # the same with the lines at 0.6 (the later layers of PBSIntegrationConfig.by_depth).
    "vertical_slash": {"permuter": "none", "selector": {"name": "vertical_slash", "threshold": 0.75}},
    "vertical_slash_pooled": {"permuter": "none", "selector": {"name": "union", "selectors": [
        {"name": "vertical_slash", "threshold": 0.75}, {"name": "mean_pool", "threshold": 0.9}]}},
    "vertical_slash_pooled_deep": {"permuter": "none", "selector": {"name": "union", "selectors": [
        {"name": "vertical_slash", "threshold": 0.6}, {"name": "mean_pool", "threshold": 0.9}]}},
}
TARGET_METHOD = "vertical_slash_pooled"  # the defaults (PBSConfig()): target (a) is required of them, reported for the rest
PAPER_METHOD = "last_block+mean_pool"  # compared with the paper's own table
FALLBACK_OFF = {"min_seq_len": 0, "max_density": None}
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "planning" / "planning_h200.json"

# The paper's Table "perm_overhead", key-permutation rows (ms): PBS-Attn against FlashAttention
# (taken to be FlashAttention-2) on an H100 80GB, CUDA events. Our baseline is cuDNN on an H200,
# about 1.7x faster than the paper's at 128K, so speed-ups compare only loosely.
PAPER_H100 = {
    "note": "paper Table perm_overhead (key permutation), PBS-Attn vs FlashAttention-2 on an H100 80GB",
    32768: {"flash_ms": 26.10, "permutation_ms": 1.68, "selection_ms": 0.60, "attention_ms": 13.83,
            "total_ms": 16.11, "overhead_pct": 14.2, "speedup": 1.62},
    65536: {"flash_ms": 106.84, "permutation_ms": 3.24, "selection_ms": 1.24, "attention_ms": 42.44,
            "total_ms": 46.92, "overhead_pct": 9.5, "speedup": 2.28},
    131072: {"flash_ms": 443.29, "permutation_ms": 6.22, "selection_ms": 3.21, "attention_ms": 150.45,
             "total_ms": 159.87, "overhead_pct": 5.9, "speedup": 2.77},
}


def make_timer(device: torch.device, budget_ms: float, cpu_reps: int, repeats: int) -> Callable[[Callable[[], object]], float]:
    """A function timing a callable in ms.

    On CUDA: benchmarks.common.time_ms (CUDA events, L2 flushed, number of runs fitted to ``budget_ms``
    so the long lengths stay bounded). On CPU (dry run): median wall-clock time of ``cpu_reps``
    runs after one warm-up.
    """
    if device.type == "cuda":
        return lambda fn: time_ms(fn, budget_ms, repeats)

    def cpu_time(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(cpu_reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    return cpu_time


def dense_time(q, k, v, timer) -> tuple[float, str]:
    """Dense causal attention time and what ran it: cuDNN SDPA on CUDA, SDPA's CPU kernel on CPU."""
    if q.is_cuda:
        ms, gqa = cudnn_dense(q, k, v, timer)
        return ms, f"cuDNN SDPA ({gqa})"
    return timer(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)), "CPU SDPA (enable_gqa)"


def auto_path(plan, n: int, config: PBSConfig) -> tuple[str, str | None]:
    """Which path ``pbs.attention(..., return_plan=True)`` took, from the plan it returned.

    No plan: dense before planning (the length rule if ``n`` is below ``min_seq_len``, else the
    density probe); a plan whose ``fallback`` is a reason string: dense after planning (density
    rule); otherwise sparse.
    """
    if plan is None:
        return ("dense (length)", None) if n < config.dense_fallback.min_seq_len else ("dense (probe)", None)
    reason = getattr(plan, "fallback", None)
    return ("dense (density)", reason) if reason else ("sparse", None)


def attempt(row: dict, what: str, fn: Callable[[], object]):
    """Runs one measurement step; on an exception records it in ``row["errors"]`` and returns None,
    so a kernel bug at one point does not lose the rest of the run."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - record and go on
        row["errors"][what] = f"{type(exc).__name__}: {exc}"
        print(f"  {row['method']} N={row['n']}: {what} FAILED: {row['errors'][what]}", flush=True)
        return None


def measure_method(row: dict, q, k, v, config: PBSConfig, config_sparse: PBSConfig, timer, attention_backend: str) -> None:
    """Fills ``row`` with the stage times, density, end-to-end times and the auto path of one method."""
    scale = q.shape[-1] ** -0.5
    tag = f"  {row['method']} N={row['n']}:"
    layout = make_layout(q, k, config)
    planned_backend = resolve_backend(config.backend, CallSpec.of(q, v.shape[-1], config.block_size))
    family = planning_family(planned_backend, q.device)

    def permutation():
        key_perm, query_perm = run_permuter(q, k, layout, config, scale, family)
        k_perm, v_perm = permute_keys_and_values(key_perm, k, v)

        def step():
            # The K/V gather is part of permuting: attention reads the permuted copies.
            kp, _ = run_permuter(q, k, layout, config, scale, family)
            return permute_keys_and_values(kp, k, v)

        row["permutation_ms"] = timer(step)
        print(f"{tag} permutation {row['permutation_ms']:.3f} ms", flush=True)
        return key_perm, query_perm, query_perm.apply(q), k_perm, v_perm

    permuted = attempt(row, "permutation", permutation)
    if permuted is not None:
        key_perm, query_perm, q_perm, k_perm, v_perm = permuted

        def selection():
            mask = run_selector(q_perm, k, key_perm, query_perm, layout, config, scale, k_perm=k_perm, family=family)
            row["density"] = mask.density()
            row["selection_ms"] = timer(lambda: run_selector(q_perm, k, key_perm, query_perm, layout, config, scale, k_perm=k_perm, family=family))
            print(f"{tag} selection {row['selection_ms']:.3f} ms, density {row['density']:.3f}", flush=True)
            return mask

        mask = attempt(row, "selection", selection)
        if mask is not None:

            def attention():
                backend = get_backend(attention_backend) if attention_backend != "auto" else planned_backend
                plan = Plan(key_permutation=key_perm, query_permutation=query_perm, mask=mask, config=config,
                            backend=backend.name)
                call = AttentionCall(q=q_perm, k=k_perm, v=v_perm, plan=plan, scale=scale)
                row["attention_ms"] = timer(lambda: backend.run(call))
                print(f"{tag} attention {row['attention_ms']:.3f} ms", flush=True)

            attempt(row, "attention", attention)
        del permuted, key_perm, query_perm, q_perm, k_perm, v_perm, mask  # free before the end-to-end runs

    def sparse_total():
        row["sparse_total_ms"] = timer(lambda: pbs.attention(q, k, v, config_sparse))
        print(f"{tag} total (sparse) {row['sparse_total_ms']:.3f} ms", flush=True)

    def auto_total():
        _, plan = pbs.attention(q, k, v, config, return_plan=True)
        row["auto_path"], row["auto_fallback_reason"] = auto_path(plan, k.shape[2], config)
        del plan
        row["auto_total_ms"] = timer(lambda: pbs.attention(q, k, v, config))
        print(f"{tag} total (auto) {row['auto_total_ms']:.3f} ms, {row['auto_path']}", flush=True)

    attempt(row, "sparse_total", sparse_total)
    attempt(row, "auto_total", auto_total)


def derive(row: dict) -> None:
    """Adds the ratios of the paper's table to ``row`` from whichever times were measured."""
    perm, sel, dense = row.get("permutation_ms"), row.get("selection_ms"), row.get("dense_ms")
    sparse, auto = row.get("sparse_total_ms"), row.get("auto_total_ms")
    if perm is not None and sel is not None:
        row["planning_ms"] = perm + sel
        if sparse:
            row["overhead_pct"] = 100 * row["planning_ms"] / sparse  # the paper's "Overhead": share of the total
        if dense:
            row["planning_vs_dense_pct"] = 100 * row["planning_ms"] / dense
    if dense and sparse:
        row["speedup_sparse"] = dense / sparse
    if dense and auto:
        row["speedup_auto"] = dense / auto


def run_length(n: int, args, configs: dict, device: torch.device, timer) -> list[dict]:
    """All methods at one length: builds the inputs, times dense once, then each method."""
    t0 = time.perf_counter()
    q, k, v = make_qkv(batch=1, heads_q=args.heads_q, heads_kv=args.heads_kv, seq_len=n, head_dim=args.head_dim,
                       dtype=torch.bfloat16, device=device)
    print(f"N={n}: inputs built in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = [{"n": n, "method": name, "errors": {}} for name in configs]
    dense = attempt(rows[0], "dense", lambda: dense_time(q, k, v, timer))
    for row in rows:
        if dense is None:
            row["errors"].setdefault("dense", rows[0]["errors"]["dense"])
        else:
            row["dense_ms"], row["dense_kernel"] = dense
    if dense is not None:
        print(f"N={n}: dense {dense[0]:.3f} ms ({dense[1]})", flush=True)
    attention_backend = "auto" if device.type == "cuda" else "reference"
    for row in rows:
        config, config_sparse = configs[row["method"]]
        measure_method(row, q, k, v, config, config_sparse, timer, attention_backend)
        derive(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def check_targets(rows: list[dict]) -> list[dict]:
    """Target checks: (a) planning <= 1.5% of dense at 128K and <= 0.4 ms at 16K; (b) speedup_auto >= 0.95.

    ``required`` is false for (a) on methods other than the defaults (reported only). A check whose
    value was not measured (error) counts as failed.
    """
    checks = []
    for row in rows:
        required_a = row["method"] == TARGET_METHOD
        if row["n"] == 131072:
            value = row.get("planning_vs_dense_pct")
            checks.append({"check": "(a) permutation + selection <= 1.5% of dense at 128K", "method": row["method"],
                           "n": row["n"], "value": value, "limit": 1.5, "unit": "%", "required": required_a,
                           "passed": value is not None and value <= 1.5})
        if row["n"] == 16384:
            value = row.get("planning_ms")
            checks.append({"check": "(a) permutation + selection <= 0.4 ms at 16K", "method": row["method"],
                           "n": row["n"], "value": value, "limit": 0.4, "unit": "ms", "required": required_a,
                           "passed": value is not None and value <= 0.4})
        value = row.get("speedup_auto")
        checks.append({"check": "(b) auto total >= 0.95 x dense speed", "method": row["method"], "n": row["n"],
                       "value": value, "limit": 0.95, "unit": "x", "required": True,
                       "passed": value is not None and value >= 0.95})
    return checks


def _fmt(x, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def _length(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def print_table(result: dict) -> None:
    """The paper's table layout, one block of rows per method, then the paper's numbers and the checks.

    "Overhead" is the paper's: permutation + selection over the sparse total; "Plan/dense" is the
    same time over dense attention (target (a)).
    """
    print(f"\n{result['device']}, torch {result['torch']}, triton {result['triton']}, CUDA {result['cuda']}")
    head = (f"{'Length':>6} | {'cuDNN dense':>11} | {'Permutation':>11} | {'Selection':>9} | {'Attention':>9} | "
            f"{'Density':>7} | {'Total (sparse)':>14} | {'Overhead':>8} | {'Plan/dense':>10} | {'Speedup (sparse)':>16} | "
            f"{'Total (auto)':>12} | {'Speedup (auto)':>14} | auto path")
    for method in result["methods"]:
        print(f"\n{method} (times in ms)\n{head}\n{'-' * len(head)}")
        for r in (r for r in result["rows"] if r["method"] == method):
            print(f"{_length(r['n']):>6} | {_fmt(r.get('dense_ms')):>11} | {_fmt(r.get('permutation_ms'), '.3f'):>11} | "
                  f"{_fmt(r.get('selection_ms'), '.3f'):>9} | {_fmt(r.get('attention_ms')):>9} | "
                  f"{_fmt(r.get('density'), '.3f'):>7} | {_fmt(r.get('sparse_total_ms')):>14} | "
                  f"{_fmt(r.get('overhead_pct'), '.1f', '%'):>8} | {_fmt(r.get('planning_vs_dense_pct'), '.2f', '%'):>10} | "
                  f"{_fmt(r.get('speedup_sparse'), '.2f', 'x'):>16} | "
                  f"{_fmt(r.get('auto_total_ms')):>12} | {_fmt(r.get('speedup_auto'), '.2f', 'x'):>14} | "
                  f"{r.get('auto_path', '-')}")
            for what, err in r["errors"].items():
                print(f"{'':>6}   error in {what}: {err}")
    print_paper_comparison(result)
    print("\nTargets:")
    for c in result["checks"]:
        verdict = ("PASS" if c["passed"] else "FAIL") + ("" if c["required"] else " (reported only)")
        print(f"{verdict:<22} {c['check']}: {c['method']} {_length(c['n'])} = {_fmt(c['value'], '.3f')} {c['unit']} "
              f"(limit {c['limit']} {c['unit']})")
    for n, what in ((131072, "128K"), (16384, "16K")):
        if not any(r["n"] == n for r in result["rows"]):
            print(f"(a) at {what}: not measured (length not in --lengths)")


def print_paper_comparison(result: dict) -> None:
    """Our last_block+mean_pool rows beside the paper's key-permutation rows at 32K, 64K and 128K."""
    ours = {r["n"]: r for r in result["rows"] if r["method"] == PAPER_METHOD}
    shown = [n for n in PAPER_H100 if n in ours]
    if not shown:
        return
    print(f"\nPaper vs ours ({PAPER_H100['note']}; ours: {PAPER_METHOD}, {result['device']}, cuDNN dense)")
    print(f"{'Length':>6} | {'':>5} | {'dense':>8} | {'perm':>6} | {'select':>6} | {'attn':>8} | {'total':>8} | "
          f"{'overhead':>8} | {'speedup':>7}")
    for n in shown:
        p, r = PAPER_H100[n], ours[n]
        print(f"{_length(n):>6} | {'paper':>5} | {p['flash_ms']:8.2f} | {p['permutation_ms']:6.2f} | {p['selection_ms']:6.2f} | "
              f"{p['attention_ms']:8.2f} | {p['total_ms']:8.2f} | {p['overhead_pct']:7.1f}% | {p['speedup']:6.2f}x")
        print(f"{'':>6} | {'ours':>5} | {_fmt(r.get('dense_ms')):>8} | {_fmt(r.get('permutation_ms')):>6} | "
              f"{_fmt(r.get('selection_ms')):>6} | {_fmt(r.get('attention_ms')):>8} | {_fmt(r.get('sparse_total_ms')):>8} | "
              f"{_fmt(r.get('overhead_pct'), '.1f', '%'):>8} | {_fmt(r.get('speedup_sparse'), '.2f', 'x'):>7}")


def densities_only(args) -> None:
    """The density of every method's plan at every length, planned on the CPU reference path with
    bf16 ``make_qkv`` inputs (no timing): ``--densities-only``."""
    rows = []
    for n in args.lengths:
        q, k, _ = make_qkv(batch=1, heads_q=args.heads_q, heads_kv=args.heads_kv, seq_len=n, head_dim=args.head_dim,
                           dtype=torch.bfloat16)
        for name in args.methods:
            start = time.perf_counter()
            config = PBSConfig(block_size=args.block, segment_size=args.segment, backend="reference", **METHODS[name])
            rows.append({"N": n, "method": name, "density": pbs.plan(q, k, config).density})
            print(n, name, round(rows[-1]["density"], 3), f"{time.perf_counter() - start:.1f} s", flush=True)
    if args.json:
        save({
            **environment("cpu"),
            "note": (f"densities of the planning benchmark's configs on its make_qkv workload (bf16 inputs, B=1, "
                     f"Hq={args.heads_q}, Hkv={args.heads_kv}, D={args.head_dim}, S={args.segment}, block {args.block}), "
                     "planned on the CPU reference path"),
            "configs": {name: METHODS[name] for name in args.methods},
            "rows": rows,
        }, args.json)
        print(f"wrote {args.json}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: a dry run with tiny shapes that only checks the script's logic")
    parser.add_argument("--lengths", type=int, nargs="+", default=DEFAULT_LENGTHS)
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--heads-q", type=int, default=32)
    parser.add_argument("--heads-kv", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--segment", type=int, default=256)
    parser.add_argument("--budget-ms", type=float, default=1000.0,
                        help="CUDA: each of the --repeats timings runs as many times (5 to 50) as fit this")
    parser.add_argument("--repeats", type=int, default=3, help="CUDA: median of this many medians")
    parser.add_argument("--cpu-reps", type=int, default=3, help="CPU dry run: wall-clock runs per measurement")
    parser.add_argument("--json", default=None,
                        help=f"output file (default on CUDA: {DEFAULT_JSON}; on CPU: none)")
    parser.add_argument("--densities-only", action="store_true",
                        help="only plan each method on the CPU reference path and record its density (no timing, "
                             "no GPU): how the selection rules change the density the GPU timings depend on")
    args = parser.parse_args()
    if args.densities_only:
        densities_only(args)
        return
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device; use --device cpu for a dry run")
    json_path = args.json or (str(DEFAULT_JSON) if device.type == "cuda" else None)

    configs = {}
    for name in args.methods:
        common = dict(block_size=args.block, segment_size=args.segment, **METHODS[name])  # check_finite: the default (off on CUDA)
        configs[name] = (PBSConfig(**common), PBSConfig(**common, dense_fallback=FALLBACK_OFF))
    result = {
        **environment(device),
        "shape": {"batch": 1, "heads_q": args.heads_q, "heads_kv": args.heads_kv, "head_dim": args.head_dim,
                  "dtype": "bfloat16", "causal": True, "segment": args.segment, "block": args.block,
                  "inputs": "pbs.testing.make_qkv(seed=0)"},
        "timing": (f"median of {args.repeats} medians of CUDA-event times (5-50 runs each, budget {args.budget_ms:g} ms), "
                   "after warm-up, L2 flushed before each run" if device.type == "cuda" else
                   f"CPU dry run: median wall-clock time of {args.cpu_reps} runs (logic check only, not a benchmark)"),
        "attention_backend": "auto" if device.type == "cuda" else "reference",
        "methods": list(configs),
        "configs": {name: auto.model_dump(mode="json") for name, (auto, _) in configs.items()},
        "sparse_total_dense_fallback": FALLBACK_OFF,
        "paper_h100": {str(key): value for key, value in PAPER_H100.items()},
        "rows": [],
        "checks": [],
    }
    timer = make_timer(device, args.budget_ms, args.cpu_reps, args.repeats)
    start = time.perf_counter()
    for n in args.lengths:
        result["rows"] += run_length(n, args, configs, device, timer)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        result["checks"] = check_targets(result["rows"])
        if json_path:  # after every length, so a run cut short still leaves its numbers
            save(result, json_path)
    result["wall_s"] = time.perf_counter() - start
    print_table(result)
    print(f"\nwall time {result['wall_s']:.0f} s")
    if json_path:
        save(result, json_path)
        print(f"wrote {json_path}")


if __name__ == "__main__":
    main()
