"""pbs's kernel against cuDNN-frontend block-sparse attention (BSA) on identical masks, bf16 and FP8.

cuDNN's BSA (`nvidia-cudnn-frontend`, CuTe DSL kernels; ``block_sparse_attention_forward`` and the
"Sage" FP8 path ``block_sparse_attention_fp8_forward``) computes non-causal attention over a fixed
number of key blocks per query block, and its FP8 path takes equal query and key/value heads only.
So the protocol is the one both can run:

* B 1, H 32 query and 32 key/value heads, D 128, bf16 inputs (Gaussian), non-causal, block 128;
* every query block of every head selects the same number of key blocks, ``round(d * Nk / 128)``,
  drawn at random and sorted (seeded); both libraries get that same list;
* pbs: the Gluon kernel (``auto``'s choice on Hopper) with ``precision="native"`` and
  ``precision="fp8"``; cuDNN: ``sparse_block_size=128``, bf16 and Sage FP8;
* timed as a user calls them: each FP8 entry point takes bf16 inputs and quantizes them itself,
  and that pass is inside the time (pbs's attention alone on quantized inputs is recorded too).

Error (``--error-n``, default 4096): each output against fp32 attention over the same mask, on
Gaussian inputs and on the peaked inputs of `pbs.testing.make_qkv` (K/V expanded to the query
heads).

    python benchmarks/bench_cudnn_bsa.py --json benchmarks/results/kernel/cudnn_bsa_h200.json

cuDNN's side needs ``nvidia-cudnn-frontend`` (1.32 was measured) and the CuTe DSL it runs on:
``nvidia-cutlass-dsl``, ``-libs-base``, ``-libs-core`` and, for a CUDA 13 torch, ``-libs-cu13``
(92 MB), with ``apache-tvm-ffi``, ``cuda-bindings``, ``cuda-pathfinder`` and ``protobuf``. Without
network on the GPU machine: ``pip download`` them for its Python (3.12), split the 92 MB wheel in
two (``split -b 46000000``), carry the parts in successive calls into one folder there, join them
(``cat``) and ``pip install --no-deps`` every wheel (``nvidia-cutlass-dsl`` otherwise asks for the
cu12 libraries). Without the package the cuDNN columns record the import error and pbs's still run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: python3 benchmarks/bench_cudnn_bsa.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pbs  # noqa: E402
from benchmarks.common import environment, package_version, save, time_ms  # noqa: E402

BATCH, HEADS, HEAD_DIM, BLOCK = 1, 32, 128, 128


def block_tflops(num_blocks: int, ms: float) -> float:
    """FLOPs of the computed 128x128 blocks per second."""
    return 4 * BLOCK * BLOCK * HEAD_DIM * num_blocks / (ms * 1e-3) / 1e12


def fixed_count_lists(n: int, density: float, device: torch.device, seed: int = 0) -> torch.Tensor:
    """``(B, H, Tq, count)`` int32: for each query block, ``count`` distinct key blocks in
    ascending order, drawn uniformly."""
    blocks = n // BLOCK
    count = max(1, round(density * blocks))
    gen = torch.Generator(device=device).manual_seed(seed)
    draw = torch.rand(BATCH, HEADS, blocks, blocks, device=device, generator=gen)
    return draw.topk(count, dim=-1).indices.sort(dim=-1).values.to(torch.int32)


def block_mask(lists: torch.Tensor, n: int) -> pbs.BlockMask:
    """The same lists as pbs's `BlockMask` (non-causal, unsegmented layout)."""
    layout = pbs.Layout(batch=BATCH, heads_q=HEADS, heads_kv=HEADS, seq_len_q=n, seq_len_k=n, block_size=BLOCK,
                        segment_size=BLOCK, causal=False, segmented=False)
    blocks = n // BLOCK
    dense = torch.zeros(BATCH, HEADS, blocks, blocks, dtype=torch.bool, device=lists.device)
    dense.scatter_(-1, lists.long(), True)
    return pbs.BlockMask.from_dense(dense, layout)


def runners(q, k, v, lists: torch.Tensor, mask: pbs.BlockMask) -> dict:
    """Name -> zero-argument call returning the ``(B, H, N, D)`` output, for every path that runs
    here; a path that cannot run maps to the reason (a string)."""
    from pbs.kernels.hopper_attn import hopper_block_sparse_attention

    paths = {
        "pbs_bf16": lambda: hopper_block_sparse_attention(q, k, v, mask, causal=False),
        "pbs_fp8": lambda: hopper_block_sparse_attention(q, k, v, mask, causal=False, precision="fp8"),
    }
    try:
        from cudnn import block_sparse_attention_forward, block_sparse_attention_fp8_forward
    except Exception as exc:  # noqa: BLE001 - recorded: the comparison needs the wheel on the machine
        return {**paths, "cudnn_bf16": f"import: {exc}"[:300], "cudnn_fp8": f"import: {exc}"[:300]}
    count = lists.shape[-1]
    paths["cudnn_bf16"] = lambda: block_sparse_attention_forward(
        q, k, v, lists, count, sparse_block_size=BLOCK)["o_tensor"]
    paths["cudnn_fp8"] = lambda: block_sparse_attention_fp8_forward(
        q, k, v, lists, count, sparse_block_size=BLOCK)["o_tensor"]
    return paths


def _first_call(fn) -> str | None:
    """Runs ``fn`` once (compiles it); the error as text if it fails."""
    try:
        fn()
        torch.cuda.synchronize()
        return None
    except Exception as exc:  # noqa: BLE001 - one library's refusal is a result, not the end of the run
        return f"{type(exc).__name__}: {exc}"[:300]


def speed_point(n: int, density: float) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(n)
    q, k, v = (torch.randn(BATCH, HEADS, n, HEAD_DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
               for _ in range(3))
    lists = fixed_count_lists(n, density, q.device)
    mask = block_mask(lists, n)
    blocks = lists.numel()
    point = {"n": n, "requested_density": density, "blocks_per_query_block": lists.shape[-1],
             "density": lists.shape[-1] / (n // BLOCK), "blocks": blocks}
    for name, fn in runners(q, k, v, lists, mask).items():
        error = fn if isinstance(fn, str) else _first_call(fn)
        if error is not None:
            point[f"{name}_error"] = error
            continue
        point[f"{name}_ms"] = time_ms(fn)
        point[f"{name}_tflops_blocks"] = block_tflops(blocks, point[f"{name}_ms"])
    from pbs.kernels.block_sparse_attn import prepare_call
    from pbs.kernels.hopper_attn import launch_hopper, quantize_for_hopper

    call = prepare_call(q, k, v, mask, None, None, None, False, None)
    quantize_for_hopper(call, "fp8")
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    point["pbs_fp8_attention_ms"] = time_ms(lambda: launch_hopper(call, sms))
    for precision in ("bf16", "fp8"):
        ours, theirs = point.get(f"pbs_{precision}_ms"), point.get(f"cudnn_{precision}_ms")
        if ours and theirs:
            point[f"{precision}_speedup_vs_cudnn"] = theirs / ours
    if point.get("pbs_fp8_ms") and point.get("pbs_bf16_ms"):
        point["pbs_fp8_speedup_vs_pbs_bf16"] = point["pbs_bf16_ms"] / point["pbs_fp8_ms"]
    if point.get("cudnn_fp8_ms") and point.get("cudnn_bf16_ms"):
        point["cudnn_fp8_speedup_vs_cudnn_bf16"] = point["cudnn_bf16_ms"] / point["cudnn_fp8_ms"]
    print(f"N={n} d={point['density']:.3f}: " + ", ".join(
        f"{name} {point[name + '_ms']:.3f} ms ({point[name + '_tflops_blocks']:.0f} TF/s)" if name + "_ms" in point
        else f"{name} failed" for name in ("pbs_bf16", "cudnn_bf16", "pbs_fp8", "cudnn_fp8"))
        + f"; pbs fp8 attention alone {point['pbs_fp8_attention_ms']:.3f} ms", flush=True)
    for name in ("pbs_bf16", "cudnn_bf16", "pbs_fp8", "cudnn_fp8"):
        if name + "_error" in point:
            print(f"  {name}: {point[name + '_error']}", flush=True)
    return point


def error_points(n: int) -> list[dict]:
    """Relative (Frobenius) and max-abs error of each path against fp32 attention over one mask."""
    from pbs.reference import block_sparse_attention_reference
    from pbs.testing import make_qkv

    gen = torch.Generator(device="cuda").manual_seed(1)
    peaked = make_qkv(BATCH, HEADS, 8, n, HEAD_DIM, seed=1, device="cuda")
    inputs = {
        "gaussian": tuple(torch.randn(BATCH, HEADS, n, HEAD_DIM, device="cuda", generator=gen) for _ in range(3)),
        "structured": (peaked[0], *(x.repeat_interleave(HEADS // 8, 1) for x in peaked[1:])),
    }
    points = []
    for name, (q32, k32, v32) in inputs.items():
        q, k, v = (x.bfloat16() for x in (q32, k32, v32))
        for density in (0.3, 1.0):
            lists = fixed_count_lists(n, density, q.device, seed=2)
            mask = block_mask(lists, n)
            positions = torch.arange(n, device=q.device).expand(BATCH, HEADS, n)
            truth = block_sparse_attention_reference(q32, k32, v32, mask, positions, positions, causal=False)
            point = {"inputs": name, "n": n, "density": lists.shape[-1] / (n // BLOCK)}
            for path, fn in runners(q, k, v, lists, mask).items():
                try:
                    out = None if isinstance(fn, str) else fn()
                except Exception as exc:  # noqa: BLE001 - recorded with the point
                    out, fn = None, f"{type(exc).__name__}: {exc}"[:300]
                if out is None:
                    point[path] = {"error": fn}
                    continue
                diff = (out.float() - truth).abs()
                point[path] = {"relative": (diff.norm() / truth.norm()).item(), "max_abs": diff.max().item()}
            points.append(point)
            print(f"  error {name} d={point['density']:.2f}: " + ", ".join(
                f"{key} {value['relative']:.4f} (max {value['max_abs']:.4f})" if "relative" in value
                else f"{key} failed" for key, value in point.items() if isinstance(value, dict)), flush=True)
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    parser.add_argument("--densities", type=float, nargs="+", default=[0.1, 0.3, 0.5])
    parser.add_argument("--error-n", type=int, default=4096)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_cudnn_bsa.py needs a CUDA GPU (Hopper: the Gluon kernel and cuDNN's SM90 BSA)")
    result = {
        **environment(torch.device("cuda")),
        "cudnn_frontend": package_version("cudnn"),
        "cutlass_dsl": package_version("cutlass"),
        "shape": {"batch": BATCH, "heads_q": HEADS, "heads_kv": HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16",
                  "block": BLOCK, "causal": False, "masks": "fixed count per query block, uniform random, sorted"},
        "timing": "benchmarks.common.time_ms: median of medians of CUDA-event times, L2 flushed before each run",
        "points": [speed_point(n, d) for n in args.n for d in args.densities],
        "errors": error_points(args.error_n) if args.error_n else [],
    }
    if args.json:
        save(result, args.json)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
