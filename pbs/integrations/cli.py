"""``pbs generate``: answer a long prompt with a local transformers model, timing TTFT with and without PBS.

TTFT (time to first token) here is the prefill forward plus picking the first token, measured after
``--warmup`` untimed prefills (the first PBS call compiles its Triton kernels). Only the last
position's logits are computed, as generation does, so long prompts do not materialise
``(N, vocab)`` logits. transformers is imported when the command runs, not when ``pbs`` loads.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from pbs.cli import DTYPES, positive_int


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    gen = sub.add_parser(
        "generate",
        help="answer a prompt file with a local transformers model; print TTFT with SDPA and with PBS",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gen.add_argument("model", help="local model directory (config, weights and tokenizer from save_pretrained)")
    gen.add_argument("--prompt-file", required=True, type=Path, help="UTF-8 text file with the prompt")
    gen.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens to generate (default 64)")
    gen.add_argument(
        "--config",
        help="PBSConfig or PBSIntegrationConfig as JSON text or a path to a JSON file (default: the PBS defaults)",
    )
    gen.add_argument("--skip-first-layers", type=int, help="run the first N layers dense")
    gen.add_argument("--min-seq-len", type=positive_int, help="sequences shorter than this run dense")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    gen.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    gen.add_argument(
        "--dtype", choices=sorted(DTYPES), help="model dtype (default bfloat16 on CUDA, float32 on CPU)"
    )
    gen.add_argument("--warmup", type=int, default=1, help="untimed prefills per attention before timing (default 1)")
    gen.add_argument("--repeats", type=positive_int, default=1, help="timed prefills per attention (median shown)")
    gen.add_argument("--pbs-only", action="store_true", help="skip the SDPA baseline")
    gen.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    gen.add_argument("--verbose", action="store_true", help="log why layers fell back to dense attention")
    return gen


def _read_config(text: str | None) -> Any:
    if text is None:
        return None
    path = Path(text)
    if not text.lstrip().startswith("{") and path.is_file():
        return json.loads(path.read_text(encoding="utf-8"))
    return json.loads(text)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_ttft(model: torch.nn.Module, input_ids: torch.Tensor, *, warmup: int = 1, repeats: int = 1) -> float:
    """Median seconds of a prefill forward plus the greedy first token.

    Args:
        model: a causal LM (``forward(input_ids, use_cache=True)`` returning ``.logits``).
        input_ids: ``(1, N)`` prompt tokens on the model's device.
        warmup: untimed runs first; repeats: timed runs.

    Returns:
        The median wall-clock time in seconds (the device is synchronised around each run).
    """
    import inspect

    kwargs: dict[str, Any] = {"use_cache": True}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kwargs["logits_to_keep"] = 1
    times = []
    with torch.inference_mode():
        for i in range(warmup + repeats):
            _synchronize(input_ids.device)
            start = time.perf_counter()
            logits = model(input_ids=input_ids, **kwargs).logits
            first_token = logits[:, -1].argmax(-1)
            first_token.cpu()  # waits for the device
            if i >= warmup:
                times.append(time.perf_counter() - start)
            del logits
    return statistics.median(times)


def _load(args: argparse.Namespace) -> tuple[Any, Any, torch.dtype]:
    import transformers
    from packaging.version import Version

    version = Version(transformers.__version__)
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    load_kwargs: dict[str, Any] = {"attn_implementation": "sdpa", "local_files_only": True}
    load_kwargs["dtype" if version >= Version("4.56") else "torch_dtype"] = dtype
    if importlib.util.find_spec("accelerate") is not None:  # loads straight to the device, not via CPU RAM
        load_kwargs["device_map"] = args.device
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, **load_kwargs)
    return tokenizer, model.to(args.device).eval(), dtype


def _encode(tokenizer: Any, text: str, chat: bool, device: str) -> torch.Tensor:
    if chat:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
    else:
        ids = tokenizer(text, return_tensors="pt").input_ids
    return ids.to(device)


def _generate(model: Any, tokenizer: Any, input_ids: torch.Tensor, max_new_tokens: int) -> str:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
    return tokenizer.decode(out[0, input_ids.shape[1] :], skip_special_tokens=True)


def run(args: argparse.Namespace) -> int:
    import logging

    from pydantic import ValidationError

    import pbs.integrations.transformers as pbs_hf

    if not Path(args.model).is_dir():
        print(f"pbs generate: model must be a local model directory, {args.model!r} is not one", file=sys.stderr)
        return 2
    if not args.prompt_file.is_file():
        print(f"pbs generate: --prompt-file {str(args.prompt_file)!r} does not exist", file=sys.stderr)
        return 2
    if args.skip_first_layers is not None and args.skip_first_layers < 0:
        print(f"pbs generate: --skip-first-layers must be >= 0, got {args.skip_first_layers}", file=sys.stderr)
        return 2
    overrides = {
        key: value
        for key, value in (("skip_first_layers", args.skip_first_layers), ("min_seq_len", args.min_seq_len))
        if value is not None
    }
    try:
        integration = pbs_hf.register(_read_config(args.config), **overrides)
    except (ValueError, TypeError, ValidationError) as exc:  # json errors are ValueErrors
        print(f"pbs generate: invalid --config: {exc}", file=sys.stderr)
        return 2
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(message)s")

    tokenizer, model, dtype = _load(args)
    input_ids = _encode(tokenizer, args.prompt_file.read_text(encoding="utf-8"), args.chat, args.device)
    n_tokens = input_ids.shape[1]
    print(
        f"pbs generate: {args.model} ({type(model).__name__}), {n_tokens} prompt tokens, "
        f"{str(dtype).removeprefix('torch.')} on {args.device}"
    )
    print(f"PBS config: {integration.model_dump_json()}")

    results: dict[str, dict[str, Any]] = {}
    for name in ["pbs"] if args.pbs_only else ["sdpa", "pbs"]:
        pbs_hf.switch_attention(model, name)
        ttft = measure_ttft(model, input_ids, warmup=args.warmup, repeats=args.repeats)
        with pbs_hf.trace_dispatch() as calls:
            answer = _generate(model, tokenizer, input_ids, args.max_new_tokens)
        prefill = [c for c in calls if c.q_len == n_tokens]
        results[name] = {"ttft_s": ttft, "answer": answer}
        if name == "pbs":
            densities = [c.density for c in prefill if c.density is not None]
            results[name]["pbs_layers"] = len(densities)
            results[name]["layers"] = len(prefill)
            results[name]["mean_density"] = statistics.fmean(densities) if densities else None
        print(f"\n--- answer ({name}) ---\n{answer}")

    print(f"\n{'attention':<10} {'TTFT (s)':>10} {'speed-up':>9}")
    base = results.get("sdpa", {}).get("ttft_s")
    for name, row in results.items():
        speedup = f"{base / row['ttft_s']:.2f}x" if base else ""
        print(f"{name:<10} {row['ttft_s']:>10.4f} {speedup:>9}")
    pbs_row = results["pbs"]
    density = pbs_row["mean_density"]
    print(
        f"PBS ran on {pbs_row['pbs_layers']} of {pbs_row['layers']} layers of the prefill"
        + (f", mean density {density:.3f}" if density is not None else " (see --verbose for why)")
    )
    if "sdpa" in results:
        same = results["sdpa"]["answer"] == pbs_row["answer"]
        print("answers: " + ("identical" if same else "differ"))
    if args.json:
        payload = {
            "model": args.model,
            "prompt_tokens": n_tokens,
            "device": args.device,
            "dtype": str(dtype).removeprefix("torch."),
            "config": json.loads(integration.model_dump_json()),
            "results": results,
        }
        Path(args.json).write_text(json.dumps(payload, indent=2), encoding="utf-8")
    return 0
