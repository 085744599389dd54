"""Context-parallel TTFT of a Llama-3.1-8B-shaped model: one prompt split over the GPUs of a host,
every GPU holding the whole model (issue 29, point 5).

`pbs.integrations.context_parallel`: each rank runs the whole model (random bf16 weights, built on
its GPU from ``--seed`` by ``benchmarks.common.build_llama``, then rank 0's tensors broadcast: 16 GB
per GPU) on its zigzag shard of the prompt with the tokens' original ``position_ids``, each attention
layer through `pbs.distributed.context_parallel_attention`; only the last local position's logits
are computed (``logits_to_keep=1``), and rank 0's (the sequence's last position) are broadcast.

Methods (``--methods``), each a config registered with ``register_context_parallel``:
    pbs_budget_0.2  PBS at a forced density of 0.2: ``last_block`` permutation, ``budget`` selector
                    (random block priorities, no density probe), as in bench_tensor_parallel.py
    pbs_default     ``PBSConfig()``: on random weights the density probe sends every layer to the
                    dense path (expected; each row records the reason)
    cp_dense        every layer on the context-parallel dense path (``min_seq_len`` above any
                    length): the same K/V all-gather, the first chunk through SDPA (cuDNN), the
                    later one on pbs's kernel at full density

TTFT per run: from a barrier of all ranks (GPUs idle) to the greedy first token on every rank's
host (the broadcast last-position logits, argmax), wall-clock on rank 0; ``--warmup`` untimed runs
then ``--repeats`` timed ones (``--long-repeats`` above 262144 tokens), median. Peak memory is
``torch.cuda.max_memory_allocated`` per rank (weights included).

Logits check (``--check-len``, 32768 by default): the context-parallel last-position logits
against the same model in one process on each GPU (``attn_implementation="pbs"`` with the same
config, or SDPA for ``cp_dense``), relative difference and top-1; ``pbs_budget_0.2`` is not
compared (its seeded draw depends on the shape of the call, so it selects other blocks). The bound
is the larger of ``LOGITS_RTOL`` (2%) and twice the noise of bf16 on this model: the same difference
between two of PyTorch's dense SDPA kernels in one process (FlashAttention and cuDNN; flash and
math on the CPU), ``noise_reference`` in the JSON.

    # 4 GPUs, 512K tokens (torchrun started by the script; about 5-6 minutes on 4 H100s, estimated)
    python benchmarks/bench_cp_ttft.py --world 4 --json cp_ttft_4gpu.json
    # the check on a CPU: a tiny model, gloo, 2 processes
    python benchmarks/bench_cp_ttft.py --smoke --device cpu --world 2

Rank 0 prints a table and writes ``--json`` through ``benchmarks.common.save`` (nothing without it).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a file: python3 benchmarks/bench_cp_ttft.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pbs  # noqa: E402
import pbs.integrations.context_parallel as pbs_cp  # noqa: E402
import pbs.integrations.transformers as pbs_hf  # noqa: E402
from benchmarks.common import (  # noqa: E402
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

SMOKE_SHAPE = dict(LLAMA_8B_SHAPE, num_hidden_layers=2, hidden_size=256, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, intermediate_size=512, vocab_size=1024)
# method -> (PBSConfig fields, PBSIntegrationConfig fields); --smoke lowers min_seq_len of the pbs_* ones
METHODS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "pbs_budget_0.2": ({"permuter": "last_block", "selector": {"name": "budget", "density": 0.2}}, {}),
    "pbs_default": ({}, {}),
    "cp_dense": ({}, {"min_seq_len": 1 << 40}),
}
LENGTHS = [524288]
SMOKE_LENGTHS = [2048, 3000]
LONG = 262144
CHECK_LEN = 32768
SMOKE_CHECK_LEN = 2048
SMOKE_MIN_SEQ_LEN = 256


def use_method(method: str, smoke: bool) -> None:
    config, fields = METHODS[method]
    fields = dict(fields)
    if smoke and "min_seq_len" not in fields:
        fields["min_seq_len"] = SMOKE_MIN_SEQ_LEN
    pbs_cp.register_context_parallel(pbs.PBSConfig(**config), **fields)


def ttft_run(model, ids: torch.Tensor, ranks: Ranks) -> tuple[float, Any]:
    ranks.barrier()
    start = time.perf_counter()
    out = pbs_cp.context_parallel_prefill(model, ids)
    out.last_logits.argmax(-1).cpu()
    return time.perf_counter() - start, out


def time_method(model, ids: torch.Tensor, warmup: int, repeats: int, ranks: Ranks) -> dict[str, Any]:
    try:
        first = None
        times = []
        for i in range(warmup + repeats):
            seconds, out = ttft_run(model, ids, ranks)
            first = first or out
            if i >= warmup:
                times.append(seconds)
    except torch.OutOfMemoryError:
        return {"error": "did not fit (out of memory)", "peak_gib": ranks.peak_gib()}
    layers = first.layers
    dense = [c for c in layers if c.path == "dense"]
    densities = [c.density for c in layers if c.density is not None]
    return {
        "runs_s": times,
        "median_s": statistics.median(times),
        "pbs_layers": len(layers) - len(dense),
        "dense_layers": len(dense),
        "dense_reasons": dict(collections.Counter(c.reason for c in dense)),
        "density": statistics.fmean(densities) if densities else None,
        "local_tokens": layers[0].local_len if layers else None,
        "peak_gib": ranks.peak_gib(),
    }


def merge_ranks(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    row = dict(per_rank[0])
    row.pop("peak_gib", None)
    row["peak_gib_per_rank"] = [r.get("peak_gib") for r in per_rank]
    errors = [f"rank {i}: {r['error']}" for i, r in enumerate(per_rank) if r.get("error")]
    if errors:
        row["error"] = "; ".join(errors)
        return row
    row["median_s_per_rank"] = [r["median_s"] for r in per_rank]
    row["density_per_rank"] = [r["density"] for r in per_rank]
    row["local_tokens_per_rank"] = [r["local_tokens"] for r in per_rank]
    row["paths_agree_over_ranks"] = len({(r["pbs_layers"], r["dense_layers"]) for r in per_rank}) == 1
    return row


def noise_reference(model, ids: torch.Tensor) -> dict[str, Any]:
    """`benchmarks.common.sdpa_kernel_noise` of the model in one process at ``ids``."""
    pbs_hf.switch_attention(model, "sdpa")
    return sdpa_kernel_noise(
        lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1].float().cpu(), ids.is_cuda)


def logits_check(model, ids: torch.Tensor, methods: list[str], smoke: bool, ranks: Ranks) -> dict[str, Any]:
    """The context-parallel last logits against the same model in one process (on each rank's device),
    judged against the noise between two of PyTorch's own dense kernels (`noise_reference`)."""
    check: dict[str, Any] = {"seq_len": ids.shape[1], "methods": {}}
    check["noise_reference"] = noise_reference(model, ids)
    noise = check["noise_reference"].get("rel_diff")
    ranks.free_memory()
    for method in methods:
        if method == "pbs_budget_0.2":
            check["methods"][method] = {"skipped": "budget's seeded draw depends on the call's shape: other blocks"}
            continue
        config, fields = METHODS[method]
        if method == "cp_dense":
            pbs_hf.switch_attention(model, "sdpa")
        else:
            pbs_hf.register(pbs.PBSConfig(**config), **({"min_seq_len": SMOKE_MIN_SEQ_LEN} if smoke else fields))
            pbs_hf.switch_attention(model, "pbs")
        with torch.inference_mode():
            single = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1].float().cpu()
        pbs_hf.switch_attention(model, "sdpa")
        ranks.free_memory()
        use_method(method, smoke)
        out = pbs_cp.context_parallel_prefill(model, ids)
        entry = compare_logits(single, out.last_logits[0].float().cpu(), noise)
        entry["cp_paths"] = dict(collections.Counter(c.path for c in out.layers))
        check["methods"][method] = entry
        ranks.free_memory()
    return check


def path_text(row: dict[str, Any]) -> str:
    if row.get("error"):
        return row["error"]
    layers = row["pbs_layers"] + row["dense_layers"]
    if not row["dense_layers"]:
        return f"pbs on {layers}/{layers}, density {row['density']:.3f}"
    return f"dense on {row['dense_layers']}/{layers} ({', '.join(map(str, row['dense_reasons']))})"


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'world':>5} {'N':>7}  {'method':<15} {'TTFT s':>8}  {'peak GiB/rank':<24} path"]
    for r in rows:
        t = r.get("median_s")
        peaks = "/".join(f"{p:.1f}" for p in r.get("peak_gib_per_rank") or [] if p is not None) or "-"
        lines.append(f"{r['world']:>5} {r['seq_len']:>7}  {r['method']:<15} {f'{t:.3f}' if t else '-':>8}  "
                     f"{peaks:<24} {path_text(r) if 'pbs_layers' in r or r.get('error') else ''}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, help="ranks (default: torchrun's WORLD_SIZE); without torchrun, "
                        "relaunches itself under it")
    parser.add_argument("--device", choices=["cuda", "cpu"], help="default cuda where there is one")
    parser.add_argument("--smoke", action="store_true", help=f"tiny model, lengths {SMOKE_LENGTHS}, check at "
                        f"{SMOKE_CHECK_LEN}, pbs min_seq_len {SMOKE_MIN_SEQ_LEN}: to check the script")
    parser.add_argument("--lengths", type=int, nargs="+", help=f"prompt tokens (default {LENGTHS})")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2, help=f"timed runs up to {LONG} tokens")
    parser.add_argument("--long-repeats", type=int, default=1, help=f"timed runs above {LONG} tokens")
    parser.add_argument("--check-len", type=int, help=f"length of the logits check (default {CHECK_LEN}; 0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=450, help="skip the rows left after this many seconds")
    parser.add_argument("--json", type=Path, help="result file (rank 0 writes it; none without)")
    args = parser.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.lengths is None:
        args.lengths = SMOKE_LENGTHS if args.smoke else LENGTHS
    if args.check_len is None:
        args.check_len = SMOKE_CHECK_LEN if args.smoke else CHECK_LEN
    return args


def main(argv: list[str] | None = None) -> int:
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    began = time.perf_counter()
    if "WORLD_SIZE" not in os.environ:
        if not args.world or args.world < 2:
            raise SystemExit("context parallelism needs --world 2 or more (or torchrun)")
        return relaunch_under_torchrun(__file__, args.world, raw_argv)
    import transformers

    transformers.logging.set_verbosity_error()
    ranks = Ranks(args.device)
    device, world, lead = ranks.device, ranks.world, ranks.rank == 0
    say = (lambda *a: print(*a, flush=True)) if lead else (lambda *a: None)
    shape = dict(SMOKE_SHAPE if args.smoke else LLAMA_8B_SHAPE)
    shape["max_position_embeddings"] = max(shape["max_position_embeddings"], *args.lengths)
    ok = False
    try:
        model = build_llama(llama_config(shape), device, args.seed)
        with torch.no_grad():
            for p in model.parameters():
                ranks.broadcast_(p.data)
        pbs_hf.register()
        pbs_hf.switch_attention(model, "sdpa")
        ranks.barrier()
        model_gib = ranks.gather(torch.cuda.memory_allocated(device) / GIB if ranks.cuda else None)
        say(f"world {world}: model built on {device} in {time.perf_counter() - began:.0f} s ({model_gib} GiB per rank)")

        check = None
        if args.check_len:
            ids = ranks.prompt(args.check_len, shape["vocab_size"], args.seed)
            check = logits_check(model, ids, args.methods, args.smoke, ranks)
            say(f"check N={args.check_len} noise between two dense SDPA kernels: {check['noise_reference']}")
            for method, entry in check["methods"].items():
                say(f"check N={args.check_len} {method}: {entry}")
            del ids

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
                    use_method(method, args.smoke)
                    ranks.free_memory()
                    if ranks.cuda:
                        torch.cuda.reset_peak_memory_stats(device)
                    mine = time_method(model, ids, args.warmup, repeats, ranks)
                    ranks.free_memory()
                    row.update(merge_ranks(ranks.gather(mine)))
                rows.append(row)
                say(format_rows([row]).splitlines()[1])
            del ids
            ranks.free_memory()

        if lead:
            payload = {
                "benchmark": "bench_cp_ttft",
                "note": "random weights: measures speed, not accuracy (pbs's defaults run dense by the density probe)",
                **environment(device),
                "transformers": transformers.__version__,
                "world": world,
                "backend": "nccl" if ranks.cuda else "gloo",
                "context_parallel": "pbs.integrations.context_parallel: the whole model on every rank, the prompt's "
                                    "zigzag shard per rank, every attention layer through context_parallel_attention",
                "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
                "smoke": args.smoke,
                "model": {**shape, "dtype": "bfloat16", "weights": "random"},
                "model_gib_per_rank": model_gib,
                "methods": {m: {"pbs": pbs.PBSConfig(**METHODS[m][0]).model_dump(mode="json"),
                                "integration": METHODS[m][1]} for m in args.methods},
                "timing": "TTFT: barrier, then context_parallel_prefill (logits_to_keep=1) and the greedy token on "
                          "the host; wall-clock on rank 0, median of the timed runs",
                "logits_check": check,
                "check_rtol": LOGITS_RTOL,
                "total_seconds": time.perf_counter() - began,
                "rows": rows,
            }
            say(f"\nTTFT with context parallelism, Llama-3.1-8B shapes{' (smoke: tiny model)' if args.smoke else ''}, "
                f"random bf16 weights, world {world}, {payload['device']}\n{format_rows(rows)}")
            if args.json:
                save(payload, args.json)
                say(f"wrote {args.json}")
        ok = True
    finally:
        ranks.close(ok)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
