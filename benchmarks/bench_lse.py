"""What returning the log-sum-exp costs: `pbs.run` with and without ``return_lse`` on one plan.

Protocol: B=1, Hq=32, Hkv=8, D=128, bf16, causal, block 128; masks from the ``budget`` selector
(no permutation) at densities 0.1 / 0.3 / 1.0, planned once per point, ``dense_fallback`` off
(the plan's backend is the one ``auto`` picks: the Gluon kernel on Hopper). Times are medians of
CUDA-event timings with the L2 cache flushed before each call (`benchmarks.common.time_ms`).

    python benchmarks/bench_lse.py --json benchmarks/results/kernel/lse_h100.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: python3 benchmarks/bench_lse.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pbs  # noqa: E402
from benchmarks.common import environment, save, time_ms  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--densities", type=float, nargs="+", default=[0.1, 0.3, 1.0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    result = {**environment("cuda"), "shape": {"batch": 1, "heads_q": 32, "heads_kv": 8, "head_dim": 128,
                                               "dtype": "bfloat16", "causal": True}, "points": []}
    for n in args.n:
        q, k, v = pbs.testing.make_qkv(batch=1, heads_q=32, heads_kv=8, seq_len=n, head_dim=128,
                                       dtype=torch.bfloat16, device="cuda", seed=0)
        for density in args.densities:
            config = {"selector": {"name": "budget", "density": density}, "check_finite": False,
                      "dense_fallback": {"min_seq_len": 0, "max_density": None}}
            plan = pbs.plan(q, k, config, return_lse=True)
            plain_ms = time_ms(lambda: pbs.run(plan, q, k, v))
            lse_ms = time_ms(lambda: pbs.run(plan, q, k, v, return_lse=True))
            point = {"n": n, "density": plan.density, "backend": plan.backend, "plain_ms": plain_ms,
                     "lse_ms": lse_ms, "lse_over_plain": lse_ms / plain_ms}
            result["points"].append(point)
            print(f"N={n} density {plan.density:.3f} ({plan.backend}): {plain_ms:.3f} ms, with LSE {lse_ms:.3f} ms "
                  f"({lse_ms / plain_ms:.3f}x)", flush=True)
    if args.json:
        save(result, args.json)
    return result


if __name__ == "__main__":
    main()
