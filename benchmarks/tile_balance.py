"""How evenly the Hopper kernel's persistent grid spreads a plan's blocks over the SMs.

Each CTA of `pbs.kernels.hopper_attn` takes tiles ``p, p + P, p + 2P, ...`` (P = SMs) of the rank
order; the slowest CTA sets the time. This prints, for the default plan of ``make_qkv`` inputs,
the busiest CTA's block count over the mean, with the query-head rotation of ``_tile_coords`` and
without it (every CTA always on the same query head of its GQA group).

    python benchmarks/tile_balance.py --n 131072 --sms 132
"""

from __future__ import annotations

import argparse

import torch

import pbs
from pbs.testing import make_qkv


def cta_loads(counts: torch.Tensor, group: int, sms: int, rotate: bool) -> torch.Tensor:
    """Blocks per CTA for ``counts (B, Hq, Tq)`` under the kernel's static schedule."""
    b, hq, tiles = counts.shape
    heads_k = hq // group
    rank = torch.arange(b * hq * tiles)
    rest = rank // group
    i_g = (rank + rest) % group if rotate else rank % group
    i_t = tiles - 1 - rest % tiles
    rest = rest // tiles
    i_hk, i_b = rest % heads_k, rest // heads_k
    per_rank = counts[i_b, i_hk * group + i_g, i_t].double()
    return torch.zeros(sms, dtype=torch.float64).index_add_(0, rank % sms, per_rank)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    for n in args.n:
        q, k, _ = make_qkv(heads_q=32, heads_kv=8, seq_len=n, head_dim=128, dtype=torch.bfloat16, device=args.device)
        plan = pbs.plan(q, k, {"block_size": 128, "segment_size": 256, "check_finite": False})
        counts = plan.mask.counts.cpu()
        per_head = counts.sum(dim=(0, 2)).double()
        print(f"N={n}: density {plan.density:.3f}; blocks per query head max/mean {per_head.max() / per_head.mean():.2f}")
        for rotate in (False, True):
            loads = cta_loads(counts, group=4, sms=args.sms, rotate=rotate)
            print(f"  {'rotated' if rotate else 'fixed  '} query head: busiest CTA / mean = {loads.max() / loads.mean():.3f}")


if __name__ == "__main__":
    main()
