"""What a user gets from ``pbs.attention(q, k, v)`` with no config, against cuDNN (target: at most 1.03x);
with ``--preset NAME``, from ``pbs.attention(q, k, v, config=NAME)`` (for example the ``fp8`` preset);
with ``--config FILE`` (or JSON text), from any config.

For each length, on two kinds of input:
    flat        random q, k, v (attention is nearly uniform, so PBS should run dense)
    structured  ``pbs.testing.make_qkv`` (sparse from 16K on)
it times cuDNN SDPA (GQA through ``enable_gqa``, the backend forced outside the timed call) and
``pbs.attention`` with the default config, two ways:
    events      CUDA events around each call, L2 flushed before it, cuDNN and pbs taking turns call by
                call (``pbs.testing.benchmark_cuda_interleaved``; host overhead shows where it
                exceeds the flush); a second cuDNN entry in the same rotation (``cudnn_again``,
                cuDNN against itself, ratio ``ratio_events_aa``) shows the protocol's own spread
    busy        the same rotation with about 5 ms of GPU busy work queued after the flush (the
                GPU busy while the host launches, as in a model's layer loop): device time, plus
                any host time after a sync inside the call (the density probe's read)
    wall        back-to-back calls, wall time over the batch divided by the calls (what a loop
                over layers sees; a host sync inside a call shows here)
the density probe alone (``probe``: its two launches and its host read, events), and records
which path ``pbs.attention`` took (dense by length, dense by the density probe,
dense after planning, or sparse). Shapes: B=1, Hq=32, Hkv=8, D=128, bf16, causal.
``--graph`` adds ``pbs.attention`` replayed from a CUDA graph to both rotations (``pbs_graph_*``:
the call without its host time; sparse always, as a capture skips the density rules).
``--profile`` adds, per point, where one ``pbs.attention`` call's GPU time goes (``pbs_kernels``:
torch.profiler's kernels summed by name, `benchmarks.common.profile_call`; ``pbs_kernel_ms`` all of
them, ``pbs_kernel_launches`` how many, ``pbs_kernel_span_ms`` first start to last end, whose excess
over ``pbs_kernel_ms`` is the GPU waiting on the host inside the call, and ``pbs_kernel_gaps`` the
longest of those waits with the kernels around them) and where the host's time goes
(``pbs_host_return_ms``: until a call on an idle GPU returns; ``pbs_host_functions``: cProfile's
functions by own time, `benchmarks.common.host_profile`), to tell a config's end-to-end time from
its attention kernel's.

    python benchmarks/bench_defaults.py --json benchmarks/results/defaults/defaults_<device>.json
    python benchmarks/bench_defaults.py --preset fp8 --lengths 32768 65536 131072 --inputs structured
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

if __package__ in (None, ""):  # run as a file: python3 benchmarks/bench_defaults.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pbs  # noqa: E402
from benchmarks.common import environment, graph_of, host_profile, profile_call, save  # noqa: E402
from pbs.backends import CallSpec  # noqa: E402
from pbs.backends.eligibility import gated_dense_reasons  # noqa: E402
from pbs.dense import dense_attention_sdpa  # noqa: E402
from pbs.testing import benchmark_cuda, benchmark_cuda_interleaved  # noqa: E402

HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128
BUSY_GPU_CYCLES = 10_000_000  # about 5 ms on an H100: longer than pbs's host time before its launches
LENGTHS = [2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144, 524288]


def inputs(kind: str, n: int):
    if kind == "structured":
        return pbs.testing.make_qkv(batch=1, heads_q=HEADS_Q, heads_kv=HEADS_KV, seq_len=n, head_dim=HEAD_DIM,
                                    dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(n)
    q = torch.randn(1, HEADS_Q, n, HEAD_DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, HEADS_KV, n, HEAD_DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, HEADS_KV, n, HEAD_DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
    return q, k, v


def wall_ms(fn, calls: int) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / calls


def counts_for(n: int) -> tuple[int, int, int]:
    """(event iterations, event repeats, wall calls): fewer at long lengths to bound the run.

    A wall batch starts right after a host sync, when the host is slow for a while (on the H100
    machines a call's host time there was several times its time in a loop); 200 calls at 2K-8K
    keep that start from weighing on the per-call time, as it would not in a long layer loop.
    """
    if n >= 262144:
        return 3, 1, 3
    if n >= 65536:
        return 5, 3, 5
    if n >= 16384:
        return 20, 5, 30
    return 20, 5, 200


def path_of(q, k, v, config: pbs.PBSConfig) -> str:
    """What ``config`` ran on these inputs, by the dense rule the returned plan names."""
    _, plan = pbs.attention(q, k, v, config, return_plan=True)
    if plan.dense_rule == "length":
        return "dense (length)"
    if plan.dense_rule == "probe":
        # On Hopper the probe's dense path is the Gluon kernel, started before the probe is read.
        return "dense (probe, Gluon)" if not gated_dense_reasons(CallSpec.of(q, v.shape[-1], 128)) else "dense (probe, SDPA)"
    if plan.dense_rule == "planned_density":
        return "dense (density)"
    return f"sparse (density {plan.density:.3f})"


def rotations(cudnn, pbs_call, sdpa_path=None, graph: bool = False, capture=graph_of):
    """The calls each rotation times, by name: ``(events, busy, graph_error)``.

    Both rotations hold cuDNN, pbs and cuDNN again (the A/A control); the idle-GPU one also the
    dense SDPA path alone where ``sdpa_path`` is given. With ``graph``, both also replay ``pbs_call``
    captured in a CUDA graph (``pbs_graph``: the same call with no host work at all, what the call
    would cost if its host launches and reads took no time); where the capture fails, its error
    comes back instead and no graph is timed. A captured call skips the density rules and runs
    sparse (docs/gpu.md), so it compares with the eager call where that ran sparse too.
    """
    events = {"cudnn": cudnn, "pbs": pbs_call, "cudnn_again": cudnn}
    busy = dict(events)
    if sdpa_path is not None:
        events["sdpa_path"] = sdpa_path
    if not graph:
        return events, busy, None
    try:
        replay = capture(pbs_call).replay
    except Exception as error:  # noqa: BLE001 - a call that cannot be captured is a result, not a crash
        return events, busy, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    events["pbs_graph"] = busy["pbs_graph"] = replay
    return events, busy, None


def measure(kind: str, n: int, config: pbs.PBSConfig, profile: bool = False, graph: bool = False,
            capture=graph_of) -> dict:
    q, k, v = inputs(kind, n)
    iters, repeats, calls = counts_for(n)

    def cudnn():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def pbs_call():
        return pbs.attention(q, k, v, config)

    def sdpa_path():
        return dense_attention_sdpa(q, k, v, scale=HEAD_DIM**-0.5)

    row = {"input": kind, "seq_len": n, "path": path_of(q, k, v, config)}
    # Events: every call timed in turn with the others (drift falls on all alike); "cudnn_again"
    # is cuDNN once more, the A/A control. Wall: batches alternate over repeats.
    timed, busy_timed, graph_error = rotations(cudnn, pbs_call, sdpa_path if n < 16384 else None, graph, capture)
    if graph_error:
        row["pbs_graph_error"] = graph_error
    # cuDNN is forced around the whole rotation, outside the timed calls; pbs runs its own code
    # unchanged (its dense path would pick cuDNN anyway).
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        events = benchmark_cuda_interleaved(timed, warmup=1, iters=iters * repeats)
        busy = benchmark_cuda_interleaved(busy_timed, warmup=1, iters=iters * repeats, busy_gpu_cycles=BUSY_GPU_CYCLES)
    walls = {"cudnn": [], "pbs": []}
    for _ in range(repeats):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            walls["cudnn"].append(wall_ms(cudnn, calls))
        walls["pbs"].append(wall_ms(pbs_call, calls))
    for name in ("cudnn", "pbs"):
        row[f"{name}_events_ms"] = events[name]
        row[f"{name}_wall_ms"] = statistics.median(walls[name])
    row["cudnn_again_events_ms"] = events["cudnn_again"]
    row["ratio_events_aa"] = events["cudnn_again"] / events["cudnn"]
    for name in ("cudnn", "pbs", "cudnn_again"):
        row[f"{name}_busy_events_ms"] = busy[name]
    row["ratio_busy"] = busy["pbs"] / busy["cudnn"]
    row["ratio_busy_aa"] = busy["cudnn_again"] / busy["cudnn"]
    if "sdpa_path" in events:
        row["dense_sdpa_path_events_ms"] = events["sdpa_path"]
    if "pbs_graph" in events:
        row["pbs_graph_events_ms"], row["pbs_graph_busy_events_ms"] = events["pbs_graph"], busy["pbs_graph"]
        row["ratio_graph_busy"] = busy["pbs_graph"] / busy["cudnn"]
    if n >= pbs.PBSConfig().dense_fallback.min_seq_len:
        from pbs.kernels.density_probe import probe_density_triton

        probe_args = dict(block_size=128, num_blocks=pbs.PBSConfig().dense_fallback.probe_blocks, threshold=0.9,
                          scale=HEAD_DIM**-0.5)
        row["probe_events_ms"] = benchmark_cuda(lambda: probe_density_triton(q, k, **probe_args), warmup=1, iters=iters)
    if profile:
        profiled = profile_call(pbs_call)
        row["pbs_kernels"] = profiled["by_name"]
        row["pbs_kernel_launches"] = profiled["events"]
        row["pbs_kernel_ms"] = profiled["event_ms"]  # every kernel of the call, not only the listed ones
        row["pbs_kernel_span_ms"] = profiled["span_ms"]  # less pbs_kernel_ms: the GPU idle inside the call
        row["pbs_kernel_gaps"] = profiled["gaps"]
        host = host_profile(pbs_call)
        row["pbs_host_return_ms"] = host["return_ms"]
        row["pbs_host_functions"] = host["functions"]
    row["ratio_events"] = row["pbs_events_ms"] / row["cudnn_events_ms"]
    row["ratio_wall"] = row["pbs_wall_ms"] / row["cudnn_wall_ms"]
    del q, k, v
    torch.cuda.empty_cache()
    return row


def kernels_of(fn) -> list[str]:
    """Names of the CUDA kernels one call launches (to see which SDPA backend ran)."""
    return sorted(row["name"] for row in profile_call(fn, top=1 << 30)["by_name"])


def chosen_config(preset: str | None, config: str | None) -> tuple[pbs.PBSConfig, str]:
    """The config to time and its label: a preset by name, a config as JSON text or a JSON file, or the defaults."""
    if config:
        text = config if config.lstrip().startswith("{") else Path(config).read_text()
        return pbs.PBSConfig.model_validate_json(text), "--config"
    if preset:
        return pbs.PBSConfig.from_preset(preset), preset
    return pbs.PBSConfig(), "defaults"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=LENGTHS)
    parser.add_argument("--inputs", nargs="+", default=["flat", "structured"], choices=["flat", "structured"])
    parser.add_argument("--preset", default=None, choices=pbs.list_presets(),
                        help="time pbs.attention with this named config instead of the defaults")
    parser.add_argument("--config", default=None,
                        help="time pbs.attention with this config (JSON text or a JSON file) instead of the defaults")
    parser.add_argument("--json", help="where to write the results")
    parser.add_argument("--graph", action="store_true",
                        help="also time pbs.attention replayed from a CUDA graph captured at each point (pbs_graph_*): "
                             "the call without its host time")
    parser.add_argument("--profile", action="store_true",
                        help="also record each point's GPU kernels of one pbs.attention call (pbs_kernels) and where its host time goes (pbs_host_*)")
    args = parser.parse_args()
    if args.preset and args.config:
        parser.error("--preset and --config: give one of them")
    config, label = chosen_config(args.preset, args.config)
    started = time.time()
    rows = []
    print(f"{'input':>10} {'N':>7} | {'cuDNN ev':>9} {'pbs ev':>9} {'x':>6} {'A/A':>6} | {'cuDNN busy':>10} "
          f"{'pbs busy':>9} {'x':>6} {'A/A':>6} | {'cuDNN wall':>10} {'pbs wall':>9} {'x':>6} | {'probe':>6} | path")
    for n in args.lengths:
        for kind in args.inputs:
            try:
                row = measure(kind, n, config, args.profile, args.graph)
            except torch.OutOfMemoryError as error:
                row = {"input": kind, "seq_len": n, "error": str(error).splitlines()[0]}
                torch.cuda.empty_cache()
            rows.append(row)
            if "error" in row:
                print(f"{kind:>10} {n:>7} | {row['error']}", flush=True)
                continue
            print(f"{kind:>10} {n:>7} | {row['cudnn_events_ms']:9.3f} {row['pbs_events_ms']:9.3f} {row['ratio_events']:6.3f} "
                  f"{row['ratio_events_aa']:6.3f} | {row['cudnn_busy_events_ms']:10.3f} {row['pbs_busy_events_ms']:9.3f} "
                  f"{row['ratio_busy']:6.3f} {row['ratio_busy_aa']:6.3f} | "
                  f"{row['cudnn_wall_ms']:10.3f} {row['pbs_wall_ms']:9.3f} {row['ratio_wall']:6.3f} | "
                  f"{row.get('probe_events_ms', float('nan')):6.3f} | {row['path']}", flush=True)
            if "pbs_graph_events_ms" in row:
                print(f"{'':>18} pbs from a CUDA graph: events {row['pbs_graph_events_ms']:.3f}, busy "
                      f"{row['pbs_graph_busy_events_ms']:.3f} ({row['ratio_graph_busy']:.3f}x cuDNN)", flush=True)
            elif "pbs_graph_error" in row:
                print(f"{'':>18} no CUDA graph: {row['pbs_graph_error']}", flush=True)
            for kernel in row.get("pbs_kernels", []):
                print(f"{'':>18} {kernel['ms']:9.3f} ms in {kernel['calls']:>3} x {kernel['name'][:90]}", flush=True)
    q, k, v = inputs("structured", 4096)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        cudnn_kernels = kernels_of(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    pbs_kernels = kernels_of(lambda: pbs.attention(q, k, v, config))
    print("kernels at 4K, cuDNN:", cudnn_kernels, f"\nkernels at 4K, pbs ({label}):", pbs_kernels)
    worst = {m: max((r[f"ratio_{m}"] for r in rows if "error" not in r), default=None) for m in ("events", "busy", "wall")}
    print(f"worst ratio to cuDNN: events {worst['events']:.3f}, busy-GPU events {worst['busy']:.3f}, "
          f"wall {worst['wall']:.3f} (target 1.03)")
    result = {
        **environment("cuda"),
        "shape": {"batch": 1, "heads_q": HEADS_Q, "heads_kv": HEADS_KV, "head_dim": HEAD_DIM, "dtype": "bfloat16",
                  "causal": True},
        "preset": args.preset,
        "config": config.model_dump(mode="json"),
        "timing": "events: median CUDA-event time, L2 flushed before each call, cuDNN, pbs and cuDNN again "
                  "(the A/A control, ratio_events_aa) timed call by call in a rotating order on an idle GPU; "
                  f"busy: the same with {BUSY_GPU_CYCLES} GPU cycles of torch.cuda._sleep queued after the flush "
                  "(ratio_busy, A/A ratio_busy_aa); wall: median over repeats of back-to-back wall time / calls, "
                  "cuDNN and pbs batches alternating",
        "rows": rows,
        "kernels_4k": {"cudnn": cudnn_kernels, "pbs": pbs_kernels},
        "worst_ratio": worst,
        "target_ratio": 1.03,
        "wall_s": round(time.time() - started, 1),
    }
    if args.json:
        save(result, args.json)
        print("wrote", args.json)


if __name__ == "__main__":
    main()
