"""Context-parallel PBS prefill on several GPUs against torch's ring SDPA and one GPU (issue 29, point 4).

One attention layer of Llama-3.1-8B's shape (B 1, Hq 32, Hkv 8, D 128, bf16, causal) on **random
inputs** drawn on each GPU from ``--seed`` (every rank draws the same whole sequence and keeps its
zigzag shard, `pbs.distributed.shard_sequence`). Random q and k give nearly flat attention, so the
defaults' density probe sends every call to dense attention (expected; each row records the
reason pbs gave): the forced-density row is the speed of a sparse prefill.

Methods (``--methods``), all at the same length on the same ranks:
    pbs_defaults    `pbs.distributed.context_parallel_attend` with ``PBSConfig()``
    pbs_defaults_planned  the defaults with the density rules off (``max_density=None``): the
                    default selector's distributed planning runs (pooled keys, line scores) and
                    attention at whatever density it selects on random inputs (near 1); not run
                    on one GPU
    pbs_budget_0.2  the same at a forced density of 0.2 (``budget`` selector, permuter ``none``:
                    seeded random blocks, no probe); its ``planning`` phase is that random draw,
                    not a real selector's cost, so ``time_without_planning_ms`` is reported too
    torch_ring      torch's own context parallelism: ``context_parallel(mesh, buffers=[q, k, v])``
                    (head-tail load balancing, torch's default rotate method) around
                    ``F.scaled_dot_product_attention(is_causal=True)`` under cuDNN, else flash; GQA by
                    ``enable_gqa`` where the ring takes it, else on K/V expanded to 32 heads. A failure
                    is recorded with its reason and the run goes on.

Per row: ``--warmup`` untimed calls and ``--repeats`` timed ones (``--long-repeats`` from 1M tokens),
each started after a barrier; the call's time on each rank by CUDA events, the row's time per call the
slowest rank's, and ``time_ms`` the median over calls. For PBS each call also records its phases on
each rank (`pbs.distributed.ContextParallelResult.timings`: ``summaries`` = selection inputs of the
whole sequence with their collectives, ``planning``, ``kv_wait`` = the part of the K/V all-gather
that planning did not hide, ``attention``). Communication is measured apart as well: the K/V
all-gather alone (``kv_allgather_ms``, the same tensors, median of 3). Load balance: each rank's
busy time is its attention phase (local compute, no collective inside), and ``max_idle_share`` is
``1 - min / max`` of those over the ranks; ``targets`` also gives it with each GPU's own speed divided
out (`speed_normalized_idle`, the dense row at the same length as the gauge), which tells a slow GPU
from an unequal split. Peak memory is ``torch.cuda.max_memory_allocated`` per
rank during the row (inputs included).

One GPU (``--single-lens``, default 256K and 512K; ``--single-repeats`` timed calls): rank 0 alone runs ``pbs.attention`` with the
same configs on the whole sequence and SDPA pinned to the kernel the ring ran (cuDNN with ``enable_gqa``
on an H100; `one_gpu_sdpa`) while the other ranks wait, so that the 4-GPU file
holds its own baseline; ``scaling`` gives the speed-up and the efficiency ``t1 / (P * tP)`` per
method and length. ``--world 1`` runs only those single-GPU rows (plain python).

    # 4 GPUs (NCCL; about 5 minutes on 4 H100s):
    python benchmarks/bench_context_parallel.py --world 4 --json cp_4gpu.json
    # the check on a CPU: gloo, 2 processes, tiny shapes (torch_ring fails soft there)
    python benchmarks/bench_context_parallel.py --smoke --device cpu --world 2 --json /tmp/cp_smoke.json

Under ``--world N > 1`` the script relaunches itself with ``python -m torch.distributed.run
--standalone --nproc-per-node N`` unless torchrun started it. NVLink multicast is left as the
machine sets it (the GPU machine sets ``NCCL_NVLS_ENABLE=0``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import Ranks, environment, relaunch_under_torchrun, save  # noqa: E402

SHAPE = dict(heads_q=32, heads_kv=8, head_dim=128)
SMOKE_SHAPE = dict(heads_q=4, heads_kv=2, head_dim=32)
CONFIGS: dict[str, dict[str, Any]] = {
    "pbs_defaults": {},
    "pbs_defaults_planned": {"dense_fallback": {"max_density": None}},
    "pbs_budget_0.2": {"selector": {"name": "budget", "density": 0.2}},
}
METHODS = ("pbs_defaults", "pbs_defaults_planned", "pbs_budget_0.2", "torch_ring")
SINGLE_SKIPS = ("pbs_defaults_planned",)  # not run on one GPU (time)
LONG = 1 << 20
_MESH = None  # torch's device mesh, made once
_RING_WAY: tuple[str, bool] | None = None  # (backend, native GQA) of torch's ring that ran


# --------------------------------------------------------------------------------------------
# Processes


# --------------------------------------------------------------------------------------------
# Inputs and timing


def whole_sequence(n: int, shape: dict[str, int], dtype: torch.dtype, device: torch.device, seed: int):
    """``q (1, Hq, N, D)``, ``k``, ``v (1, Hkv, N, D)``: the same on every rank (seeded on the device)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    hq, hkv, d = shape["heads_q"], shape["heads_kv"], shape["head_dim"]
    return tuple(torch.randn(1, h, n, d, generator=gen, device=device, dtype=dtype) for h in (hq, hkv, hkv))


class Stopwatch:
    def __init__(self, cuda: bool):
        self.cuda = cuda

    def __call__(self, fn) -> tuple[float, Any]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end), result
        began = time.perf_counter()
        result = fn()
        return (time.perf_counter() - began) * 1e3, result


def timed(ranks: Ranks, fn, warmup: int, repeats: int) -> tuple[list[float], list[Any]]:
    """This rank's times (ms) of ``repeats`` calls after ``warmup`` ones, each after a barrier."""
    watch = Stopwatch(ranks.cuda)
    for _ in range(warmup):
        ranks.barrier()
        fn()
    times, results = [], []
    for _ in range(repeats):
        ranks.barrier()
        ms, result = watch(fn)
        times.append(ms)
        results.append(result)
    ranks.sync()
    return times, results


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


# --------------------------------------------------------------------------------------------
# Rows


def pbs_row(ranks: Ranks, q, k, v, config: dict, warmup: int, repeats: int) -> dict[str, Any]:
    import pbs.distributed as cp

    times, results = timed(ranks, lambda: cp.context_parallel_attend(q, k, v, config, timings=True), warmup, repeats)
    last = results[-1]
    phases = {name: median([r.timings[name] for r in results]) for name in last.timings}
    selected = allowed = 0
    for plan in last.plans:
        if plan is not None:
            layout = plan.layout
            selected += int(plan.mask.counts.sum())
            allowed += layout.batch * layout.heads_q * layout.total_allowed_blocks
    return {"times_ms": times, "phases_ms": phases, "reason": last.reason, "selected": selected, "allowed": allowed,
            "chunks": [list(c) for c in last.chunks], "peak_gib": peak_gib(q.device)}


def torch_ring_row(ranks: Ranks, n: int, shape: dict, dtype, seed: int, warmup: int, repeats: int,
                   rotate: str | None) -> dict[str, Any]:
    """torch's ring attention; the first (backend, GQA) way that runs is kept."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        from torch.distributed.tensor.experimental import context_parallel
    except ImportError as error:
        return {"error": f"torch.distributed.tensor.experimental.context_parallel is not available: {error}"}
    rotate_used = None
    try:
        from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method

        if rotate:
            set_rotate_method(rotate)
        rotate_used = str(getattr(_cp_options, "rotate_method", None))
    except ImportError:
        pass
    global _MESH, _RING_WAY
    if _MESH is None:
        _MESH = init_device_mesh(ranks.device.type, (ranks.world,))
    mesh = _MESH
    ways = [(SDPBackend.CUDNN_ATTENTION, True), (SDPBackend.FLASH_ATTENTION, True),
            (SDPBackend.CUDNN_ATTENTION, False), (SDPBackend.FLASH_ATTENTION, False),
            (SDPBackend.EFFICIENT_ATTENTION, False)]
    if _RING_WAY:  # the way that ran at a shorter length
        ways = [w for w in ways if (w[0].name, w[1]) == _RING_WAY]
    errors = []
    group = shape["heads_q"] // shape["heads_kv"]
    for backend, native_gqa in ways:
        q, k, v = whole_sequence(n, shape, dtype, ranks.device, seed)
        if not native_gqa:
            k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
        reset_peak(ranks.device)
        try:
            with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2], no_restore_buffers={q, k, v}):
                def call():
                    with sdpa_kernel([backend]):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=native_gqa)

                times, _ = timed(ranks, call, warmup, repeats)
            _RING_WAY = (backend.name, native_gqa)
            return {"times_ms": times, "backend": backend.name, "gqa": "enable_gqa" if native_gqa else "expanded K/V",
                    "rotate_method": rotate_used, "peak_gib": peak_gib(ranks.device)}
        except Exception as error:  # noqa: BLE001 - recorded, and the next way is tried
            errors.append(f"{backend.name}, {'enable_gqa' if native_gqa else 'expanded K/V'}: "
                          f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}")
        finally:
            del q, k, v
    return {"error": "torch ring attention did not run: " + " | ".join(errors)}


def kv_allgather_ms(ranks: Ranks, k: torch.Tensor, v: torch.Tensor) -> float:
    import torch.distributed as dist

    def gather():
        for x in (k, v):
            out = [torch.empty_like(x) for _ in range(ranks.world)]
            dist.all_gather(out, x)

    times, _ = timed(ranks, gather, 1, 3)
    return median(times)


def one_gpu_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Causal SDPA on one GPU through the kernel the ring ran (cuDNN with ``enable_gqa`` where it
    runs, as the ring's first choice), so that the scaling compares one kernel with itself; left to
    itself SDPA takes FlashAttention-2 first (torch's default order). Returns the call, with the
    backend's name in ``.backend``."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend_name, native_gqa = _RING_WAY or ("CUDNN_ATTENTION", True)
    backends = [getattr(SDPBackend, backend_name)] + [b for b in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION)
                                             if b.name != backend_name]
    group = q.shape[1] // k.shape[1]
    if not native_gqa:
        k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
    for backend in backends:
        def call(backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=native_gqa)

        try:
            call()
        except RuntimeError:  # this backend does not take these inputs: the next one
            continue
        call.backend = backend.name
        return call
    raise RuntimeError("no SDPA backend of cuDNN and FlashAttention runs these inputs")


def single_gpu_rows(n: int, shape: dict, dtype, device: torch.device, seed: int, warmup: int, repeats: int,
                    methods: list[str]) -> list[dict[str, Any]]:
    import pbs
    from pbs.dense import DensePolicy

    q, k, v = whole_sequence(n, shape, dtype, device, seed)
    watch = Stopwatch(device.type == "cuda")
    rows = []
    calls = {name: config for name, config in CONFIGS.items() if name in methods and name not in SINGLE_SKIPS}
    if "torch_ring" in methods:
        calls["sdpa"] = None
    for name, config in calls.items():
        reset_peak(device)
        try:
            if config is None:
                fn = one_gpu_sdpa(q, k, v)
            else:
                policy = DensePolicy(pbs.PBSConfig.coerce(config))
                fn = lambda: pbs.api.attend(q, k, v, policy)  # noqa: E731
            for _ in range(warmup):
                fn()
            results = [watch(fn) for _ in range(repeats)]
            row = {"seq_len": n, "method": name, "world": 1, "time_ms": median([t for t, _ in results]),
                   "times_ms": [t for t, _ in results], "peak_gib": peak_gib(device)}
            if config is None:
                row["backend"] = fn.backend
            else:
                attended = results[-1][1]
                row["reason"] = attended.reason
                row["density"] = attended.plan.density if attended.plan is not None and attended.reason is None else None
            rows.append(row)
        except torch.OutOfMemoryError:
            rows.append({"seq_len": n, "method": name, "world": 1, "error": "did not fit (out of memory)"})
        print(f"  one GPU {n:>8} {name:<22} {rows[-1].get('time_ms') or rows[-1].get('error')}", flush=True)
    del q, k, v
    return rows


# --------------------------------------------------------------------------------------------
# Main


def summarize(per_rank: list[dict[str, Any]], n: int, method: str, world: int, extra: dict) -> dict[str, Any]:
    errors = [r.get("error") for r in per_rank if r.get("error")]
    row: dict[str, Any] = {"seq_len": n, "method": method, "world": world, **extra}
    if errors:
        row["error"] = errors[0]
        return row
    calls = list(zip(*[r["times_ms"] for r in per_rank]))
    slowest = [max(c) for c in calls]
    row.update(time_ms=median(slowest), times_ms=slowest,
               time_ms_per_rank=[median(r["times_ms"]) for r in per_rank],
               peak_gib_per_rank=[r["peak_gib"] for r in per_rank])
    if "phases_ms" in per_rank[0]:
        phases = [r["phases_ms"] for r in per_rank]
        busy = [p["attention"] for p in phases]
        row.update(
            phases_ms_per_rank=phases,
            busy_ms_per_rank=busy,
            max_idle_share=1 - min(busy) / max(busy) if max(busy) > 0 else 0.0,
            time_without_planning_ms=median([s - max(p["planning"] for p in phases) for s in slowest]),
            reason=per_rank[0]["reason"],
            density=(sum(r["selected"] for r in per_rank) / sum(r["allowed"] for r in per_rank)
                     if per_rank[0]["reason"] is None and sum(r["allowed"] for r in per_rank) else None),
            chunks_per_rank=[r["chunks"] for r in per_rank],
        )
    for key in ("backend", "gqa", "rotate_method"):
        if key in per_rank[0]:
            row[key] = per_rank[0][key]
    return row


def scaling(rows: list[dict[str, Any]], single: list[dict[str, Any]], world: int) -> list[dict[str, Any]]:
    out = []
    base = {(r["seq_len"], r["method"]): r.get("time_ms") for r in single}
    for row in rows:
        method = "sdpa" if row["method"] == "torch_ring" else row["method"]
        t1 = base.get((row["seq_len"], method))
        if t1 and row.get("time_ms"):
            speedup = t1 / row["time_ms"]
            out.append({"seq_len": row["seq_len"], "method": row["method"], "one_gpu": method, "one_gpu_ms": t1,
                        "time_ms": row["time_ms"], "speedup": speedup, "efficiency": speedup / world})
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[262144, 524288, 1048576])
    parser.add_argument("--single-lens", type=int, nargs="*", default=[262144, 524288],
                        help="lengths of the one-GPU baseline (rank 0 alone)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--long-repeats", type=int, default=3, help="timed calls from 1M tokens on")
    parser.add_argument("--single-repeats", type=int, default=3, help="timed calls of the one-GPU rows")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--torch-rotate", choices=["allgather", "alltoall"], default=None,
                        help="torch's rotate method (default: torch's own default)")
    parser.add_argument("--budget-s", type=float, default=300, help="skip the rows left after this many seconds")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (4 / 2 heads of 32, fp32), 2048 and 2432 tokens")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--retarget", type=Path, default=None, metavar="JSON",
                        help="recompute the targets of a saved result from its rows, and run nothing")
    args = parser.parse_args(argv)
    if args.smoke:
        if "--seq-lens" not in argv:
            args.seq_lens = [2048, 2432]
        if "--single-lens" not in argv:
            args.single_lens = [2048]
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.retarget:
        retarget(args.retarget)
        return 0
    if args.world > 1 and "LOCAL_RANK" not in os.environ:
        return relaunch_under_torchrun(__file__, args.world, argv)
    ranks = Ranks(args.device)
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    dtype = torch.float32 if args.smoke else torch.bfloat16
    if args.smoke:  # plan at the smoke lengths
        for name, config in CONFIGS.items():
            CONFIGS[name] = {**config, "dense_fallback": {**config.get("dense_fallback", {}), "min_seq_len": 0}}
    began = time.perf_counter()
    rows: list[dict[str, Any]] = []
    ok = False
    try:
        if ranks.world > 1:
            import pbs.distributed as cp

            for n in args.seq_lens:
                repeats = args.long_repeats if n >= LONG else args.repeats
                q_all, k_all, v_all = whole_sequence(n, shape, dtype, ranks.device, args.seed)
                q, k, v = (cp.shard_sequence(x, ranks.rank, ranks.world) for x in (q_all, k_all, v_all))
                del q_all, k_all, v_all
                # The gather context_parallel_attend makes: every rank's shard, padded to the longest.
                longest = max(cp.shard_length(n, r, ranks.world) for r in range(ranks.world))
                kv_shape = (1, shape["heads_kv"], longest, shape["head_dim"])
                comm = {"kv_allgather_ms": kv_allgather_ms(
                    ranks, *(torch.empty(kv_shape, dtype=dtype, device=ranks.device) for _ in range(2)))}
                for method in args.methods:
                    if ranks.from_rank0(time.perf_counter() - began > args.budget_s):
                        rows.append({"seq_len": n, "method": method, "world": ranks.world,
                                     "error": "skipped: time budget spent"})
                        continue
                    reset_peak(ranks.device)
                    if method == "torch_ring":
                        result = torch_ring_row(ranks, n, shape, dtype, args.seed, args.warmup, repeats, args.torch_rotate)
                    else:
                        try:
                            result = pbs_row(ranks, q, k, v, CONFIGS[method], args.warmup, repeats)
                        except torch.OutOfMemoryError:
                            result = {"error": "did not fit (out of memory)"}
                    row = summarize(ranks.gather(result), n, method, ranks.world, comm)
                    rows.append(row)
                    if ranks.rank == 0:
                        print(describe(row), flush=True)
                del q, k, v
        single: list[dict[str, Any]] = []
        if ranks.rank == 0:
            for n in args.single_lens:
                if time.perf_counter() - began > args.budget_s:
                    single.append({"seq_len": n, "world": 1, "error": "skipped: time budget spent"})
                    continue
                single += single_gpu_rows(n, shape, dtype, ranks.device, args.seed, args.warmup, args.single_repeats,
                                          args.methods)
        ranks.barrier()
        if ranks.rank == 0:
            result = {
                "benchmark": "context_parallel", "world": ranks.world, "backend": "nccl" if ranks.cuda else "gloo",
                "environment": environment(ranks.device), "shape": {"batch": 1, **shape, "dtype": str(dtype)},
                "inputs": f"random (torch.randn on the device, seed {args.seed})",
                "configs": CONFIGS, "warmup": args.warmup, "repeats": args.repeats, "long_repeats": args.long_repeats,
                "single_repeats": args.single_repeats,
                "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
                "rows": rows, "one_gpu": single, "scaling": scaling(rows, single, ranks.world),
                "targets": targets(rows, single, ranks.world), "wall_s": time.perf_counter() - began,
            }
            print_table(result)
            if args.json:
                save(result, args.json)
                print(f"wrote {args.json}")
        ok = True
    finally:
        ranks.close(ok)
    return 0


def describe(row: dict[str, Any]) -> str:
    if row.get("error"):
        return f"{row['seq_len']:>8} {row['method']:<22} {row['error']}"
    text = f"{row['seq_len']:>8} {row['method']:<22} {row['time_ms']:10.1f} ms"
    if "phases_ms_per_rank" in row:
        ph = row["phases_ms_per_rank"][0]
        path = "dense: " + row["reason"] if row["reason"] else "density {:.3f}".format(row["density"])
        text += (f"  rank0 phases: summaries {ph['summaries']:.1f} planning {ph['planning']:.1f} "
                 f"kv_wait {ph['kv_wait']:.1f} attention {ph['attention']:.1f}; idle {row['max_idle_share']:.1%}; {path}")
    elif row.get("backend"):
        text += f"  ({row['backend']}, {row['gqa']})"
    return text


def targets(rows: list[dict[str, Any]], single: list[dict[str, Any]], world: int) -> dict[str, Any]:
    """The issue's targets, read off the rows (None where a row is missing)."""
    at = {(r["seq_len"], r["method"]): r for r in rows}
    longest = max((r["seq_len"] for r in rows), default=None)
    ring = at.get((longest, "torch_ring"), {}).get("time_ms")
    sparse = at.get((longest, "pbs_budget_0.2"), {}).get("time_ms")
    eff = {s["method"]: s["efficiency"] for s in scaling(rows, single, world) if s["seq_len"] == 524288}
    idle: dict[str, float] = {}
    for r in rows:
        if r.get("max_idle_share") is not None:
            idle[r["method"]] = max(idle.get(r["method"], 0.0), r["max_idle_share"])
    return {
        "speedup_vs_torch_ring_at_longest_density_0.2": ring / sparse if ring and sparse else None,
        "longest": longest,
        "efficiency_at_512k": eff or None,
        "max_idle_share_per_method": idle or None,
        "max_idle_share_per_gpu_speed": speed_normalized_idle(rows) or None,
    }


def speed_normalized_idle(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per method, the largest idle share over the lengths once each GPU's own speed is divided out.

    A GPU that runs slower than its peers (a thermal throttle, say) makes its rank the slowest
    whatever the split, and ``max_idle_share`` cannot tell that from unequal work. A dense row
    (``reason`` set: every rank runs every allowed pair, and the zigzag split gives each the same
    number) measures each GPU's speed at that length: ``speed_r = busy_r / mean(busy)``. Dividing
    another row's busy times by those speeds leaves the imbalance of its work; the dense row
    itself is not scored. Lengths without a dense row are skipped.
    """
    gauges = {r["seq_len"]: r["busy_ms_per_rank"] for r in rows if r.get("reason") and r.get("busy_ms_per_rank")}
    idle: dict[str, float] = {}
    for r in rows:
        gauge = gauges.get(r["seq_len"])
        busy = r.get("busy_ms_per_rank")
        if gauge is None or not busy or r.get("reason") or min(gauge) <= 0:
            continue
        mean = sum(gauge) / len(gauge)
        normalized = [b / (g / mean) for b, g in zip(busy, gauge)]
        share = 1 - min(normalized) / max(normalized) if max(normalized) > 0 else 0.0
        idle[r["method"]] = max(idle.get(r["method"], 0.0), share)
    return idle


def retarget(path: Path) -> None:
    """Recomputes ``targets`` of a saved result from its rows (after `targets` gained a field),
    keeping everything the run recorded, and prints them."""
    result = json.loads(path.read_text())
    result["targets"] = targets(result["rows"], result["one_gpu"], result["world"])
    result["targets_recomputed_by"] = f"python benchmarks/bench_context_parallel.py --retarget {path}"
    save(result, path)  # the run's own provenance wins over today's (save puts the result's keys last)
    print("targets:", result["targets"])


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{result['environment']['device']} x {result['world']} ({result['backend']})")
    print(f"{'N':>8} {'method':<22} {'ms':>10} {'kv gather ms':>13} {'idle':>6} {'peak GiB':>9}  path")
    for r in result["rows"]:
        if r.get("error"):
            print(f"{r['seq_len']:>8} {r['method']:<22} {r['error']}")
            continue
        idle = f"{r['max_idle_share']:.1%}" if r.get("max_idle_share") is not None else ""
        peak = max((p for p in r["peak_gib_per_rank"] if p is not None), default=None)
        path = ("dense: " + r["reason"]) if r.get("reason") else (f"density {r['density']:.3f}" if r.get("density") else
                                                                  r.get("backend", ""))
        print(f"{r['seq_len']:>8} {r['method']:<22} {r['time_ms']:10.1f} {r['kv_allgather_ms']:13.1f} {idle:>6} "
              f"{peak if peak is None else round(peak, 1)!s:>9}  {path}")
    for s in result["scaling"]:
        print(f"scaling {s['seq_len']:>8} {s['method']:<22} one GPU {s['one_gpu_ms']:.1f} ms -> {s['time_ms']:.1f} ms: "
              f"{s['speedup']:.2f}x, efficiency {s['efficiency']:.1%}")
    print("targets:", result["targets"])


if __name__ == "__main__":
    sys.exit(main())
