"""End-to-end time to first token (TTFT) of a Llama-3.1-8B-shaped model: dense SDPA against PBS.

The model has Llama-3.1-8B's shapes (32 layers, hidden 4096, 32 query heads, 8 KV heads, head dim
128, MLP 14336, vocab 128256) with **random weights** in bf16, built on the GPU from a
``LlamaConfig`` (no download). Random weights measure speed, not accuracy: a random model's
attention is nearly flat, so the densities the default selector reaches here say nothing about a
trained model's, and the forced-density ``budget`` rows are the speed numbers to read.

TTFT is one prefill of ``N`` random tokens with a KV cache plus the last position's logits and
the greedy first token; the ``(N, vocab)`` logits are never materialised. It is measured by
`pbs.integrations.ttft.measure_ttft`, the function ``pbs generate`` times with. Each row's time is
the median of CUDA-event timings over ``--repeats`` runs after one untimed warm-up (which also
compiles Triton kernels and, for PBS, records the density); the wall-clock median of the same runs
is kept too.

Rows:
    sdpa            transformers' ``attn_implementation="sdpa"``, the kernel torch picks
    sdpa_cudnn      the same dense attention forced onto cuDNN (the strongest dense kernel on
                    Hopper); GQA natively if cuDNN accepts ``enable_gqa``, else on repeated K/V
    pbs_budget_0.2  PBS at a forced density of 0.2 (``last_block`` permutation, ``budget`` selector,
                    whose random priorities are drawn on the GPU)
    pbs_budget_0.4  the same at density 0.4
    pbs_default     PBS defaults, ``PBSConfig()`` (preset ``vertical_slash_pooled``)
    pbs_last_block_mean_pool  ``last_block`` + ``mean_pool`` 0.9, the previous defaults (the rows
                    named ``pbs_default`` in result files written before the switch)
All PBS rows use the default ``check_finite`` (no NaN scan on CUDA) and run every layer.

    python benchmarks/bench_ttft.py                       # 32K and 128K, about 4 minutes on an H200
    python benchmarks/bench_ttft.py --lengths 32768 --rows sdpa_cudnn pbs_budget_0.2

Writes ``benchmarks/results/ttft/ttft_<device>.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

if __package__ in (None, ""):  # run as a file: python3 benchmarks/bench_ttft.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pbs  # noqa: E402
import pbs.integrations.transformers as pbs_hf  # noqa: E402
from benchmarks.common import LLAMA_8B_SIZES, RESULTS, environment, save  # noqa: E402
from pbs.integrations.ttft import measure_ttft, prefill_first_token  # noqa: E402

MODEL_SHAPE = LLAMA_8B_SIZES
# PBS rows: the config each registers for every layer.
PBS_ROWS: dict[str, dict[str, Any]] = {
    "pbs_budget_0.2": {"permuter": "last_block", "selector": {"name": "budget", "density": 0.2}},
    "pbs_budget_0.4": {"permuter": "last_block", "selector": {"name": "budget", "density": 0.4}},
    "pbs_default": {},
    "pbs_last_block_mean_pool": {"permuter": "last_block", "selector": {"name": "mean_pool", "threshold": 0.9}},
}
ROWS = ("sdpa", "sdpa_cudnn", *PBS_ROWS)
LONG = 65536  # lengths above this get --long-repeats, to keep the run within a few minutes


# --------------------------------------------------------------------------------------------
# Dense baseline on cuDNN


def cudnn_takes_gqa() -> bool:
    """Whether cuDNN SDPA runs grouped-query attention natively (``enable_gqa``) on this build."""
    q = torch.randn(1, 4, 256, 128, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, 2, 256, 128, device="cuda", dtype=torch.bfloat16)
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        torch.cuda.synchronize()
        return True
    except RuntimeError:
        return False


def make_cudnn_attention(native_gqa: bool):
    """A transformers attention function: causal prefill on cuDNN, ``(B, N, Hq, D)`` out."""

    def cudnn_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if attention_mask is not None or query.shape[2] != key.shape[2]:
            raise ValueError("sdpa_cudnn serves unpadded prefill only (no mask, q_len == kv_len)")
        group = query.shape[1] // key.shape[1]
        if group > 1 and not native_gqa:
            key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(
                query, key, value, is_causal=True, scale=scaling, enable_gqa=native_gqa and group > 1
            )
        return out.transpose(1, 2).contiguous(), None

    return cudnn_attention


def register_cudnn_baseline(native_gqa: bool) -> None:
    import transformers
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    transformers.AttentionInterface.register("sdpa_cudnn", make_cudnn_attention(native_gqa))
    AttentionMaskInterface.register("sdpa_cudnn", sdpa_mask)


# --------------------------------------------------------------------------------------------
# Model and timing


def build_model():
    """Llama-3.1-8B-shaped, random bf16 weights, created directly on the GPU (no CPU copy)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**MODEL_SHAPE, max_position_embeddings=131072)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()  # no .to(dtype): it would cast the fp32 rotary frequencies too


def use_row(model, row: str) -> None:
    """Points the model at the attention of ``row`` (re-registering PBS with the row's config)."""
    if row in PBS_ROWS:
        pbs_hf.register(pbs.PBSConfig(**PBS_ROWS[row]))
        pbs_hf.switch_attention(model, "pbs")
    else:
        pbs_hf.switch_attention(model, row)


def time_row(model, input_ids: torch.Tensor, repeats: int) -> dict[str, Any]:
    """One traced warm-up, then ``repeats`` timed runs of :func:`pbs.integrations.ttft.measure_ttft`."""
    with pbs_hf.trace_dispatch() as calls:
        prefill_first_token(model, input_ids)
    ttft = measure_ttft(model, input_ids, warmup=0, repeats=repeats)
    times_ms = [t * 1e3 for t in ttft.device_times]
    wall_ms = [t * 1e3 for t in ttft.times]
    densities = [c.density for c in calls if c.density is not None]
    return {
        "median_ms": statistics.median(times_ms),
        "runs_ms": times_ms,
        "wall_median_ms": statistics.median(wall_ms),
        "pbs_layers": len(densities),
        "dense_layers": sum(c.path == "sdpa" for c in calls),
        "mean_density": statistics.fmean(densities) if densities else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def device_slug() -> str:
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'N':>7}  {'attention':<24} {'TTFT ms':>10} {'vs cuDNN':>9} {'density':>8}  note"]
    baseline = {r["seq_len"]: r.get("median_ms") for r in rows if r["attention"] == "sdpa_cudnn"}
    for r in rows:
        ms = r.get("median_ms")
        base = baseline.get(r["seq_len"])
        speedup = f"{base / ms:.2f}x" if ms and base else ""
        density = f"{r['mean_density']:.3f}" if r.get("mean_density") is not None else ""
        time_text = f"{ms:10.1f}" if ms else f"{'-':>10}"
        note = r.get("error", "")
        lines.append(f"{r['seq_len']:>7}  {r['attention']:<24} {time_text} {speedup:>9} {density:>8}  {note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072], help="prompt tokens")
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    parser.add_argument("--repeats", type=int, default=3, help=f"timed runs per row up to {LONG} tokens")
    parser.add_argument("--long-repeats", type=int, default=2, help=f"timed runs per row above {LONG} tokens")
    parser.add_argument("--budget-s", type=float, default=420, help="skip the remaining rows after this many seconds")
    parser.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/ttft/ttft_<device>.json)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")

    import transformers

    began = time.perf_counter()
    native_gqa = cudnn_takes_gqa()
    register_cudnn_baseline(native_gqa)
    pbs_hf.register()
    model = build_model()
    print(f"model built in {time.perf_counter() - began:.0f} s; cuDNN native GQA: {native_gqa}", flush=True)

    rows: list[dict[str, Any]] = []
    for seq_len in args.lengths:
        input_ids = torch.randint(0, MODEL_SHAPE["vocab_size"], (1, seq_len), device="cuda",
                                  generator=torch.Generator("cuda").manual_seed(0))
        repeats = args.long_repeats if seq_len > LONG else args.repeats
        for row in args.rows:
            result: dict[str, Any] = {"seq_len": seq_len, "attention": row, "repeats": repeats}
            if time.perf_counter() - began > args.budget_s:
                result["error"] = "skipped: time budget spent"
            else:
                use_row(model, row)
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                try:
                    result.update(time_row(model, input_ids, repeats))
                except torch.cuda.OutOfMemoryError:
                    result["error"] = "out of memory"
                torch.cuda.empty_cache()
            rows.append(result)
            print(format_table([result]).splitlines()[1], flush=True)

    payload = {
        "benchmark": "bench_ttft",
        "note": "random weights: measures speed, not accuracy",
        **environment("cuda"),
        "transformers": transformers.__version__,
        "model": {**MODEL_SHAPE, "head_dim": 128, "dtype": "bfloat16", "weights": "random"},
        "cudnn_native_gqa": native_gqa,
        "pbs_config": {row: pbs.PBSConfig(**config).model_dump(mode="json") for row, config in PBS_ROWS.items()},
        "total_seconds": time.perf_counter() - began,
        "rows": rows,
    }
    out = args.out or RESULTS / "ttft" / f"ttft_{device_slug()}.json"
    save(payload, out)
    print(f"\nTTFT, Llama-3.1-8B shapes, random bf16 weights, {payload['device']}\n{format_table(rows)}\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
