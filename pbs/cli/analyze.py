"""``pbs analyze``: coverage-density curves, head statistics and attention maps, written to a folder."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pbs.cli.common import (
    OptionalPackage,
    UsageError,
    check_device,
    check_model_files,
    config_error_message,
    positive_int,
    read_text_file,
    require_packages,
    unit_interval,
)

DEFAULT_OUT = "pbs-analysis"


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0.0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers, e.g. 0,8,16, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("must name at least one layer")
    return values


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    import pbs
    from pbs.analysis.coverage import DEFAULT_PERMUTERS

    permuters = pbs.list_permuters()
    parser = sub.add_parser(
        "analyze",
        help="coverage-density curves, head statistics and attention maps (PNG + JSON/CSV)",
        description=(
            "Analyse what permutation does to block sparsity. Inputs: the built-in synthetic workload "
            "(default), a .pt/.safetensors file of q/k (--input), or a local transformers model "
            "(--model with --prompt-file). Writes coverage_density.*, head_stats.* and attention_map.* "
            "into --out."
        ),
    )
    source = parser.add_argument_group("inputs")
    exclusive = source.add_mutually_exclusive_group()
    exclusive.add_argument("--input", metavar="PATH", help='.pt (dict with "q", "k") or .safetensors file of queries and keys')
    exclusive.add_argument("--model", metavar="PATH", help="local transformers model directory to capture q/k from")
    source.add_argument("--prompt-file", metavar="F", help="text file to feed --model")
    source.add_argument("--layers", type=_int_list, metavar="L0,L1,...", help="--model layers to capture (default all)")
    source.add_argument("--seq-len", type=positive_int, default=None,
                        help="tokens: of the synthetic workload (default 4096) or kept of the prompt")
    source.add_argument("--heads-q", type=positive_int, default=8, help="synthetic workload query heads (default 8)")
    source.add_argument("--heads-kv", type=positive_int, default=4, help="synthetic workload KV heads (default 4)")
    source.add_argument("--head-dim", type=positive_int, default=64, help="synthetic workload head dim (default 64)")
    source.add_argument("--seed", type=int, default=0, help="synthetic workload seed")
    source.add_argument("--device", type=check_device, default="cpu",
                        help="where --model runs and the analysis computes (default cpu)")

    analysis = parser.add_argument_group("analysis")
    analysis.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help=f"output folder (default {DEFAULT_OUT}/)")
    analysis.add_argument("--permuters", nargs="+", choices=permuters, default=list(DEFAULT_PERMUTERS), metavar="NAME",
                          help=f"permuters of the coverage-density curves (default: {' '.join(DEFAULT_PERMUTERS)}; "
                               f"choices: {', '.join(permuters)})")
    analysis.add_argument("--coverage-target", type=unit_interval, default=0.975,
                          help="coverage at which head densities are compared (default 0.975, as in the paper)")
    analysis.add_argument("--baseline", choices=permuters, default="identity", help="order to compare with (default identity)")
    analysis.add_argument("--permuter", choices=permuters, default="last_block", help="permutation under test (default last_block)")
    analysis.add_argument("--tolerance", type=_non_negative_float, default=0.01,
                          help="|density gain| <= this counts as unchanged (default 0.01)")
    analysis.add_argument("--head", type=_non_negative_int, default=0, help="query head of the attention map (default 0)")
    analysis.add_argument("--layer", type=int, default=None, help="layer id of the attention map (default the first captured)")
    analysis.add_argument("--selector", choices=pbs.list_selectors(), default="mean_pool",
                          help="selector whose blocks the attention map overlays (default mean_pool)")
    analysis.add_argument("--threshold", type=unit_interval, default=None,
                          help="the selector's threshold (default its own, 0.9 for mean_pool)")
    analysis.add_argument("--block-size", type=positive_int, default=128)
    analysis.add_argument("--segment-size", type=positive_int, default=256)
    analysis.add_argument("--gqa", choices=["shared", "per_head"], default="shared")
    analysis.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def run(args: argparse.Namespace) -> int:
    from pbs.analysis.report import write_analysis
    from pbs.config import PBSConfig

    try:  # the config first: a bad --block-size fails before any input is loaded
        config = PBSConfig(block_size=args.block_size, segment_size=args.segment_size, gqa=args.gqa)
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise UsageError(config_error_message(exc)) from None
    selector = _selector(args)
    require_packages(_optional_packages(args), "pbs analyze draws with matplotlib"
                     + (", reads .safetensors files with safetensors" if _reads_safetensors(args) else "")
                     + (", runs --model with transformers" if args.model else ""))
    capture = _load_inputs(args)
    _check_head_and_layer(args, capture)

    print(f"pbs analyze: {capture.describe()}")
    report = write_analysis(
        capture,
        args.out,
        permuters=args.permuters,
        coverage_target=args.coverage_target,
        baseline=args.baseline,
        permuter=args.permuter,
        tolerance=args.tolerance,
        head=args.head,
        layer=args.layer,
        selector=selector,
        config=config,
        progress=not args.quiet,
    )
    print()
    print(report.head_stats.summary())
    print()
    print("coverage-density (head mean, oracle selection):")
    print(report.curves.summary())
    print()
    panels = ", ".join(f"{p.permuter} coverage {p.coverage:.3f} density {p.density:.3f}" for p in report.maps.panels)
    print(f"attention map, layer {report.maps.layer} head {report.maps.head}, {report.maps.selector}: {panels}")
    print()
    print(f"wrote {len(report.files)} files to {Path(args.out)}/:")
    for path in report.files.values():
        print(f"  {path}")
    return 0


def _reads_safetensors(args: argparse.Namespace) -> bool:
    return bool(args.input) and Path(args.input).suffix.lower() == ".safetensors"


def _optional_packages(args: argparse.Namespace) -> list[OptionalPackage]:
    """What this run imports beyond the base install, each with the extra that brings it."""
    packages = [OptionalPackage("matplotlib", "analysis")]
    if _reads_safetensors(args):
        packages.append(OptionalPackage("safetensors", "analysis"))
    if args.model:
        packages.append(OptionalPackage("transformers", "hf"))
    return packages


def _load_inputs(args: argparse.Namespace) -> Any:
    from pbs.analysis.inputs import load_capture, synthetic_capture

    if args.prompt_file and not args.model:
        raise UsageError("--prompt-file is only used with --model")
    if args.layers and not args.model:
        raise UsageError("--layers is only used with --model (files hold the layers they hold)")
    if args.input:
        try:
            capture = load_capture(args.input)
        except (FileNotFoundError, ValueError, TypeError, ImportError) as exc:
            raise UsageError(f"argument --input: {_strip_argument_name(exc)}") from exc
        return _trim(capture, args.seq_len) if args.seq_len else capture
    if args.model:
        if not args.prompt_file:
            raise UsageError("--model needs --prompt-file (the text to run through the model)")
        prompt = read_text_file(args.prompt_file, "--prompt-file")
        if Path(args.model).expanduser().is_dir():
            check_model_files(Path(args.model).expanduser(), None, "--model")
        from pbs.analysis.hf_capture import capture_qk_from_pretrained

        try:
            return capture_qk_from_pretrained(
                args.model, prompt=prompt, seq_len=args.seq_len, layers=args.layers, device=args.device
            )
        except FileNotFoundError as exc:
            raise UsageError(f"argument --model: {_strip_argument_name(exc)}") from exc
        except ValueError as exc:
            raise UsageError(f"argument --model: {exc}") from exc
    if args.heads_q % args.heads_kv:
        raise UsageError(f"--heads-q ({args.heads_q}) must be a multiple of --heads-kv ({args.heads_kv})")
    try:
        return synthetic_capture(
            seq_len=args.seq_len or 4096, heads_q=args.heads_q, heads_kv=args.heads_kv, head_dim=args.head_dim,
            seed=args.seed, device=args.device,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def _trim(capture: Any, seq_len: int) -> Any:
    """The first ``seq_len`` positions of a prefill capture (``Nq == Nk``)."""
    from pbs.analysis.inputs import QKCapture

    n = capture.keys[0].shape[2]
    if seq_len > n or capture.queries[0].shape[2] != n:
        raise UsageError(f"argument --seq-len: can keep at most the {n} positions of a prefill capture, got {seq_len}")
    return QKCapture.from_tensors(
        [q[:, :, :seq_len] for q in capture.queries], [k[:, :, :seq_len] for k in capture.keys],
        layer_ids=capture.layer_ids, source=f"{capture.source} (first {seq_len} tokens)",
    )


def _selector(args: argparse.Namespace) -> dict[str, Any]:
    from pbs.components import selector_registry

    spec: dict[str, Any] = {"name": args.selector}
    if args.threshold is not None:
        if "threshold" not in selector_registry.get(args.selector).model_fields:
            raise UsageError(f"argument --threshold: selector {args.selector!r} has no threshold")
        spec["threshold"] = args.threshold
    return spec


def _check_head_and_layer(args: argparse.Namespace, capture: Any) -> None:
    if args.head >= capture.heads_q:
        raise UsageError(f"--head must be in [0, {capture.heads_q}), got {args.head}")
    if args.layer is not None and args.layer not in capture.layer_ids:
        raise UsageError(f"--layer must be one of the captured layers {list(capture.layer_ids)}, got {args.layer}")


def _strip_argument_name(exc: BaseException) -> str:
    """Library errors start with the parameter's name (``path: ...``); the CLI names its flag instead."""
    text = str(exc)
    for prefix in ("path: ", "model_path: "):
        if text.startswith(prefix):
            return text[len(prefix):]
    return text
