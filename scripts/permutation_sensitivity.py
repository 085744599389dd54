"""How far one attention call's output moves when its inputs move by bf16 rounding, per config.

Tensor parallelism on 2 H100s left the last logits of the 8B-shaped model 5.0% apart from one GPU
with dense attention, and 13.2% apart with ``last_block`` + ``budget`` at density 0.2
(`benchmarks/results/distributed/tp_combined_h100.json`). The split changes only the order of the
all-reduce's sums, so each layer's inputs differ by rounding. This script asks what one call does
with such a difference: q, k and v are multiplied by ``1 + e`` with ``e`` uniform in
``[-2**-9, 2**-9]`` (half a bf16 ulp), and the output's largest change, relative to the largest
output, is compared with dense attention's, together with the share of keys whose slot in the
permuted order changed and the share of (query block, key block) pairs whose selection changed.

Runs on the CPU in float32, the reference backend, structured inputs (`pbs.testing.make_qkv`).

    python scripts/permutation_sensitivity.py --json benchmarks/results/distributed/permutation_sensitivity_cpu.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pbs  # noqa: E402
from benchmarks.common import environment, save  # noqa: E402

BASE = {"backend": "reference", "dense_fallback": {"min_seq_len": 0, "max_density": None, "max_planned_density": None}}
CONFIGS = {
    "dense (budget 1.0)": {"selector": {"name": "budget", "density": 1.0}},
    "none + budget 0.2": {"permuter": "none", "selector": {"name": "budget", "density": 0.2}},
    "last_block + budget 0.2 (the TP benchmark's config)": {"permuter": "last_block",
                                                             "selector": {"name": "budget", "density": 0.2}},
    "last_block + mean_pool 0.5": {"permuter": "last_block", "selector": {"name": "mean_pool", "threshold": 0.5}},
    "defaults (planned)": {},
}


def perturbed(x: torch.Tensor, seed: int, size: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return x * (1 + size * (2 * torch.rand(x.shape, generator=gen, dtype=x.dtype) - 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--heads", type=int, nargs=2, default=(8, 2), metavar=("HQ", "HKV"))
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--size", type=float, default=2.0**-9, help="largest relative change of an input")
    parser.add_argument("--seeds", type=int, default=3, help="perturbations per config")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    q, k, v = pbs.testing.make_qkv(heads_q=args.heads[0], heads_kv=args.heads[1], seq_len=args.seq_len,
                                   head_dim=args.head_dim)
    rows = []
    for name, config in CONFIGS.items():
        config = {**BASE, **config}
        out, plan = pbs.attention(q, k, v, config, return_plan=True)
        scale = float(out.abs().max())
        for seed in range(args.seeds):
            q2, k2, v2 = (perturbed(x, 3 * seed + i, args.size) for i, x in enumerate((q, k, v)))
            out2, plan2 = pbs.attention(q2, k2, v2, config, return_plan=True)
            rows.append({
                "config": name, "seed": seed,
                "rel_output_change": float((out2 - out).abs().max()) / scale,
                "keys_moved": float((plan2.key_permutation.indices != plan.key_permutation.indices).double().mean()),
                "blocks_changed": float((plan2.mask.to_dense() != plan.mask.to_dense()).double().mean()),
                "density": plan.density,
            })
            print(rows[-1], flush=True)
    summary = {}
    for name in CONFIGS:
        mine = [r for r in rows if r["config"] == name]
        summary[name] = {key: max(r[key] for r in mine) for key in ("rel_output_change", "keys_moved", "blocks_changed")}
    dense = summary["dense (budget 1.0)"]["rel_output_change"]
    for name, entry in summary.items():
        entry["against_dense"] = entry["rel_output_change"] / dense if dense else None
        print(f"{name:<52} output change {entry['rel_output_change']:.2e} ({entry['against_dense']:.1f}x dense), "
              f"keys moved {entry['keys_moved']:.1%}, blocks changed {entry['blocks_changed']:.2%}")
    if args.json:
        save({"benchmark": "permutation_sensitivity", "environment": environment("cpu"), "seq_len": args.seq_len,
              "heads": list(args.heads), "head_dim": args.head_dim, "dtype": "float32", "perturbation": args.size,
              "seeds": args.seeds, "configs": {n: {**BASE, **c} for n, c in CONFIGS.items()}, "rows": rows,
              "max_over_seeds": summary}, args.json)


if __name__ == "__main__":
    main()
