"""Tensor-parallel prefill of a Llama-3.1-8B-shaped model: TTFT, scaling and peak memory per GPU,
and the logits against one GPU (issue 29, point 1).

The model has Llama-3.1-8B's shapes (32 layers, hidden 4096, 32 query heads, 8 KV heads, head dim
128, MLP 14336, vocab 128256, llama3 RoPE with theta 500000, 262144 positions) with **random bf16
weights** (no download). Random weights measure speed, not accuracy: a random model's attention is
nearly flat, so the default config's density probe sends every layer to dense attention (expected:
each row records the path and the reason pbs gave), and the forced-density row is the speed of a
sparse prefill.

Methods (``--methods``):
    sdpa            transformers' ``attn_implementation="sdpa"`` (torch picks cuDNN or flash)
    pbs_default     ``attn_implementation="pbs"`` with ``PBSConfig()``
    pbs_budget_0.2  PBS at a forced density of 0.2: ``last_block`` permutation, ``budget``
                    selector (random block priorities, no density probe), as in bench_ttft.py

World sizes. ``--world 1`` (the default under plain ``python``) times the unsharded model on one
GPU. ``--world N`` (N > 1) runs under torchrun, relaunching itself with
``python -m torch.distributed.run --standalone --nproc-per-node N`` unless torchrun started it; the
model is split by transformers' tensor parallelism (``DistributedConfig(tp_plan="auto")``), one GPU
per rank (NCCL), or gloo on the CPU (``--device cpu``).

Weights. Every rank builds the whole model from ``--seed`` directly on its device (bf16 as the
default dtype under a ``torch.device`` context: no CPU copy), and under tensor parallelism rank 0's
tensors are then broadcast to the others, so every rank holds exactly rank 0's weights whatever
the RNG does on each device. The tensor-parallel model is loaded from that model's state dict with
``from_pretrained(None, config=..., state_dict=..., distributed_config=DistributedConfig(tp_plan=
"auto"))``: transformers' own loading path, slicing each rank's shard out of the same tensors. Its
column-sharded weights would be views of the whole tensors (keeping all of them alive): they are
copied out, and the whole model is freed, before anything is timed. ``weights.fingerprint`` (the
float64 sum and norm over every parameter) lets runs in separate jobs (world 1 against world 2)
confirm that they built the same weights.

Logits check (``--check-len``, 32768 by default: the shortest length at which pbs's defaults plan
rather than run dense by length). Under tensor parallelism, before the model is sharded, each rank
runs the whole (unsharded) model on its GPU: that is the single-GPU run, on the very tensors the
shards are cut from. The tensor-parallel model then runs the same prompt, and the last position's
logits are compared, per method: max abs difference, relative to the largest logit, top-1 and
top-5 agreement. ``agree`` (`benchmarks.common.compare_logits`) means a relative difference of at
most the larger of 2% and twice the noise of bf16 on this model, and the same top-1 token unless
the single run's top-1 / top-2 margin is within twice the max difference (a tie bf16 may break
either way). The noise (``noise_reference``) is measured on the unsharded model first: its last
logits under SDPA pinned to FlashAttention against cuDNN (`benchmarks.common.sdpa_kernel_noise`),
where only the kernel's order of summation changes, as TP changes the reductions' order. A world-1 run
records the unsharded model's top-5 at the same length (to set beside a world-2 run's).

TTFT is `pbs.integrations.ttft.measure_ttft` (the measurement of ``pbs generate`` and
bench_ttft.py): one prefill with a KV cache plus the greedy first token from the last position's
logits, ``logits_to_keep=1`` (no ``(N, vocab)`` logits). Per row: ``--warmup`` untimed runs (the
first one traced with ``trace_dispatch`` for the path, the density and the reason) and
``--repeats`` timed runs (``--long-repeats`` above 131072 tokens); the median of rank 0's CUDA-event
times is ``median_s`` (every rank's median is kept too). Peak memory is
``torch.cuda.max_memory_allocated`` on each rank (weights included), gathered to rank 0. A row
that runs out of memory is recorded as "did not fit (out of memory)" (under tensor parallelism the
ranks hold equal shares, so they run out together; a rank that ran out alone would leave the other
waiting in a collective until a timeout ends the run). ``--budget-s`` skips the rows left once the
run has taken that long (rank 0 decides for every rank).

``--baseline`` takes a world-1 result file of this script and adds the speed-up and the scaling
efficiency (speed-up / world) of each row against it; ``--combine W1.json W2.json`` does the same
afterwards without running anything (one table, and with ``--json`` one file).

``--smoke`` shrinks the model (2 layers, hidden 256, 4 query / 2 KV heads, vocab 1024), the lengths
(512, 1024) and the check (512), and lowers pbs's ``min_seq_len`` to 256 so that PBS plans: it
checks the script, on a CPU with gloo or on GPUs.

    # on a machine with 2 GPUs (about 4-5 minutes for world 2 and 6 for world 1 on H100s; scripts/gpu_tp.sh)
    python benchmarks/bench_tensor_parallel.py --world 1 --long-repeats 1 --json tp_world1.json
    python benchmarks/bench_tensor_parallel.py --world 2 --baseline tp_world1.json --json tp_world2.json
    python benchmarks/bench_tensor_parallel.py --combine tp_world1.json tp_world2.json
    # the check on a CPU: the tiny model, gloo
    python benchmarks/bench_tensor_parallel.py --smoke --device cpu --world 2 --json /tmp/tp_smoke.json

Rank 0 prints a table and writes ``--json`` through ``benchmarks.common.save`` (nothing is written
without ``--json``).
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a file: python3 benchmarks/bench_tensor_parallel.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pbs  # noqa: E402
import pbs.integrations.transformers as pbs_hf  # noqa: E402
from benchmarks.common import (  # noqa: E402
    LLAMA3_ROPE,
    GIB,
    LLAMA_8B_SHAPE,
    LOGITS_RTOL,
    Ranks,
    build_llama,
    compare_logits,
    environment,
    llama_config,
    relaunch_under_torchrun,
    save,
    sdpa_kernel_noise,
)
from pbs.integrations.ttft import measure_ttft, prefill_first_token  # noqa: E402

MODEL_SHAPE = LLAMA_8B_SHAPE
SMOKE_SHAPE = dict(LLAMA_8B_SHAPE, num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=64, intermediate_size=512, vocab_size=1024, max_position_embeddings=4096)
ROPE = LLAMA3_ROPE
# attention methods: None is transformers' SDPA, a dict the PBSConfig registered for "pbs"
METHODS: dict[str, dict[str, Any] | None] = {
    "sdpa": None,
    "pbs_default": {},
    "pbs_budget_0.2": {"permuter": "last_block", "selector": {"name": "budget", "density": 0.2}},
}
LENGTHS = [131072, 262144]
SMOKE_LENGTHS = [512, 1024]
LONG = 131072  # lengths above this get --long-repeats
CHECK_LEN = 32768  # pbs's defaults run dense below dense_fallback.min_seq_len = 32768
SMOKE_CHECK_LEN = 512
SMOKE_MIN_SEQ_LEN = 256  # --smoke lowers pbs's min_seq_len (32768) so that its short prompts plan


# --------------------------------------------------------------------------------------------
# Processes


class CollectLogs(logging.Handler):
    """pbs's log lines (its fallback reasons), kept per row."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


# --------------------------------------------------------------------------------------------
# Model


build_model = build_llama


@torch.no_grad()
def broadcast_weights(model: torch.nn.Module, ranks: Ranks) -> None:
    """Rank 0's weights on every rank."""
    for p in model.parameters():
        ranks.broadcast_(p.data)


@torch.no_grad()
def fingerprint(model: torch.nn.Module) -> dict[str, float]:
    """The float64 sum and norm over every parameter: equal weights give equal numbers."""
    total = torch.zeros((), dtype=torch.float64, device=next(model.parameters()).device)
    square = torch.zeros_like(total)
    for p in model.parameters():
        total += p.sum(dtype=torch.float64)
        square += torch.linalg.vector_norm(p, dtype=torch.float64) ** 2
    return {"sum": float(total), "norm": float(square.sqrt())}


def load_tensor_parallel(config, state_dict: dict[str, torch.Tensor], world: int):
    """The model split over ``world`` ranks by ``tp_plan="auto"``, from ``state_dict``'s tensors."""
    import transformers
    from transformers import LlamaForCausalLM

    kwargs: dict[str, Any] = {"config": config, "state_dict": state_dict, "dtype": torch.bfloat16,
                              "attn_implementation": "sdpa"}
    if hasattr(transformers, "DistributedConfig"):
        kwargs["distributed_config"] = transformers.DistributedConfig(tp_plan="auto", tp_size=world)
    else:  # transformers 4.x
        kwargs.update(tp_plan="auto", tp_size=world)
    model = LlamaForCausalLM.from_pretrained(None, **kwargs).eval()
    return model, compact_shards(model)


@torch.no_grad()
def compact_shards(model: torch.nn.Module) -> int:
    """Copies out every parameter that is a view of a larger tensor (a row slice of a whole weight,
    which would keep the whole weight alive); returns how many were copied."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    copied = 0
    for p in model.parameters():
        # a DTensor's to_local() is a new alias: the tensor it holds is swapped through its attribute
        local = p._local_tensor if dtensor is not None and isinstance(p, dtensor) else p
        if local.untyped_storage().nbytes() > local.numel() * local.element_size():
            local.data = local.clone()
            copied += 1
    return copied


def use_method(model, method: str, min_seq_len: int | None = None) -> None:
    """Points the model at ``method``'s attention (``min_seq_len``: the integration's, for --smoke)."""
    config = METHODS[method]
    if config is None:
        pbs_hf.switch_attention(model, "sdpa")
    else:
        fields = {} if min_seq_len is None else {"min_seq_len": min_seq_len}
        pbs_hf.register(pbs.PBSConfig(**config), **fields)
        pbs_hf.switch_attention(model, "pbs")


# --------------------------------------------------------------------------------------------
# Logits check


@torch.inference_mode()
def last_logits(model, ids: torch.Tensor) -> tuple[torch.Tensor, list]:
    with pbs_hf.trace_dispatch() as calls:
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1].float().cpu()
    return logits, calls


def paths_of(calls: list) -> dict[str, int]:
    return dict(collections.Counter(c.path for c in calls))


# --------------------------------------------------------------------------------------------
# Timing


def time_method(model, ids: torch.Tensor, warmup: int, repeats: int, ranks: Ranks) -> dict[str, Any]:
    """One row on this rank: the traced first run, then the timed runs (no exception escapes)."""
    layers = model.config.num_hidden_layers
    try:
        with pbs_hf.trace_dispatch() as calls:
            if warmup:
                prefill_first_token(model, ids).cpu()
            else:  # no warm-up: the first timed run is traced
                first = measure_ttft(model, ids, warmup=0, repeats=1)
        rest = measure_ttft(model, ids, warmup=max(warmup - 1, 0), repeats=repeats if warmup else repeats - 1)
    except torch.OutOfMemoryError:
        return {"error": "did not fit (out of memory)", "peak_gib": ranks.peak_gib()}
    runs = [rest] if warmup else [first, rest]
    wall = [t for r in runs for t in r.times]
    times = wall if rest.device_times is None else [t for r in runs for t in r.device_times]
    calls = calls[:layers]
    densities = [c.density for c in calls if c.density is not None]
    dense = [c for c in calls if c.path == "sdpa"]
    return {
        "runs_s": times,
        "wall_runs_s": wall,
        "median_s": statistics.median(times),
        "wall_median_s": statistics.median(wall),
        "pbs_layers": len(calls) - len(dense),
        "dense_layers": len(dense),
        "dense_reasons": dict(collections.Counter(c.reason for c in dense)),
        "dense_detail": dense[0].detail if dense else None,
        "density": statistics.fmean(densities) if densities else None,
        "tp": [calls[0].tp_rank, calls[0].tp_size] if calls else None,
        "peak_gib": ranks.peak_gib(),
    }


def merge_ranks(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's row, with what differs between ranks kept per rank."""
    row = dict(per_rank[0])
    row["peak_gib_per_rank"] = [r.get("peak_gib") for r in per_rank]
    row.pop("peak_gib", None)
    errors = [f"rank {i}: {r['error']}" for i, r in enumerate(per_rank) if r.get("error")]
    if errors:
        row["error"] = errors[0].split(": ", 1)[1] if len(per_rank) == 1 else "; ".join(errors)
        return row
    row["median_s_per_rank"] = [r["median_s"] for r in per_rank]
    densities = [r["density"] for r in per_rank]
    # a layer's density is the mean of its ranks' (each rank holds as many heads)
    row["density"] = statistics.fmean(densities) if all(d is not None for d in densities) else None
    row["density_per_rank"] = densities
    row["paths_agree_over_ranks"] = len({(r["pbs_layers"], r["dense_layers"]) for r in per_rank}) == 1
    return row


# --------------------------------------------------------------------------------------------
# Report


def path_text(row: dict[str, Any]) -> str:
    if row.get("error"):
        return row["error"]
    if row.get("pbs_layers") is None or row["pbs_layers"] + row["dense_layers"] == 0:
        return ""
    layers = row["pbs_layers"] + row["dense_layers"]
    if row["dense_layers"] == 0:
        return f"pbs on {layers}/{layers}, density {row['density']:.3f}"
    detail = f": {row['dense_detail']}" if row.get("dense_detail") else ""
    text = f"dense on {row['dense_layers']}/{layers} ({', '.join(row['dense_reasons'])}{detail})"
    if row["pbs_layers"]:
        text += f", pbs on {row['pbs_layers']} (density {row['density']:.3f})"
    return text


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'world':>5} {'N':>7}  {'method':<15} {'TTFT s':>8} {'speed-up':>8} {'eff.':>5}  "
             f"{'peak GiB/rank':<16} path"]
    for r in rows:
        t = r.get("median_s")
        speedup = r.get("speedup_vs_world1")
        eff = r.get("scaling_efficiency")
        peaks = r.get("peak_gib_per_rank") or []
        peak = "/".join(f"{p:.1f}" for p in peaks if p is not None) or "-"
        lines.append(
            f"{r['world']:>5} {r['seq_len']:>7}  {r['method']:<15} "
            f"{f'{t:.3f}' if t is not None else '-':>8} {f'{speedup:.2f}x' if speedup else '':>8} "
            f"{f'{eff:.0%}' if eff else '':>5}  {peak:<16} {path_text(r)}"
        )
    return "\n".join(lines)


def check_table(check: dict[str, Any]) -> str:
    lines = [f"logits at N={check['seq_len']}, tensor-parallel (world {check['world']}) against the unsharded model "
             "on one device (the same tensors):",
             f"  {'method':<15} {'max |diff|':>10} {'max |logit|':>11} {'rel':>7} {'top1':>5} {'top5':>5}  agree  "
             "pbs paths (unsharded | TP rank 0)"]
    for method, c in check["methods"].items():
        if "error" in c:
            lines.append(f"  {method:<15} {c['error']}")
            continue
        lines.append(f"  {method:<15} {c['max_abs_diff']:>10.4g} {c['max_abs_logit']:>11.4g} {c['rel_diff']:>7.2%} "
                     f"{'same' if c['top1_equal'] else 'diff':>5} {c['top5_overlap']:>3}/5  {str(c['agree']):<5}  "
                     f"{c['single_paths'] or '-'} | {c['tp_paths'] or '-'}")
    noise = check.get("noise_reference") or {}
    if "rel_diff" in noise:
        lines.append(f"  noise: {' against '.join(noise['kernels'])} on the unsharded model differ by {noise['rel_diff']:.2%}")
    return "\n".join(lines)


def read_result(path: Path) -> dict[str, Any]:
    import json

    return json.loads(Path(path).read_text())


def apply_baseline(rows: list[dict[str, Any]], path: Path, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """Adds ``speedup_vs_world1`` and ``scaling_efficiency`` to ``rows`` from the world-1 result at
    ``path`` (``base``: its contents, already read); returns what the result records of it."""
    base = read_result(path) if base is None else base
    if base.get("world") != 1:
        raise SystemExit(f"{path}: the baseline must be a world-1 result, not world {base.get('world')}")
    times = {(r["method"], r["seq_len"]): r.get("median_s") for r in base.get("rows", [])}
    for r in rows:
        t0, t = times.get((r["method"], r["seq_len"])), r.get("median_s")
        if t0 and t:
            r["speedup_vs_world1"] = t0 / t
            r["scaling_efficiency"] = t0 / t / r["world"]
    return {
        "path": str(path),
        "world": base.get("world"),
        "device": base.get("device"),
        "git_revision": base.get("git_revision"),
        "weights_fingerprint": base.get("weights", {}).get("fingerprint"),
        "rows": [{k: r.get(k) for k in ("world", "seq_len", "method", "median_s", "peak_gib_per_rank", "error")}
                 for r in base.get("rows", [])],
    }


def combine(paths: list[Path], out: Path | None) -> int:
    """One table (and with ``out`` one file) from result files of several world sizes, the
    world-size-1 one as the baseline of the others."""
    runs = [(read_result(p), p) for p in paths]
    runs.sort(key=lambda run: run[0].get("world") or 0)
    # every world-1 file's rows are the baseline (a later file's row of the same method and length wins)
    bases = [p for run, p in runs if run.get("world") == 1]
    base = {"world": 1, "rows": [r for run, _ in runs if run.get("world") == 1 for r in run.get("rows", [])
                                 if r.get("median_s") is not None]}
    rows: list[dict[str, Any]] = []
    for run, _ in runs:
        run_rows = [dict(r) for r in run.get("rows", [])]
        if bases and run.get("world") != 1:
            apply_baseline(run_rows, bases[0], base)
        rows += run_rows
    fingerprints = {json_key(run.get("weights", {}).get("fingerprint")) for run, _ in runs}
    same_weights = len(fingerprints) == 1
    devices = sorted({str(run.get("device")) for run, _ in runs})
    print(f"TTFT, Llama-3.1-8B shapes, random bf16 weights, {', '.join(devices)}; "
          f"{'the same' if same_weights else 'DIFFERENT'} weights (fingerprints) in every run\n{format_table(rows)}")
    for run, _ in runs:
        if run.get("logits_check") and run.get("world", 1) > 1 and any(
                "max_abs_diff" in c for c in run["logits_check"]["methods"].values()):
            print(check_table(run["logits_check"]))
    if out:
        save({
            "benchmark": "bench_tensor_parallel",
            "combined_from": [str(p) for p in paths],
            "same_weights": same_weights,
            "runs": [{k: v for k, v in run.items() if k != "rows"} for run, _ in runs],
            "rows": rows,
        }, out)
        print(f"wrote {out}")
    return 0


def json_key(value: Any) -> str:
    return repr(sorted(value.items())) if isinstance(value, dict) else repr(value)


# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, help="ranks (default: torchrun's WORLD_SIZE, else 1); above 1 "
                        "without torchrun, relaunches itself under torchrun")
    parser.add_argument("--device", choices=["cuda", "cpu"], help="default cuda where there is one")
    parser.add_argument("--smoke", action="store_true", help="tiny model (2 layers, hidden 256, 4/2 heads), lengths "
                        f"{SMOKE_LENGTHS}, check at {SMOKE_CHECK_LEN}, pbs min_seq_len {SMOKE_MIN_SEQ_LEN}: "
                        "to check the script")
    parser.add_argument("--lengths", type=int, nargs="+", help=f"prompt tokens (default {LENGTHS})")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs per row (the first is traced)")
    parser.add_argument("--repeats", type=int, default=3, help=f"timed runs per row up to {LONG} tokens")
    parser.add_argument("--long-repeats", type=int, default=2, help=f"timed runs per row above {LONG} tokens")
    parser.add_argument("--check-len", type=int, help=f"length of the logits check (default {CHECK_LEN}; 0: none)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the prompts")
    parser.add_argument("--budget-s", type=float, default=540, help="skip the rows left after this many seconds")
    parser.add_argument("--baseline", type=Path, help="a world-1 result of this script: speed-up and efficiency")
    parser.add_argument("--json", type=Path, help="result file (rank 0 writes it; none without)")
    parser.add_argument("--combine", type=Path, nargs="+", metavar="RESULT",
                        help="runs nothing: one table (and with --json one file) from result files of this script, "
                             "the world-1 one as the others' baseline")
    args = parser.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    if args.lengths is None:
        args.lengths = SMOKE_LENGTHS if args.smoke else LENGTHS
    if args.check_len is None:
        args.check_len = SMOKE_CHECK_LEN if args.smoke else CHECK_LEN
    if min(args.repeats, args.long_repeats) < 1 or args.warmup < 0:
        parser.error("--repeats and --long-repeats must be at least 1, --warmup at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.combine:
        return combine(args.combine, args.json)
    began = time.perf_counter()
    if "WORLD_SIZE" not in os.environ and args.world and args.world > 1:
        return relaunch_under_torchrun(__file__, args.world, raw_argv)
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.world is not None and args.world != env_world:
        raise SystemExit(f"--world {args.world} but torchrun started {env_world} processes")

    import transformers

    transformers.logging.set_verbosity_error()  # no weight-loading bars or notices on every rank
    if hasattr(transformers.utils.logging, "disable_progress_bar"):
        transformers.utils.logging.disable_progress_bar()
    if args.device == "cpu" and env_world > 1 and torch.cuda.is_available():
        raise SystemExit("--device cpu with several ranks needs a machine without CUDA: transformers' tensor "
                         "parallelism binds each rank to its accelerator")
    ranks = Ranks(args.device)
    world, lead = ranks.world, ranks.rank == 0
    logs = CollectLogs()
    logging.getLogger("pbs").addHandler(logs)
    logging.getLogger("pbs").setLevel(logging.INFO)
    say = (lambda *a: print(*a, flush=True)) if lead else (lambda *a: None)

    shape = SMOKE_SHAPE if args.smoke else MODEL_SHAPE
    min_seq_len = SMOKE_MIN_SEQ_LEN if args.smoke else None
    config = llama_config(shape)
    pbs_hf.register()
    ok = False
    try:
        model = build_model(config, ranks.device, args.seed)
        broadcast_weights(model, ranks)
        weights = {"seed": args.seed, "fingerprint": fingerprint(model),
                   "how": "built from the seed on each rank's device, then rank 0's tensors broadcast to the others"}
        if ranks.cuda:
            torch.cuda.synchronize()
        say(f"world {world}: model built on {ranks.device} in {time.perf_counter() - began:.0f} s, "
            f"weights fingerprint {weights['fingerprint']}")

        check: dict[str, Any] | None = None
        single: dict[str, Any] = {}
        if args.check_len:
            ids = ranks.prompt(args.check_len, shape["vocab_size"], args.seed)
            for method in args.methods:
                use_method(model, method, min_seq_len)
                try:
                    logits, calls = last_logits(model, ids)
                    single[method] = {"logits": logits, "paths": paths_of(calls)}
                except torch.OutOfMemoryError:
                    single[method] = {"error": "did not fit (out of memory)"}
                ranks.free_memory()
            check = {"seq_len": args.check_len, "world": world, "methods": {}}
            use_method(model, "sdpa")
            check["noise_reference"] = sdpa_kernel_noise(lambda: last_logits(model, ids)[0], ranks.cuda)
            ranks.free_memory()
            for method, s in single.items():
                if "error" in s:
                    check["methods"][method] = {"error": s["error"]}
                else:
                    top = s["logits"].topk(5)
                    check["methods"][method] = {"single_paths": s["paths"], "single_top5": top.indices.tolist(),
                                                "single_top5_logits": top.values.tolist()}

        loaded_s = None
        if world > 1:
            start = time.perf_counter()
            state_dict = model.state_dict()
            model, compacted = load_tensor_parallel(config, state_dict, world)
            del state_dict
            ranks.free_memory()
            if ranks.cuda:
                torch.cuda.synchronize()
            loaded_s = time.perf_counter() - start
            q_proj = model.model.layers[0].self_attn.q_proj.weight
            heads_local = (q_proj.to_local() if hasattr(q_proj, "to_local") else q_proj).shape[0] // shape["head_dim"]
            say(f"tensor-parallel model loaded in {loaded_s:.0f} s: {heads_local} of {shape['num_attention_heads']} "
                f"query heads per rank, {compacted} sliced parameters copied out of the whole tensors")
            if check is not None:
                # a method that did not fit unsharded on some rank is skipped on every rank (they meet in its forward)
                failed = set().union(*ranks.gather({m for m, c in check["methods"].items() if "error" in c}))
                noise = check["noise_reference"].get("rel_diff")
                for method in args.methods:
                    entry = check["methods"][method]
                    if method in failed:
                        entry.setdefault("error", "did not fit (out of memory) on another rank")
                        continue
                    use_method(model, method, min_seq_len)
                    try:
                        logits, calls = last_logits(model, ids)
                        entry.update(compare_logits(single[method]["logits"], logits, noise), tp_paths=paths_of(calls))
                    except torch.OutOfMemoryError:
                        entry["error"] = "tensor-parallel run did not fit (out of memory)"
                    ranks.free_memory()
                say(check_table(check))
        if check is not None:
            del ids
        single.clear()

        model_gib = [m / GIB for m in ranks.gather(torch.cuda.memory_allocated(ranks.device))] if ranks.cuda else None
        say(f"model memory per rank: {model_gib} GiB" if model_gib else "model on the CPU")

        rows: list[dict[str, Any]] = []
        for seq_len in args.lengths:
            ids = ranks.prompt(seq_len, shape["vocab_size"], args.seed)
            repeats = args.long_repeats if seq_len > LONG else args.repeats
            for method in args.methods:
                row: dict[str, Any] = {"world": world, "seq_len": seq_len, "method": method,
                                       "warmup": args.warmup, "repeats": repeats}
                if ranks.from_rank0(time.perf_counter() - began > args.budget_s):
                    row["error"] = "skipped: time budget spent"
                else:
                    use_method(model, method, min_seq_len)
                    ranks.free_memory()
                    if ranks.cuda:
                        torch.cuda.reset_peak_memory_stats(ranks.device)
                    logs.lines.clear()
                    mine = time_method(model, ids, args.warmup, repeats, ranks)
                    ranks.free_memory()
                    row.update(merge_ranks(ranks.gather(mine)))
                    row["log"] = list(dict.fromkeys(logs.lines))  # rank 0's pbs log lines, once each
                rows.append(row)
                say(format_table([row]).splitlines()[1])
            del ids
            ranks.free_memory()

        if lead:
            baseline = apply_baseline(rows, args.baseline) if args.baseline else None
            payload = {
                "benchmark": "bench_tensor_parallel",
                "note": "random weights: measures speed, not accuracy (pbs's defaults run dense by the density probe)",
                **environment(ranks.device),
                "transformers": transformers.__version__,
                "world": world,
                "tensor_parallel": "transformers DistributedConfig(tp_plan='auto'), model loaded from the whole "
                                   "model's state dict" if world > 1 else None,
                "backend": ("nccl" if ranks.cuda else "gloo") if world > 1 else None,
                "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
                "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                "smoke": args.smoke,
                "pbs_min_seq_len_override": min_seq_len,
                "model": {**shape, "rope": ROPE, "dtype": "bfloat16", "weights": "random"},
                "weights": weights,
                "methods": {m: ("transformers attn_implementation='sdpa'" if c is None
                                else pbs.PBSConfig(**c).model_dump(mode="json")) for m, c in METHODS.items()
                            if m in args.methods},
                "sdpa_backends_enabled": {
                    "cudnn": torch.backends.cuda.cudnn_sdp_enabled(), "flash": torch.backends.cuda.flash_sdp_enabled(),
                    "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                } if ranks.cuda else None,
                "timing": "median of rank 0's CUDA-event times of pbs.integrations.ttft.measure_ttft (wall-clock on "
                          "the CPU); peak memory: torch.cuda.max_memory_allocated per rank, weights included",
                "model_load_s": loaded_s,
                "model_gib_per_rank": model_gib,
                "logits_check": check,
                "check_rtol": LOGITS_RTOL,
                "baseline": baseline,
                "total_seconds": time.perf_counter() - began,
                "rows": rows,
            }
            say(f"\nTTFT, Llama-3.1-8B shapes{' (smoke: tiny model)' if args.smoke else ''}, random bf16 weights, "
                f"world {world}, {payload['device']}, transformers {transformers.__version__}\n{format_table(rows)}")
            if args.json:
                save(payload, args.json)
                say(f"wrote {args.json}")
        ok = True
    finally:
        ranks.close(ok)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
