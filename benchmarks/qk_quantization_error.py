"""How far quantized Q and K move a real model's attention weights, per layer, for each scale scheme.

Runs the model once (dense) on one held-out document, captures every layer's post-RoPE queries and
keys, and compares the causal softmax weights of the exact scores with those of Q and smoothed K
fake-quantized (`pbs.reference.fp8`) under each scheme: int8 and e4m3, with one scale per block of
128 tokens on each side, and int8 with the channels balanced first (`channel_balance`, what
`int8_qk` and `int8_qk_fp8_pv` do) or Q scaled per token. Metric per layer: the mean over heads
and query rows of ``sum_j |p_hat_ij - p_ij|`` (twice the total-variation distance; 0 is exact).
No sparsity and no V: the error of the quantized scores alone.

    python benchmarks/qk_quantization_error.py --model gemma3-270m --length 4096 \
        --out benchmarks/results/quality/qk_quantization_error_gemma3.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: python3 benchmarks/qk_quantization_error.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import environment, save  # noqa: E402
from pbs.reference import fp8  # noqa: E402

BLOCK = 128
SCHEMES = {  # label: (format, channels balanced, query rows per scale)
    "int8, balanced channels (shipped)": ("int8", True, BLOCK),
    "int8, block scales alone (before)": ("int8", False, BLOCK),
    "int8, Q scaled per token": ("int8", False, 1),
    "int8, balanced, Q per token": ("int8", True, 1),
    "e4m3, block scales (shipped)": ("e4m3", False, BLOCK),
    "e4m3, balanced channels": ("e4m3", True, BLOCK),
}


def quantized_qk(q: torch.Tensor, k: torch.Tensor, fmt: str, balanced: bool, q_rows: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_hat, k_hat)`` float32, whose products approximate ``q . (k - mean(k))``."""
    q_in, k_in = fp8.smoothed_inputs(q, k, fp8.key_means(k), balanced)
    return (fp8.dequantize_blocks(*fp8.quantize_blocks(q_in, q_rows, fmt), q_rows),
            fp8.dequantize_blocks(*fp8.quantize_blocks(k_in, BLOCK, fmt), BLOCK))


def weight_error(q: torch.Tensor, k: torch.Tensor, q_hat: torch.Tensor, k_hat: torch.Tensor) -> float:
    """Mean over heads and rows of the L1 distance between the causal softmax rows of ``q k^T``
    and ``q_hat k_hat^T`` (``q`` ``(1, Hq, N, D)``, ``k`` ``(1, Hk, N, D)``)."""
    heads, n, d = q.shape[1], q.shape[2], q.shape[3]
    group = heads // k.shape[1]
    future = torch.ones(n, n, dtype=torch.bool).triu(1)
    total = 0.0
    for h in range(heads):
        exact = torch.softmax((q[0, h].float() @ k[0, h // group].float().T * d**-0.5).masked_fill(future, -torch.inf), -1)
        approx = torch.softmax((q_hat[0, h] @ k_hat[0, h // group].T * d**-0.5).masked_fill(future, -torch.inf), -1)
        total += (approx - exact).abs().sum(-1).mean().item()
    return total / heads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["smollm2", "gemma3-270m"], default="smollm2")
    parser.add_argument("--length", type=int, default=2048, help="tokens of the held-out document")
    parser.add_argument("--out", type=Path, help="JSON output path")
    args = parser.parse_args()
    from pbs.analysis.hf_capture import capture_qk
    from pbs.analysis.quality_models import gemma3_location, load_model
    from pbs.analysis.quality_texts import TEXT_SETS, TextLibrary, build_samples

    started = time.time()
    loaded = load_model(*gemma3_location()) if args.model == "gemma3-270m" else load_model()
    library = TextLibrary(loaded.tokenize)
    sample = next(s for s in build_samples([TEXT_SETS["heldout"]], library, lengths=(args.length,), fillers=())
                  if s.kind != "copy")
    print(f"capturing q/k of {sample.name} ({sample.length} tokens) ...", file=sys.stderr, flush=True)
    capture = capture_qk(loaded.model, sample.input_ids[None])
    per_layer: dict[str, list[float]] = {label: [] for label in SCHEMES}
    for layer, q, k in zip(capture.layer_ids, capture.queries, capture.keys):
        for label, scheme in SCHEMES.items():
            per_layer[label].append(weight_error(q, k, *quantized_qk(q, k, *scheme)))
        print(f"layer {layer}: " + ", ".join(f"{label} {errors[-1]:.4f}" for label, errors in per_layer.items()),
              file=sys.stderr, flush=True)
    summary = {label: {"mean": sum(errors) / len(errors), "max": max(errors)} for label, errors in per_layer.items()}
    for label, row in summary.items():
        print(f"{label:36s} mean {row['mean']:.4f}  max {row['max']:.4f}")
    if args.out:
        save({**environment("cpu"), "model": args.model, "sample": sample.name, "tokens": sample.length,
              "block": BLOCK, "metric": "mean over heads and query rows of sum_j |p_hat - p| of causal softmax rows",
              "schemes": {label: dict(zip(("format", "balanced", "query_rows_per_scale"), scheme))
                          for label, scheme in SCHEMES.items()},
              "layers": capture.layer_ids, "per_layer": per_layer, "summary": summary,
              "wall_s": round(time.time() - started, 1)}, args.out)
        print("wrote", args.out)


if __name__ == "__main__":
    main()
