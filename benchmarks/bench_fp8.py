"""FP8 against bf16 on identical masks: speed of the Triton kernel in each precision, and error.

Protocol: the shapes and masks of `benchmarks/bench_kernel.py` (B=1, Hq=32, Hkv=8, D=128, bf16
inputs, causal, block 128, ``budget`` masks on ``last_block``-permuted keys). For every length and
density one plan is made and run by:

* ``bf16_triton`` / ``bf16_hopper``: the Triton kernel and the Gluon kernel (``auto``'s choice on
  Hopper) in the inputs' precision;
* ``fp8_qk`` / ``fp8`` (and with ``--precisions`` any quantized `PBSConfig.precision`, e.g.
  ``int8_qk``): the Triton kernel in that precision, timed as a user gets it (quantization
  included) and as attention alone on quantized inputs (``*_attention_ms``); the quantization pass
  alone is ``*_quantize_ms`` (an idle GPU's time, the host's launches included where they outlast
  the work) and ``*_quantize_device_ms`` (the GPU's time alone, `benchmarks.common.device_ms`);
* ``*_hopper_*``: the Gluon kernel in the same precision (every one of
  `pbs.kernels.hopper_attn.QUANTIZED_PRECISIONS`; ``auto``'s choice on Hopper), timed the same two
  ways, on a Hopper GPU.

Error (``--error-n``, default 4096): each path's output against fp32 attention over the same mask,
beside cuDNN bf16 dense's error against fp32 dense; on Gaussian inputs and on the structured inputs
of `pbs.testing.make_qkv` (peaked attention, heavy hitters).

    python benchmarks/bench_fp8.py --json benchmarks/results/kernel/fp8_h100.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: python3 benchmarks/bench_fp8.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    KERNEL_BLOCK, KERNEL_SHAPE, cudnn_dense, device_ms, environment, save, time_ms,
)
from benchmarks.common import kernel_plan as make_plan  # noqa: E402
from pbs.kernels.block_sparse_attn import (  # noqa: E402
    attach_lse, block_sparse_attention, prepare_call, quantize_call, run_prepared,
)

# The kernel benchmark's protocol (benchmarks/bench_kernel.py).
(BATCH, HEADS_Q, HEADS_KV, HEAD_DIM), BLOCK = KERNEL_SHAPE, KERNEL_BLOCK
PRECISIONS = ["fp8_qk", "fp8"]  # --precisions replaces them


def block_tflops(num_blocks: int, ms: float) -> float:
    """FLOPs of the computed 128x128 blocks per second."""
    return 4 * BLOCK * BLOCK * HEAD_DIM * num_blocks / (ms * 1e-3) / 1e12


def speed_point(q, k, v, n: int, density: float, cudnn_ms: float) -> dict:
    plan = make_plan(q, k, density)
    kp, vp = plan.key_permutation.apply(k), plan.key_permutation.apply(v)
    kpos = plan.key_positions()
    blocks = int(plan.mask.counts.sum())
    point = {"n": n, "requested_density": density, "density": plan.density, "blocks": blocks, "cudnn_ms": cudnn_ms}
    point["bf16_triton_ms"] = time_ms(lambda: block_sparse_attention(q, kp, vp, plan.mask, None, kpos))
    try:
        from pbs.kernels.hopper_attn import hopper_block_sparse_attention

        point["bf16_hopper_ms"] = time_ms(lambda: hopper_block_sparse_attention(q, kp, vp, plan.mask, None, kpos))
    except Exception as exc:  # noqa: BLE001 - not a Hopper GPU, or no Gluon: recorded, not fatal
        point["bf16_hopper_error"] = str(exc)[:200]
    best_bf16 = min(point["bf16_triton_ms"], point.get("bf16_hopper_ms", float("inf")))
    for precision in PRECISIONS:
        if "bf16_hopper_ms" in point:
            _time_hopper(point, precision, q, kp, vp, plan, kpos, blocks, best_bf16)
        point[f"{precision}_ms"] = time_ms(
            lambda p=precision: block_sparse_attention(q, kp, vp, plan.mask, None, kpos, precision=p))
        call = prepare_call(q, kp, vp, plan.mask, None, kpos, None, True, None)
        attach_lse(call, None)
        quantize_call(call, precision)
        point[f"{precision}_attention_ms"] = time_ms(lambda c=call: run_prepared(c))

        def quantize_only(p=precision):
            c = prepare_call(q, kp, vp, plan.mask, None, kpos, None, True, None)
            quantize_call(c, p)

        point[f"{precision}_quantize_ms"] = time_ms(quantize_only)
        point[f"{precision}_quantize_device_ms"] = device_ms(quantize_only)
        point[f"{precision}_speedup_vs_bf16_triton"] = point["bf16_triton_ms"] / point[f"{precision}_ms"]
        point[f"{precision}_speedup_vs_best_bf16"] = best_bf16 / point[f"{precision}_ms"]
        point[f"{precision}_tflops_blocks"] = block_tflops(blocks, point[f"{precision}_ms"])
        point[f"{precision}_attention_tflops_blocks"] = block_tflops(blocks, point[f"{precision}_attention_ms"])
    point["bf16_triton_tflops_blocks"] = block_tflops(blocks, point["bf16_triton_ms"])
    print(f"  d={plan.density:.3f}: bf16 triton {point['bf16_triton_ms']:.3f} ms"
          + (f", hopper {point['bf16_hopper_ms']:.3f}" if "bf16_hopper_ms" in point else "")
          + "".join(f" | {p} {point[p + '_ms']:.3f} ms ({point[p + '_speedup_vs_bf16_triton']:.2f}x triton, "
                    f"{point[p + '_speedup_vs_best_bf16']:.2f}x best bf16; attention {point[p + '_attention_ms']:.3f}, "
                    f"{point[p + '_attention_tflops_blocks']:.0f} TF/s; quantize {point[p + '_quantize_ms']:.3f}, "
                    f"device {point[p + '_quantize_device_ms']:.3f})"
                    for p in PRECISIONS), flush=True)
    return point


def _time_hopper(point: dict, precision: str, q, kp, vp, plan, kpos, blocks: int, best_bf16: float) -> None:
    """The Gluon kernel's times in ``precision`` (quantization included, and attention alone)."""
    from pbs.kernels.hopper_attn import (
        QUANTIZED_PRECISIONS, hopper_block_sparse_attention, launch_hopper, quantize_for_hopper,
    )

    if precision not in QUANTIZED_PRECISIONS:
        return
    key = f"{precision}_hopper"
    point[f"{key}_ms"] = time_ms(
        lambda: hopper_block_sparse_attention(q, kp, vp, plan.mask, None, kpos, precision=precision))
    call = prepare_call(q, kp, vp, plan.mask, None, kpos, None, True, None)
    quantize_for_hopper(call, precision)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    point[f"{key}_attention_ms"] = time_ms(lambda: launch_hopper(call, sms))
    point[f"{key}_speedup_vs_best_bf16"] = best_bf16 / point[f"{key}_ms"]
    point[f"{key}_tflops_blocks"] = block_tflops(blocks, point[f"{key}_ms"])
    point[f"{key}_attention_tflops_blocks"] = block_tflops(blocks, point[f"{key}_attention_ms"])
    print(f"    {precision} hopper {point[key + '_ms']:.3f} ms ({point[key + '_speedup_vs_best_bf16']:.2f}x best bf16, "
          f"{point[key + '_tflops_blocks']:.0f} TF/s; attention {point[key + '_attention_ms']:.3f} ms, "
          f"{point[key + '_attention_tflops_blocks']:.0f} TF/s)", flush=True)


def error_points(n: int) -> list[dict]:
    """Relative (Frobenius) and max-abs error of each path against fp32 attention over one mask."""
    from pbs.reference import block_sparse_attention_reference
    from pbs.testing import make_qkv

    points = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    inputs = {
        "gaussian": tuple(torch.randn(BATCH, h, n, HEAD_DIM, device="cuda", generator=gen)
                          for h in (HEADS_Q, HEADS_KV, HEADS_KV)),
        "structured": make_qkv(BATCH, HEADS_Q, HEADS_KV, n, HEAD_DIM, seed=1, device="cuda"),
    }
    for name, (q32, k32, v32) in inputs.items():
        q, k, v = (x.bfloat16() for x in (q32, k32, v32))
        for density in (0.3, 1.0):
            plan = make_plan(q, k, density)
            kp, vp = plan.key_permutation.apply(k), plan.key_permutation.apply(v)
            kpos, qpos = plan.key_positions(), plan.query_positions()
            truth = block_sparse_attention_reference(q32, plan.key_permutation.apply(k32),
                                                     plan.key_permutation.apply(v32), plan.mask, qpos, kpos)

            def errors(out):
                diff = (out.float() - truth).abs()
                return {"relative": (diff.norm() / truth.norm()).item(), "max_abs": diff.max().item()}

            point = {"inputs": name, "n": n, "density": plan.density,
                     "bf16": errors(block_sparse_attention(q, kp, vp, plan.mask, None, kpos))}
            for precision in PRECISIONS:
                point[precision] = errors(block_sparse_attention(q, kp, vp, plan.mask, None, kpos, precision=precision))
                hopper = _hopper_output(q, kp, vp, plan, kpos, precision)
                if hopper is not None:
                    point[f"{precision}_hopper"] = errors(hopper)
            if density == 1.0:
                dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                point["cudnn_bf16_dense"] = errors(dense)
            points.append(point)
            print(f"  error {name} d={plan.density:.2f}: " + ", ".join(
                f"{key} {value['relative']:.4f} (max {value['max_abs']:.4f})"
                for key, value in point.items() if isinstance(value, dict)), flush=True)
    return points


def _hopper_output(q, kp, vp, plan, kpos, precision: str) -> torch.Tensor | None:
    """The Gluon kernel's output in ``precision``, or None where it does not run (not Hopper, no
    Gluon, a precision it does not compute)."""
    try:
        from pbs.kernels.hopper_attn import QUANTIZED_PRECISIONS, hopper_block_sparse_attention
    except ImportError:
        return None
    if precision not in QUANTIZED_PRECISIONS or torch.cuda.get_device_capability()[0] != 9:
        return None
    return hopper_block_sparse_attention(q, kp, vp, plan.mask, None, kpos, precision=precision)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    parser.add_argument("--densities", type=float, nargs="+", default=[0.1, 0.3, 0.5, 1.0])
    parser.add_argument("--error-n", type=int, default=4096, help="length of the error comparison (0: none)")
    parser.add_argument("--precisions", nargs="+", default=PRECISIONS,
                        help="quantized precisions to time (PBSConfig.precision values other than native)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    PRECISIONS[:] = args.precisions
    result = {
        **environment("cuda"),
        "shape": {"batch": BATCH, "heads_q": HEADS_Q, "heads_kv": HEADS_KV, "head_dim": HEAD_DIM,
                  "dtype": "bfloat16", "block": BLOCK, "causal": True, "permuter": "last_block", "selector": "budget"},
        "timing": "median CUDA-event times after warm-up, L2 flushed before each run (benchmarks.common.time_ms)",
        "points": [],
        "errors": [],
    }
    if args.error_n:
        result["errors"] = error_points(args.error_n)
        if args.json:
            save(result, args.json)
    for n in args.n:
        gen = torch.Generator(device="cuda").manual_seed(n)
        q, k, v = (torch.randn(BATCH, h, n, HEAD_DIM, device="cuda", generator=gen).bfloat16()
                   for h in (HEADS_Q, HEADS_KV, HEADS_KV))
        cudnn_ms, _ = cudnn_dense(q, k, v)
        print(f"N={n}: cuDNN dense {cudnn_ms:.3f} ms", flush=True)
        for density in args.densities:
            result["points"].append(speed_point(q, k, v, n, density, cudnn_ms))
            torch.cuda.empty_cache()
        if args.json:
            save(result, args.json)


if __name__ == "__main__":
    main()
