"""``pbs demo``: dense vs block-sparse vs PBS on the built-in synthetic workload.

Two views of the same methods:

* **at equal threshold**: every selector runs at the same threshold with and without permutation
  (what a user configuring PBS sees: permutation changes both the density and the coverage);
* **at equal density**: for each PBS row, the unpermuted selector is run again at the threshold
  that reaches the PBS row's density, so coverage and error compare at the same number of computed
  blocks. This is what permutation is for: more attention mass in the same blocks.

Then one more row, **the library's defaults**: what ``pbs.attention(q, k, v)`` with no config
selects here when it plans (the paper's rows above are not the defaults; the defaults were chosen
for quality on a real model, docs/quality.md).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from pbs.api import plan as make_plan
from pbs.api import run as run_plan
from pbs.components import selector_registry
from pbs.config import PBSConfig
from pbs.reference import attention_coverage, block_attention_mass, dense_attention
from pbs.testing import make_qkv, relative_error
from pbs.types import Plan


@dataclass(frozen=True)
class DemoRow:
    """One method's result on the demo workload.

    Attributes:
        method: the row's label.
        permuter, selector: component names (``"-"`` for dense).
        threshold: the selector's setting (its ``threshold``; ``density`` for ``budget``,
            ``coverage`` for ``oracle``); ``None`` for dense.
        density: selected over causally allowed key blocks.
        coverage: share of the exact attention mass inside the selected blocks.
        rel_error: ``||out - dense|| / ||dense||`` against fp32 dense attention.
        plan_ms, total_ms: planning time and planning plus attention; ``None`` where not timed.
        matches: for an equal-density row, the method whose density it was matched to.
    """

    method: str
    permuter: str
    selector: str
    threshold: float | None
    density: float
    coverage: float
    rel_error: float
    plan_ms: float | None
    total_ms: float | None
    matches: str | None = None


@dataclass(frozen=True)
class DemoResult:
    """What `run_demo` returns.

    Attributes:
        rows: dense, then per selector its unpermuted and its PBS row, all at the given threshold.
        equal_density: per selector, the unpermuted selector at the threshold matching the PBS
            row's density, followed by that PBS row (empty when the view is off).
        settings: the workload and the configs (block size, segment size, permuter, selectors).
        defaults: the library's default `PBSConfig` on the same inputs (the demo's block size,
            segment size and backend; its dense fallback off, so it plans), or None when skipped.
    """

    rows: list[DemoRow]
    equal_density: list[DemoRow] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    defaults: DemoRow | None = None


DEMO_METHODS: tuple[tuple[str, str | None, str | None], ...] = (
    ("dense", None, None),
    ("MeanPooling (no permutation)", "none", "mean_pool"),
    ("PBS: last_block + mean_pool", "last_block", "mean_pool"),
    ("XAttention (no permutation)", "none", "antidiagonal"),
    ("PBS: last_block + antidiagonal", "last_block", "antidiagonal"),
)
"""The default rows: ``(label, permuter, selector)``; ``demo_methods()`` builds them for other choices."""

DEFAULT_SELECTORS: tuple[str, ...] = ("mean_pool", "antidiagonal")
_BASELINE_LABELS = {selector: label for label, permuter, selector in DEMO_METHODS if permuter == "none"}


def demo_methods(
    permuter: str = "last_block", selectors: Sequence[str] = DEFAULT_SELECTORS
) -> tuple[tuple[str, str | None, str | None], ...]:
    """``(label, permuter, selector)`` rows: dense, then each selector without and with ``permuter``."""
    methods: list[tuple[str, str | None, str | None]] = [("dense", None, None)]
    for selector in selectors:
        methods.append((_BASELINE_LABELS.get(selector, f"{selector} (no permutation)"), "none", selector))
        methods.append((f"PBS: {permuter} + {selector}", permuter, selector))
    return tuple(methods)


def setting_field(selector: str) -> str | None:
    """The field of ``selector`` that the demo's threshold sets (its `pbs.SelectorConfig.knob`),
    or ``None`` if it has none."""
    return selector_registry.get(selector).knob


DEFAULTS_LABEL = "pbs defaults: PBSConfig()"


def defaults_label(*, block_size: int = 128, segment_size: int = 256) -> str:
    """The defaults row's label: `DEFAULTS_LABEL`, or the geometry where the demo changed it
    (``PBSConfig()`` would then not be what ran)."""
    default = PBSConfig()
    if (block_size, segment_size) == (default.block_size, default.segment_size):
        return DEFAULTS_LABEL
    return f"pbs defaults, block {block_size} segment {segment_size}"


def defaults_config(*, block_size: int = 128, segment_size: int = 256, backend: str = "auto") -> PBSConfig:
    """The library's default config with the demo's geometry and backend, and the dense fallback
    off (so ``auto`` plans even where it would run dense on a GPU)."""
    return PBSConfig(block_size=block_size, segment_size=segment_size, backend=backend,
                     dense_fallback={"min_seq_len": 0, "max_density": None})


def demo_config(
    permuter: str,
    selector: str,
    threshold: float | None,
    *,
    block_size: int = 128,
    segment_size: int = 256,
    backend: str = "auto",
) -> PBSConfig:
    """The config of one demo row. ``threshold=None`` keeps the selector's default. The dense
    fallback is off, so ``auto`` runs PBS even where it would pick dense SDPA on a GPU."""
    spec: dict[str, Any] = {"name": selector}
    knob = setting_field(selector)
    if threshold is not None and knob is not None:
        spec[knob] = threshold
    return PBSConfig(
        block_size=block_size,
        segment_size=segment_size,
        permuter=permuter,
        selector=spec,
        backend=backend,
        dense_fallback={"min_seq_len": 0, "max_density": None},
    )


def check_backend(config: PBSConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raises ``ValueError`` (with the backend's reasons) if ``config.backend`` cannot run these
    inputs (the rule planning applies), before anything runs."""
    from pbs.backends import CallSpec, resolve_backend

    resolve_backend(config.backend, CallSpec.of(q, v.shape[-1], config.block_size, precision=config.precision))


def run_demo(
    seq_len: int = 8192,
    heads_q: int = 8,
    heads_kv: int = 2,
    head_dim: int = 64,
    batch: int = 1,
    threshold: float | None = 0.9,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    backend: str = "auto",
    seed: int = 0,
    progress: bool = True,
    *,
    block_size: int = 128,
    segment_size: int = 256,
    permuter: str = "last_block",
    selectors: Sequence[str] = DEFAULT_SELECTORS,
    equal_density: bool = True,
    defaults: bool = True,
) -> DemoResult:
    """Runs every method of `demo_methods`, with ``equal_density`` the equal-density view, and with
    ``defaults`` the library's default config (`defaults_config`).

    Coverage is the share of the exact attention mass inside the selected blocks; the error is
    ``||out - dense|| / ||dense||`` against fp32 dense attention. Every config is checked against
    the backend before anything runs (``ValueError`` names why a backend cannot run).
    """
    methods = demo_methods(permuter, selectors)
    geometry = dict(block_size=block_size, segment_size=segment_size, backend=backend)
    configs = {
        (p, s): demo_config(p, s, threshold, **geometry) for _, p, s in methods if p is not None and s is not None
    }
    default_config = defaults_config(**geometry) if defaults else None
    q, k, v = make_qkv(batch, heads_q, heads_kv, seq_len, head_dim, seed=seed, dtype=dtype, device=device)
    for config in [*configs.values(), *([default_config] if default_config else [])]:
        check_backend(config, q, k, v)

    steps = len(methods) + (len(selectors) if equal_density else 0) + (1 if defaults else 0)
    step = 0

    def announce(what: str) -> None:
        nonlocal step
        step += 1
        if progress:
            print(f"[{step}/{steps}] {what} ...", file=sys.stderr, flush=True)

    rows: list[DemoRow] = []
    announce("dense")
    _sync(device)
    start = time.perf_counter()
    truth = dense_attention(q, k, v, causal=True)
    _sync(device)
    rows.append(DemoRow("dense", "-", "-", None, 1.0, 1.0, 0.0, None, (time.perf_counter() - start) * 1e3))

    mass_by_permuter: dict[str, torch.Tensor] = {}  # the exact block mass depends only on the order

    def coverage_of(p: Plan, permuter_name: str) -> float:
        mass = mass_by_permuter.get(permuter_name)
        if mass is None:
            q_perm, k_perm = p.query_permutation.apply(q), p.key_permutation.apply(k)
            mass = block_attention_mass(q_perm, k_perm, p.query_positions(), p.key_positions(), p.layout)
            mass_by_permuter[permuter_name] = mass
        return float(attention_coverage(mass, p.mask.to_dense(), p.layout).mean())

    def timed_row(method: str, config: PBSConfig) -> DemoRow:
        _sync(device)
        start = time.perf_counter()
        p = make_plan(q, k, config)
        _sync(device)
        plan_ms = (time.perf_counter() - start) * 1e3
        out = run_plan(p, q, k, v)
        _sync(device)
        total_ms = (time.perf_counter() - start) * 1e3
        return DemoRow(method, config.permuter.name, config.selector.name, _setting(config), p.density,
                       coverage_of(p, config.permuter.name), relative_error(out, truth), plan_ms, total_ms)

    for method, perm, selector in methods[1:]:
        assert perm is not None and selector is not None
        announce(method)
        rows.append(timed_row(method, configs[(perm, selector)]))

    matched: list[DemoRow] = []
    if equal_density:
        by_method = {r.method: r for r in rows}
        for selector in selectors:
            baseline_label = next(m for m, p, s in methods if p == "none" and s == selector)
            pbs_label = next(m for m, p, s in methods if p == permuter and s == selector)
            baseline, target = by_method[baseline_label], by_method[pbs_label]
            announce(f"{baseline_label} at the density of {pbs_label}")
            value, p = _match_density(q, k, selector, target.density, baseline, geometry)
            out = run_plan(p, q, k, v)
            matched.append(
                DemoRow(baseline_label, "none", selector, value, p.density, coverage_of(p, "none"),
                        relative_error(out, truth), None, None, matches=pbs_label)
            )
            matched.append(target)
    default_row = None
    if default_config is not None:
        label = defaults_label(block_size=block_size, segment_size=segment_size)
        announce(label)
        default_row = timed_row(label, default_config)
    settings = dict(
        batch=batch, heads_q=heads_q, heads_kv=heads_kv, seq_len=seq_len, head_dim=head_dim,
        dtype=str(dtype).removeprefix("torch."), device=str(device), seed=seed, threshold=threshold,
        block_size=block_size, segment_size=segment_size, permuter=permuter, selectors=list(selectors),
        backend=backend,
    )
    return DemoResult(rows=rows, equal_density=matched, settings=settings, defaults=default_row)


def _setting(config: PBSConfig) -> float | None:
    return config.selector.knob_value()


def _match_density(
    q: torch.Tensor, k: torch.Tensor, selector: str, target: float, start: DemoRow, geometry: dict[str, Any],
    *, tolerance: float = 0.002, max_plans: int = 8,
) -> tuple[float | None, Plan]:
    """The unpermuted ``selector``'s setting whose plan's density is nearest ``target``, and that plan.

    Density grows with the threshold, so the search keeps a bracket and steps by linear
    interpolation inside it (regula falsi, Illinois variant), from the row already run at ``start``.
    """
    if setting_field(selector) is None:  # nothing to tune: the selector's own density is all there is
        return None, make_plan(q, k, demo_config("none", selector, None, **geometry))
    plans: dict[float, Plan] = {}

    def density(value: float) -> float:
        plans[value] = make_plan(q, k, demo_config("none", selector, value, **geometry))
        return plans[value].density

    assert start.threshold is not None
    x0, d0 = start.threshold, start.density
    if d0 > target:
        lo, hi, d_hi = 1e-3, x0, d0
        d_lo = density(lo)
    else:
        lo, d_lo, hi = x0, d0, 1.0
        d_hi = density(hi)
    f_lo, f_hi = d_lo - target, d_hi - target
    side = 0
    for _ in range(max_plans):
        if not f_lo < 0 < f_hi or min(abs(d_lo - target), abs(d_hi - target)) <= tolerance:
            break  # matched, or the target lies outside what the selector can reach
        x = min(max((lo * f_hi - hi * f_lo) / (f_hi - f_lo), lo + 1e-4), hi - 1e-4)
        d = density(x)
        if d < target:
            lo, d_lo, f_lo = x, d, d - target
            if side == -1:
                f_hi /= 2
            side = -1
        else:
            hi, d_hi, f_hi = x, d, d - target
            if side == 1:
                f_lo /= 2
            side = 1
    found = {value: plan.density for value, plan in plans.items()}
    best = min({x0: d0, **found}.items(), key=lambda item: abs(item[1] - target))[0]
    if best not in plans:  # the row already run was the nearest: plan it again for its output
        density(best)
    return best, plans[best]


def format_table(rows: list[DemoRow], *, timings: bool = True, label_width: int | None = None) -> str:
    """A plain-text table of demo rows (``timings=False`` leaves out the time columns).

    ``label_width``: the method column's width (default: the longest label here, at least 34), so
    that tables printed one under another can share it."""
    width = label_width or max([METHOD_COLUMN, *(len(r.method) for r in rows)])
    header = f"{'method':{width}s} {'tau':>6s} {'density':>8s} {'coverage':>9s} {'rel.err':>9s}"
    if timings:
        header += f" {'plan ms':>9s} {'total ms':>9s}"
    lines = [header, "-" * len(header)]
    for r in rows:
        tau = "-" if r.threshold is None else f"{r.threshold:.3f}"
        line = f"{r.method:{width}s} {tau:>6s} {r.density:8.3f} {r.coverage:9.3f} {r.rel_error:9.2e}"
        if timings:
            line += f" {_ms(r.plan_ms):>9s} {_ms(r.total_ms):>9s}"
        lines.append(line)
    return "\n".join(lines)


METHOD_COLUMN = 34
"""The narrowest method column: the default rows' labels fit it; a longer label widens it."""


def short_sequence_note(seq_len: int, block_size: int, segment_size: int) -> str | None:
    """Why every row is dense (density 1.000) on a sequence of ``seq_len`` tokens, or ``None`` when
    the methods can differ: the blocks of a query's own segment are always computed, and a
    sequence of at most one segment has no other blocks."""
    if seq_len > segment_size:
        return None
    if seq_len <= block_size:
        why = (f"N={seq_len} fits in one block of {block_size} tokens, so there is one query block and one key "
               "block, which every method computes")
    else:
        why = (f"N={seq_len} fits in one segment of {segment_size} tokens, and every block of a query's own "
               "segment is always computed")
    return (f"note: {why}: every row below has density 1.000. Give --seq-len over {segment_size} (e.g. 4096) to "
            "see the methods differ.")


def format_result(result: DemoResult) -> str:
    """Both views of a `DemoResult` as text, after a note where the sequence is too short for any
    method to skip a block (`short_sequence_note`)."""
    rows = [*result.rows, *result.equal_density, *([result.defaults] if result.defaults is not None else [])]
    width = max([METHOD_COLUMN, *(len(r.method) for r in rows)])
    settings = result.settings
    note = None
    if {"seq_len", "block_size", "segment_size"} <= settings.keys():
        note = short_sequence_note(settings["seq_len"], settings["block_size"], settings["segment_size"])
    text = (f"{note}\n\n" if note else "") + "at equal threshold:\n" + format_table(result.rows, label_width=width)
    if result.equal_density:
        text += (
            "\n\nat equal density (the unpermuted selector's tau searched to match each PBS row's density):\n"
            + format_table(result.equal_density, timings=False, label_width=width)
        )
    if result.defaults is not None:
        text += (
            "\n\nthe library's defaults (what pbs.attention(q, k, v) selects here when it plans; tau: its union has"
            " none):\n" + format_table([result.defaults], label_width=width)
        )
    return text


def rows_to_json(result: DemoResult, **meta: object) -> str:
    """The result plus run metadata as JSON; numbers stay numbers, missing values are null."""
    return json.dumps(
        {
            "meta": {**result.settings, **meta},
            "rows": [asdict(r) for r in result.rows],
            "equal_density": [asdict(r) for r in result.equal_density],
            "defaults": None if result.defaults is None else asdict(result.defaults),
        },
        indent=2,
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
