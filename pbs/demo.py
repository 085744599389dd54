"""``pbs demo``: dense vs block-sparse vs PBS on the built-in synthetic workload."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass

import torch

from pbs.api import attention
from pbs.api import plan as make_plan
from pbs.config import PBSConfig
from pbs.reference import attention_coverage, block_attention_mass, dense_attention
from pbs.testing import make_qkv, relative_error


@dataclass(frozen=True)
class DemoRow:
    """One method's result on the demo workload."""

    method: str
    permuter: str
    selector: str
    density: float
    coverage: float
    rel_error: float
    plan_ms: float
    total_ms: float


DEMO_METHODS: tuple[tuple[str, str | None, str | None], ...] = (
    ("dense", None, None),
    ("MeanPooling (no permutation)", "none", "mean_pool"),
    ("PBS: last_block + mean_pool", "last_block", "mean_pool"),
    ("XAttention (no permutation)", "none", "antidiagonal"),
    ("PBS: last_block + antidiagonal", "last_block", "antidiagonal"),
)


def run_demo(
    seq_len: int = 8192,
    heads_q: int = 8,
    heads_kv: int = 2,
    head_dim: int = 64,
    batch: int = 1,
    threshold: float = 0.9,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    backend: str = "auto",
    seed: int = 0,
    progress: bool = True,
) -> list[DemoRow]:
    """Runs every method of :data:`DEMO_METHODS` and returns one row each.

    Coverage is the share of the exact attention mass inside the selected blocks; the error is
    ``||out - dense|| / ||dense||`` against fp32 dense attention.
    """
    q, k, v = make_qkv(batch, heads_q, heads_kv, seq_len, head_dim, seed=seed, dtype=dtype, device=device)
    rows: list[DemoRow] = []
    truth = None
    mass_by_permuter: dict[str, torch.Tensor] = {}  # the exact block mass depends only on the order
    for i, (method, permuter, selector) in enumerate(DEMO_METHODS, start=1):
        if progress:
            print(f"[{i}/{len(DEMO_METHODS)}] {method} ...", file=sys.stderr, flush=True)
        _sync(device)
        start = time.perf_counter()
        if permuter is None:
            out = dense_attention(q, k, v, causal=True)
            _sync(device)
            total = (time.perf_counter() - start) * 1e3
            truth = out
            rows.append(DemoRow(method, "-", "-", 1.0, 1.0, 0.0, 0.0, total))
            continue
        config = PBSConfig(
            permuter=permuter, selector={"name": selector, "threshold": threshold}, backend=backend
        )
        out, plan = attention(q, k, v, config, return_plan=True)
        _sync(device)
        total = (time.perf_counter() - start) * 1e3
        plan_start = time.perf_counter()
        make_plan(q, k, config)
        _sync(device)
        plan_ms = (time.perf_counter() - plan_start) * 1e3
        mass = mass_by_permuter.get(permuter)
        if mass is None:
            q_perm = plan.query_permutation.apply(q)
            k_perm = plan.key_permutation.apply(k)
            mass = block_attention_mass(q_perm, k_perm, plan.query_positions(), plan.key_positions(), plan.layout)
            mass_by_permuter[permuter] = mass
        coverage = float(attention_coverage(mass, plan.mask.to_dense(), plan.layout).mean())
        assert truth is not None
        rows.append(
            DemoRow(method, permuter, selector, plan.density, coverage, relative_error(out, truth), plan_ms, total)
        )
    return rows


def format_table(rows: list[DemoRow]) -> str:
    """A plain-text table of demo rows."""
    header = f"{'method':34s} {'density':>8s} {'coverage':>9s} {'rel.err':>9s} {'plan ms':>9s} {'total ms':>9s}"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.method:34s} {r.density:8.3f} {r.coverage:9.3f} {r.rel_error:9.2e} {r.plan_ms:9.1f} {r.total_ms:9.1f}"
        )
    return "\n".join(lines)


def rows_to_json(rows: list[DemoRow], **meta: object) -> str:
    """Rows plus run metadata as JSON."""
    return json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2)


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
