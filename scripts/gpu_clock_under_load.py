"""The SM clock and the power the GPU holds while the Gluon kernel runs back to back, in bf16 and e4m3,
beside cuDNN's dense attention: what turns a kernel's TF/s into cycles per block.

On the kernel benchmark's 128K input at density 1.0 (`benchmarks/bench_kernel.py`'s plan), each
phase launches one kernel for ``--seconds`` while ``nvidia-smi`` samples every 100 ms; the first
second of each phase is left out (the clock settling). Prints and writes (``--json``) each phase's
median SM clock, power, the throttle reasons seen, and the kernel's median time over the phase.

    python3 scripts/gpu_clock_under_load.py --json $OUT/clock_under_load.json
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import KERNEL_SHAPE, GpuSampler, environment, kernel_plan, save  # noqa: E402
from pbs.kernels import hopper_attn  # noqa: E402
from pbs.kernels.block_sparse_attn import prepare_call  # noqa: E402

BATCH, HEADS_Q, HEADS_KV, HEAD_DIM = KERNEL_SHAPE
FIELDS = "timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active,temperature.gpu"


def _phase(fn, seconds: float) -> dict:
    """Runs ``fn`` back to back for ``seconds`` under nvidia-smi sampling (after one call that compiles)."""
    fn()
    torch.cuda.synchronize()
    with GpuSampler(FIELDS) as sampler:
        start, times = time.perf_counter(), []
        while time.perf_counter() - start < seconds:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append((time.perf_counter() - start, begin.elapsed_time(end)))
    rows = sampler.rows
    settled = rows[10:]  # the first second of samples
    if not settled:
        raise SystemExit(f"nvidia-smi gave {len(rows)} samples in {seconds} s: run longer (--seconds)")
    clocks = [float(r[1]) for r in settled]
    power = [float(r[2]) for r in settled]
    return {"samples": len(settled), "sm_clock_mhz_median": statistics.median(clocks),
            "sm_clock_mhz_min": min(clocks), "power_w_median": statistics.median(power),
            "throttle_reasons": sorted({r[3].strip() for r in settled}),
            "temperature_c_max": max(float(r[4]) for r in settled),
            "kernel_ms_median": statistics.median(ms for t, ms in times if t > 1.0), "calls": len(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=131072)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--json")
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(args.n)
    q, k, v = (torch.randn(BATCH, h, args.n, HEAD_DIM, device="cuda", generator=gen).bfloat16()
               for h in (HEADS_Q, HEADS_KV, HEADS_KV))
    plan = kernel_plan(q, k, 1.0)
    kp, vp = plan.key_permutation.apply(k), plan.key_permutation.apply(v)
    result = {**environment("cuda"), "n": args.n, "density": plan.density, "seconds": args.seconds,
              "shape": {"batch": BATCH, "heads_q": HEADS_Q, "heads_kv": HEADS_KV, "head_dim": HEAD_DIM,
                        "dtype": "bfloat16", "causal": True}, "phases": {}}
    blocks = int(plan.mask.counts.sum())  # (query head, query block, key block) triples computed
    result["computed_blocks"] = blocks
    for precision in ("native", "fp8"):
        call = prepare_call(q, kp, vp, plan.mask, None, plan.key_positions(), None, True, None)
        hopper_attn.quantize_for_hopper(call, precision)
        result["phases"][precision] = _phase(lambda c=call: hopper_attn.launch_hopper(c, sms), args.seconds)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        result["phases"]["cudnn_dense"] = _phase(lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True), args.seconds)
    for name, phase in result["phases"].items():
        # An SM's cycles per 128 x 128 block: the kernel's time at the phase's clock, over the blocks
        # each SM computes (cuDNN's over the same causal blocks).
        phase["sm_cycles_per_block"] = (phase["kernel_ms_median"] * 1e-3 * phase["sm_clock_mhz_median"] * 1e6
                                        * sms / blocks)
        print(f"{name:12s} clock {phase['sm_clock_mhz_median']:.0f} MHz (min {phase['sm_clock_mhz_min']:.0f}), "
              f"power {phase['power_w_median']:.0f} W, {phase['sm_cycles_per_block']:.0f} cycles per block, kernel {phase['kernel_ms_median']:.3f} ms, "
              f"throttle {phase['throttle_reasons']}", flush=True)
    if args.json:
        save(result, args.json)


if __name__ == "__main__":
    main()
