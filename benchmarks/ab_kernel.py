"""A/B of the Gluon kernel against another copy of its module, on the kernel benchmark's inputs.

A kernel change moves its time by a few percent, less than the drift between runs on the GPU
machine, so two separate runs of `bench_kernel.py` cannot tell it. This times the two kernels
alternately (``--rounds`` rounds, each one median of CUDA-event timings per kernel) on the same
prepared calls, so both see the same drift, and checks whether their outputs are bit-identical
(and if not, by how much they differ).
``--interleaved`` times them call by call instead, in a rotating order, with the GPU kept busy
while the host launches (device time, `pbs.testing.benchmark_cuda_interleaved`).

``--before`` is a copy of ``pbs/kernels/hopper_attn.py`` from another revision
(``git show REV:pbs/kernels/hopper_attn.py > /tmp/hopper_before.py``); "after" is the module in
this tree. ``--variant NAME=FILE`` (repeatable) adds further copies, timed in the same rounds and
compared with "before" (time, bit-identical or the largest difference): several candidate changes
in one run, each against the same baseline. Where "after" is the same kernel as "before", its
ratio is the A/B's own noise. Sparse points use `bench_kernel.py`'s shapes and masks (``budget``
selections on ``last_block``-permuted keys); ``--dense`` adds the dense mode (every visible key,
``launch_hopper_dense``) beside cuDNN's dense causal time. ``--precision fp8`` (or another of
`pbs.kernels.hopper_attn.QUANTIZED_PRECISIONS`) times the quantized kernels on calls quantized once,
outside the timing, by each module's own ``quantize_for_hopper``.

    python benchmarks/ab_kernel.py --before /tmp/hopper_before.py --json benchmarks/results/kernel/ab.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: python3 benchmarks/ab_kernel.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    BUSY_GPU_CYCLES, KERNEL_SHAPE, cudnn_dense, environment, kernel_plan, load_module_file, save, time_ms,
)
from pbs.kernels import hopper_attn  # noqa: E402
from pbs.kernels.block_sparse_attn import prepare_call  # noqa: E402
from pbs.testing import benchmark_cuda_interleaved  # noqa: E402

BATCH, HEADS_Q, HEADS_KV, HEAD_DIM = KERNEL_SHAPE


def alternate(runs: dict, rounds: int) -> dict:
    """``{name: median ms}`` of ``rounds`` rounds that time every entry of ``runs`` in turn."""
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            times[name].append(time_ms(fn, repeats=1))
    return {name: statistics.median(ms) for name, ms in times.items()}


INTERLEAVED_BUDGET_MS = 3000.0  # per point, all kernels together


def interleaved(runs: dict) -> dict:
    """``{name: median ms}`` of device time, call by call in a rotating order
    (`pbs.testing.benchmark_cuda_interleaved`, the GPU kept busy while the host launches): 10 to
    60 calls each, as many as fit ``INTERLEAVED_BUDGET_MS``."""
    first = next(iter(runs.values()))
    once = time_ms(first, budget_ms=50.0, repeats=1)
    iters = max(10, min(60, int(INTERLEAVED_BUDGET_MS / (once * len(runs)))))
    return benchmark_cuda_interleaved(runs, warmup=2, iters=iters, busy_gpu_cycles=BUSY_GPU_CYCLES)


def against_before(out: torch.Tensor, before: torch.Tensor) -> dict:
    """``{identical, max_abs_diff}``: ``out`` bit for bit ``before``'s, and their largest absolute
    difference (a NaN where the other has a number counts as inf)."""
    return {"identical": bool(torch.equal(out, before)),
            "max_abs_diff": float((out.float() - before.float()).abs().nan_to_num(float("inf")).max())}


def variant_point(ms: dict, outs: dict) -> dict:
    """``{name: {ms, over_before, identical, max_abs_diff}}`` of every kernel but "before" and
    "after": its median time, over "before"'s, and its output against "before"'s."""
    return {name: {"ms": ms[name], "over_before": ms[name] / ms["before"], **against_before(out, outs["before"])}
            for name, out in outs.items() if name not in ("before", "after")}


def same_or_difference(comparison: dict) -> str:
    return "identical" if comparison["identical"] else f"differs by up to {comparison['max_abs_diff']:.2g}"


def describe(point: dict) -> str:
    """The variants' part of a point's printed line."""
    return "".join(f"; {name} {v['ms']:.3f} ms ({v['over_before']:.3f}x), {same_or_difference(v)}"
                   for name, v in point["variants"].items())


def parse_variants(specs: list[str]) -> dict[str, str]:
    """``{name: file}`` from ``NAME=FILE`` arguments."""
    variants = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path or name in ("before", "after") or name in variants:
            raise SystemExit(f"--variant takes NAME=FILE with a new name other than before/after; got {spec!r}")
        variants[name] = path
    return variants


def run(args) -> dict:
    before = load_module_file("hopper_attn_before", args.before)
    variants = parse_variants(args.variant)
    kernels = {"before": before, "after": hopper_attn,
               **{name: load_module_file(f"hopper_attn_{name}", path) for name, path in variants.items()}}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    result = {**environment("cuda"), "before": args.before, "variants": args.variant, "rounds": args.rounds,
              "precision": args.precision,
              "shape": {"batch": BATCH, "heads_q": HEADS_Q, "heads_kv": HEADS_KV, "head_dim": HEAD_DIM,
                        "dtype": "bfloat16", "causal": True, "masks": "bench_kernel.py (budget, last_block)"},
              "timing": ("median device time, the kernels call by call in a rotating order, the GPU kept busy "
                         "while the host launches (benchmark_cuda_interleaved)" if args.interleaved else
                         "median over rounds of one median of CUDA-event times per kernel, kernels alternating"),
              "points": []}
    for n in args.n:
        gen = torch.Generator(device="cuda").manual_seed(n)
        q = torch.randn(BATCH, HEADS_Q, n, HEAD_DIM, device="cuda", generator=gen).bfloat16()
        k = torch.randn(BATCH, HEADS_KV, n, HEAD_DIM, device="cuda", generator=gen).bfloat16()
        v = torch.randn(BATCH, HEADS_KV, n, HEAD_DIM, device="cuda", generator=gen).bfloat16()
        cudnn_ms = cudnn_dense(q, k, v)[0] if args.dense else None
        for density in args.densities:
            plan = kernel_plan(q, k, density)
            kp, vp = plan.key_permutation.apply(k), plan.key_permutation.apply(v)
            calls = {name: prepare_call(q, kp, vp, plan.mask, None, plan.key_positions(), None, True, None)
                     for name in kernels}
            for name, call in calls.items():
                kernels[name].quantize_for_hopper(call, args.precision)
                call.out.fill_(float("nan"))
                kernels[name].launch_hopper(call, sms)
            after = against_before(calls["after"].out, calls["before"].out)
            runs = {name: (lambda m=kernels[name], c=calls[name]: m.launch_hopper(c, sms)) for name in kernels}
            ms = interleaved(runs) if args.interleaved else alternate(runs, args.rounds)
            point = {"n": n, "mode": "sparse", "density": plan.density, "before_ms": ms["before"],
                     "after_ms": ms["after"], "after_over_before": ms["after"] / ms["before"], **after,
                     "variants": variant_point(ms, {name: call.out for name, call in calls.items()})}
            result["points"].append(point)
            print(f"N={n} density {plan.density:.3f}: before {ms['before']:.3f} ms, after {ms['after']:.3f} ms "
                  f"({point['after_over_before']:.3f}x), {same_or_difference(after)}{describe(point)}", flush=True)
            calls = kp = vp = plan = None
        if args.dense:
            outs = {name: torch.full((BATCH, HEADS_Q, n, HEAD_DIM), float("nan"), dtype=q.dtype, device="cuda")
                    for name in kernels}
            runs = {name: (lambda m=kernels[name], o=outs[name]: m.launch_hopper_dense(
                q, k, v, o, scale=HEAD_DIM ** -0.5, causal=True, sm_count=sms)) for name in kernels}
            for fn in runs.values():
                fn()
            after = against_before(outs["after"], outs["before"])
            ms = interleaved(runs) if args.interleaved else alternate(runs, args.rounds)
            point = {"n": n, "mode": "dense", "density": 1.0, "before_ms": ms["before"], "after_ms": ms["after"],
                     "after_over_before": ms["after"] / ms["before"], **after, "cudnn_ms": cudnn_ms,
                     "cudnn_over_after": cudnn_ms / ms["after"], "cudnn_over_before": cudnn_ms / ms["before"],
                     "variants": variant_point(ms, outs)}
            result["points"].append(point)
            print(f"N={n} dense mode: before {ms['before']:.3f} ms, after {ms['after']:.3f} ms "
                  f"({point['after_over_before']:.3f}x), cuDNN {cudnn_ms:.3f} ms ({point['cudnn_over_after']:.3f}x "
                  f"after), {same_or_difference(after)}{describe(point)}", flush=True)
            outs = runs = None
        q = k = v = None
        torch.cuda.empty_cache()
        if args.json:
            save(result, args.json)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="a copy of pbs/kernels/hopper_attn.py to compare against")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=FILE",
                        help="a further copy of pbs/kernels/hopper_attn.py timed against --before (repeatable)")
    parser.add_argument("--n", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    parser.add_argument("--densities", type=float, nargs="+", default=[0.1, 0.3, 0.5])
    parser.add_argument("--dense", action="store_true", help="also the dense mode, beside cuDNN")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--interleaved", action="store_true",
                        help="time device time call by call in a rotating order instead of in rounds (--rounds unused)")
    parser.add_argument("--precision", default="native", choices=["native", *hopper_attn.QUANTIZED_PRECISIONS],
                        help="the sparse points' precision (the dense mode runs natively only)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.dense and args.precision != "native":
        parser.error("--dense times the dense mode, which runs in the inputs' precision only: leave out --precision")
    if not torch.cuda.is_available():
        raise SystemExit("ab_kernel.py times the Gluon kernel: it needs a Hopper GPU")
    run(args)


if __name__ == "__main__":
    main()
