"""Launches the Gluon kernel on the kernel benchmark's inputs, for Nsight Compute to profile.

One prepared call (`benchmarks.common.kernel_plan`'s mask on ``--n`` keys at ``--density``, in
``--precision``), launched ``--launches`` times; the first compiles. Run it under ``ncu`` with a
kernel filter and ``--launch-skip 1`` (``bash scripts/gpu_check.sh ncu``):

    ncu --clock-control none -k regex:_hopper_block_sparse_attn_fwd --launch-skip 1 --launch-count 1 \\
        --section WarpStateStats --section SourceCounters -o prof python3 scripts/kernel_ncu_target.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import kernel_inputs, kernel_plan  # noqa: E402
from pbs.kernels import hopper_attn  # noqa: E402
from pbs.kernels._common import sm_count  # noqa: E402
from pbs.kernels.block_sparse_attn import prepare_call  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=32768)
    parser.add_argument("--density", type=float, default=1.0)
    parser.add_argument("--precision", default="native", choices=["native", *hopper_attn.QUANTIZED_PRECISIONS])
    parser.add_argument("--launches", type=int, default=2)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kernel_ncu_target.py launches the Gluon kernel: it needs a Hopper GPU")
    q, k, v = kernel_inputs(args.n)
    plan = kernel_plan(q, k, args.density)
    kp, vp = plan.key_permutation.apply(k), plan.key_permutation.apply(v)
    call = prepare_call(q, kp, vp, plan.mask, None, plan.key_positions(), None, True, None)
    hopper_attn.quantize_for_hopper(call, args.precision)
    sms = sm_count(torch.device("cuda"))
    for _ in range(args.launches):
        hopper_attn.launch_hopper(call, sms)
    torch.cuda.synchronize()
    print(f"N={args.n} density {plan.density:.3f} {args.precision}: {args.launches} launches", flush=True)


if __name__ == "__main__":
    main()
