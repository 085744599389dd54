"""What the quantized precisions' pass over Q, K and V costs before attention, piece by piece.

For each length: K's mean over the tokens (PyTorch), int8's channel balance as the kernel path runs
it (`pbs.kernels.fp8_quant.channel_balance`) and as its twin computes it in PyTorch operations
(`pbs.reference.fp8.channel_balance`), and the whole pass of each precision (`quantize_call`).
Each is timed two ways: ``idle`` (CUDA events on an idle GPU, L2 flushed, `benchmarks.common.time_ms`:
the host's launch time shows where it outlasts the GPU's work) and ``device`` (the GPU kept busy while
the host launches, `benchmarks.common.device_ms`: the GPU's time alone, what a model's layer loop sees).
Shapes: B=1, Hq=32, Hkv=8, D=128, bf16 (`benchmarks.common.kernel_inputs`).

    python benchmarks/bench_quantize_pass.py --json benchmarks/results/kernel/quantize_pass_h200.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: python3 benchmarks/bench_quantize_pass.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import KERNEL_SHAPE, device_ms, environment, kernel_inputs, kernel_plan, save, time_ms  # noqa: E402
from pbs.kernels import fp8_quant  # noqa: E402
from pbs.kernels.block_sparse_attn import prepare_call, quantize_call  # noqa: E402
from pbs.reference import fp8 as twin  # noqa: E402

PRECISIONS = ("fp8", "int8_qk_fp8_pv")


def pieces(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict:
    """The timed functions of one length, by name."""
    plan = kernel_plan(q, k, 1.0)
    mean = twin.key_means(k)
    timed = {
        "key_mean": lambda: twin.key_means(k),
        "balance_kernel": lambda: fp8_quant.channel_balance(q, k, mean),
        "balance_pytorch": lambda: twin.channel_balance(q, k, mean),
    }
    for precision in PRECISIONS:
        def whole_pass(p=precision):
            quantize_call(prepare_call(q, k, v, plan.mask, None, None, None, True, None), p)

        timed[f"{precision}_pass"] = whole_pass
    return timed


def main(argv: list[str] | None = None, timer=time_ms, device_timer=device_ms, device: str = "cuda") -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    batch, heads_q, heads_kv, head_dim = KERNEL_SHAPE
    result = {**environment(device), "shape": {"batch": batch, "heads_q": heads_q, "heads_kv": heads_kv,
                                               "head_dim": head_dim, "dtype": "bfloat16"},
              "timing": "idle: time_ms (host launch time included); device: device_ms (GPU time alone)",
              "points": []}
    for n in args.n:
        q, k, v = kernel_inputs(n, device)
        point = {"n": n}
        for name, fn in pieces(q, k, v).items():
            point[f"{name}_idle_ms"] = timer(fn)
            point[f"{name}_device_ms"] = device_timer(fn)
        result["points"].append(point)
        print(f"N={n}: " + ", ".join(f"{name} {point[name + '_idle_ms']:.3f} / {point[name + '_device_ms']:.3f}"
                                     for name in pieces(q, k, v)) + " ms (idle / device)", flush=True)
    if args.json:
        save(result, args.json)
    return result


if __name__ == "__main__":
    main()
