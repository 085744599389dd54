"""Speed of the block-sparse attention kernel against cuDNN dense attention and FlexAttention.

Protocol (docs/benchmarks.md): B=1, Hq=32, Hkv=8, D=128, bf16, causal, segment 256, block 128;
masks from the ``budget`` selector on ``last_block``-permuted keys (shared GQA). Every time is the
median of CUDA-event timings after warm-up, with the L2 cache flushed before each run
(:func:`pbs.testing.benchmark_cuda`). Our kernel is timed on already-permuted tensors (attention
only); ``ideal`` is the plan's actual density times cuDNN's dense causal time. "ours" is what
``block_sparse_attention`` runs by default (the warp-specialized Gluon kernel on Hopper); the
software-pipelined Triton kernel is timed too (``triton_ms``). Those times are of an idle GPU, so a
call's host time shows in them where it outlasts the flush (short calls); ``ours_device_ms`` and
``cudnn_device_ms`` time the same calls with the GPU kept busy while the host launches
(:func:`benchmarks.common.device_ms`), and ``device_ratio_to_ideal`` compares those.

    python benchmarks/bench_kernel.py --json benchmarks/results/kernel/h200.json
    python benchmarks/bench_kernel.py --n 32768 --densities 0.3 --variants 128,128,8,2 128,64,8,3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: python3 benchmarks/bench_kernel.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchmarks.common as common  # noqa: E402
from benchmarks.common import (  # noqa: E402
    KERNEL_BLOCK, KERNEL_SEGMENT, KERNEL_SHAPE, cudnn_dense, device_ms, environment, save, time_ms,
)
from benchmarks.common import kernel_plan as make_plan  # noqa: E402
from pbs.backends import CallSpec, resolve_backend  # noqa: E402
from pbs.kernels.block_sparse_attn import (  # noqa: E402
    TUNED_CONFIGS, KernelConfig, block_sparse_attention, prepare_call, select_config,
)

(BATCH, HEADS_Q, HEADS_KV, HEAD_DIM), SEGMENT, BLOCK = KERNEL_SHAPE, KERNEL_SEGMENT, KERNEL_BLOCK


def causal_tflops(n: int, ms: float) -> float:
    """Dense causal attention FLOPs (QK and PV over the N^2/2 causal pairs) per second."""
    return 4 * BATCH * HEADS_Q * HEAD_DIM * (n * n / 2) / (ms * 1e-3) / 1e12


def block_tflops(num_blocks: int, ms: float) -> float:
    """FLOPs of the computed (full) 128x128 blocks per second."""
    return 4 * BLOCK * BLOCK * HEAD_DIM * num_blocks / (ms * 1e-3) / 1e12


def gather_ms(point: dict, plan, k, v) -> None:
    """Applying the key permutation to K and V: torch.gather (Permutation.apply) vs the Triton kernel."""
    from pbs.kernels.gather import gather_kv

    perm = plan.key_permutation
    k_ref, v_ref = perm.apply(k), perm.apply(v)
    k_out, v_out = gather_kv(perm.indices, k, v)
    assert torch.equal(k_out, k_ref) and torch.equal(v_out, v_ref)
    point["gather_kv_torch_ms"] = time_ms(lambda: (perm.apply(k), perm.apply(v)))
    point["gather_kv_triton_ms"] = time_ms(lambda: gather_kv(perm.indices, k, v))
    moved = 2 * (k.numel() + v.numel()) * k.element_size() * (perm.heads // k.shape[1])
    print(f"  gather K+V: torch {point['gather_kv_torch_ms']:.3f} ms, triton {point['gather_kv_triton_ms']:.3f} ms "
          f"({moved / (point['gather_kv_triton_ms'] * 1e-3) / 1e12:.2f} TB/s read+write)", flush=True)


def run(args) -> dict:
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = 64  # one compiled flex per length and mask
    from pbs.kernels.flex import flex_block_sparse_attention, to_flex_block_mask

    props = torch.cuda.get_device_properties(0)
    result = {
        **environment("cuda"),
        "sm_count": props.multi_processor_count,
        "shape": {"batch": BATCH, "heads_q": HEADS_Q, "heads_kv": HEADS_KV, "head_dim": HEAD_DIM,
                  "dtype": "bfloat16", "segment": SEGMENT, "block": BLOCK, "causal": True,
                  "permuter": "last_block", "gqa": "shared", "selector": "budget"},
        "timing": f"median of {args.repeats} medians of CUDA-event times after warm-up, L2 flushed before each run",
        "points": [],
        "variants": [],
    }
    variants = [KernelConfig.parse(v) for v in args.variants]
    for n in args.n:
        gen = torch.Generator(device="cuda").manual_seed(n)
        q = torch.randn(BATCH, HEADS_Q, n, HEAD_DIM, device="cuda", generator=gen).bfloat16()
        k = torch.randn(BATCH, HEADS_KV, n, HEAD_DIM, device="cuda", generator=gen).bfloat16()
        v = torch.randn(BATCH, HEADS_KV, n, HEAD_DIM, device="cuda", generator=gen).bfloat16()
        if args.gather_only:
            point = {"n": n}
            gather_ms(point, make_plan(q, k, args.densities[0]), k, v)
            result["points"].append(point)
            continue
        cudnn_ms, cudnn_gqa = cudnn_dense(q, k, v)
        cudnn_device_ms = cudnn_dense(q, k, v, timer=device_ms)[0]
        print(f"N={n}: cuDNN {cudnn_ms:.3f} ms ({causal_tflops(n, cudnn_ms):.0f} TF/s, {cudnn_gqa})", flush=True)
        dense_ms = None
        for density in [*args.densities, 1.0]:
            plan = make_plan(q, k, density)
            kp, vp = plan.key_permutation.apply(k), plan.key_permutation.apply(v)
            kpos = plan.key_positions()
            blocks = int(plan.mask.counts.sum())

            if args.retune:
                TUNED_CONFIGS.clear()
            tuned = select_config(q, kp, vp, plan.mask, None, kpos)

            def ours(config=tuned):
                return block_sparse_attention(q, kp, vp, plan.mask, None, kpos, config=config)

            call = prepare_call(q, kp, vp, plan.mask, None, kpos, None, True, None)
            # The kernel `backend="auto"` runs for these inputs (the dispatch layer's rule).
            kernel = "hopper" if resolve_backend("auto", CallSpec.of(q, vp.shape[-1], BLOCK)).name == "hopper" else "triton"
            triton_ms = time_ms(ours)
            if kernel == "hopper":
                from pbs.kernels.hopper_attn import hopper_block_sparse_attention
                ours_call = lambda: hopper_block_sparse_attention(q, kp, vp, plan.mask, None, kpos)  # noqa: E731
            else:
                ours_call = ours
            ours_ms = time_ms(ours_call) if kernel == "hopper" else triton_ms
            ours_device_ms = device_ms(ours_call)
            point = {
                "n": n, "requested_density": density, "density": plan.density, "blocks": blocks, "kernel": kernel,
                "ours_ms": ours_ms, "triton_ms": triton_ms, "triton_config": str(tuned),
                "cudnn_ms": cudnn_ms, "cudnn_gqa": cudnn_gqa,
                "ideal_ms": plan.density * cudnn_ms, "ours_tflops_blocks": block_tflops(blocks, ours_ms),
                "cudnn_tflops": causal_tflops(n, cudnn_ms),
                "ours_device_ms": ours_device_ms, "cudnn_device_ms": cudnn_device_ms,
            }
            point["ratio_to_ideal"] = ours_ms / point["ideal_ms"]
            point["device_ratio_to_ideal"] = ours_device_ms / (plan.density * cudnn_device_ms)
            for cfg in variants if density in args.variant_densities and n in args.variant_n else []:
                try:
                    ms = time_ms(lambda cfg=cfg: ours(cfg))
                except Exception as exc:  # noqa: BLE001 - record and go on
                    ms = float("nan")
                    print(f"  variant {cfg} failed: {exc}")
                name = str(cfg)
                result["variants"].append({"n": n, "density": plan.density, "config": name, "ms": ms,
                                           "ratio_to_ideal": ms / point["ideal_ms"]})
                print(f"  variant {name}: {ms:.3f} ms = {ms / point['ideal_ms']:.3f} x ideal", flush=True)
            for stages in args.hopper_stages if kernel == "hopper" and n in args.variant_n else []:
                from pbs.kernels.hopper_attn import launch_hopper

                ms = time_ms(lambda s=stages: launch_hopper(call, torch.cuda.get_device_properties(q.device).multi_processor_count, s))
                result["variants"].append({"n": n, "density": plan.density, "config": f"hopper-stages{stages}", "ms": ms,
                                           "ratio_to_ideal": ms / point["ideal_ms"]})
                print(f"  hopper, {stages} stages: {ms:.3f} ms = {ms / point['ideal_ms']:.3f} x ideal", flush=True)
            if density == 1.0:
                dense_ms = ours_ms
                point["ours_vs_cudnn_throughput"] = cudnn_ms / ours_ms
            elif not args.no_flex:
                block_mask = to_flex_block_mask(plan.mask, None, kpos, causal=True)
                flex = lambda: flex_block_sparse_attention(q, kp, vp, plan.mask, block_mask=block_mask)  # noqa: E731
                point["flex_ms"] = time_ms(flex)
                point["flex_ratio_to_ideal"] = point["flex_ms"] / point["ideal_ms"]
            if density == args.densities[0]:
                gather_ms(point, plan, k, v)
            result["points"].append(point)
            flex_txt = f", flex {point['flex_ms']:.3f} ms ({point['flex_ratio_to_ideal']:.2f}x)" if "flex_ms" in point else ""
            print(f"  density {plan.density:.3f}: ours ({kernel}) {ours_ms:.3f} ms = {point['ratio_to_ideal']:.3f} x ideal "
                  f"(device time {ours_device_ms:.3f} ms = {point['device_ratio_to_ideal']:.3f} x ideal) "
                  f"({point['ours_tflops_blocks']:.0f} TF/s on blocks), triton [{tuned}] {triton_ms:.3f} ms{flex_txt}", flush=True)
            kp = vp = plan = block_mask = call = None  # free before the next plan
        if dense_ms is not None:
            print(f"  dense mode: ours {dense_ms:.3f} ms vs cuDNN {cudnn_ms:.3f} ms = {cudnn_ms / dense_ms:.3f} x cuDNN throughput")
        q = k = v = None
        torch.cuda.empty_cache()
        if args.json:  # after every length, so a run cut short still leaves its numbers
            save(result, args.json)
    return result


def print_table(result: dict) -> None:
    print(f"\n{result['device']}, torch {result['torch']}, triton {result['triton']}")
    print(f"{'N':>7} {'dens':>6} {'ours ms':>9} {'cuDNN ms':>9} {'ideal ms':>9} {'ours/ideal':>10} {'device/ideal':>12} "
          f"{'flex ms':>9} {'flex/ideal':>10} {'dense/cuDNN thr':>15} {'triton ms':>9}")
    for p in result["points"]:
        flex = f"{p['flex_ms']:9.3f} {p['flex_ratio_to_ideal']:10.3f}" if "flex_ms" in p else f"{'-':>9} {'-':>10}"
        thr = f"{p['ours_vs_cudnn_throughput']:15.3f}" if "ours_vs_cudnn_throughput" in p else f"{'':>15}"
        print(f"{p['n']:>7} {p['density']:6.3f} {p['ours_ms']:9.3f} {p['cudnn_ms']:9.3f} {p['ideal_ms']:9.3f} "
              f"{p['ratio_to_ideal']:10.3f} {p.get('device_ratio_to_ideal', float('nan')):12.3f} {flex} {thr} "
              f"{p.get('triton_ms', float('nan')):9.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    parser.add_argument("--densities", type=float, nargs="+", default=[0.1, 0.3, 0.5])
    parser.add_argument("--variants", nargs="*", default=[], help="extra configs bm,bn,warps,stages")
    parser.add_argument("--variant-densities", type=float, nargs="*", default=[0.3, 1.0])
    parser.add_argument("--variant-n", type=int, nargs="*", default=[32768, 65536])
    parser.add_argument("--hopper-stages", type=int, nargs="*", default=[], help="also time the Hopper kernel with these K/V ring depths")
    parser.add_argument("--no-flex", action="store_true")
    parser.add_argument("--gather-only", action="store_true", help="only time applying the key permutation")
    parser.add_argument("--retune", action="store_true", help="tune again at every point")
    parser.add_argument("--repeats", type=int, default=3, help="timing repeats (median of medians)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.exit(2, f"bench_kernel.py: times CUDA kernels and needs an NVIDIA GPU with a CUDA build of torch; torch "
                       f"{torch.__version__} sees no CUDA device here (the CPU benchmarks: python3 -m pytest "
                       "benchmarks/cpu)\n")
    common.REPEATS = args.repeats  # time_ms's default
    result = run(args)
    if not args.gather_only:
        print_table(result)
    if args.json:
        save(result, args.json)


if __name__ == "__main__":
    main()
