"""What the ``pbs`` subcommands share: dtype names, the argparse value checks, and how a user
mistake found after parsing becomes one line (`UsageError`): a config option that takes a preset,
JSON text or a JSON file (`config_option`), a missing optional package (`require_packages`), a
backend that cannot run on the chosen device (`check_backends`)."""

from __future__ import annotations

import argparse
import difflib
import importlib.metadata
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def unit_interval(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def default_device() -> str:
    """``"cuda"`` when torch sees a CUDA device, else ``"cpu"``: the default of every ``--device``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(text: str) -> str:
    """``--device`` value check (an argparse ``type``): a device torch can name and this machine has.

    Returns the device as torch writes it (``"cpu"``, ``"cuda"``, ``"cuda:1"``). Raises
    ``argparse.ArgumentTypeError`` with one line that says what is wrong and what to use instead:
    an unknown name (``gpu``), CUDA on a torch built without it or on a machine without a GPU, a
    CUDA index past the last device, or a device type that is not available here.
    """
    try:
        device = torch.device(text.strip())
    except (RuntimeError, ValueError):
        hint = " (for the GPU, use cuda)" if text.strip().lower() in ("gpu", "nvidia", "cuda0") else ""
        raise argparse.ArgumentTypeError(f"unknown device {text!r}{hint}; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            raise argparse.ArgumentTypeError(
                f"{text!r}: this torch ({torch.__version__}) is a CPU-only build; install a CUDA build of "
                "torch to run on the GPU, or use --device cpu"
            )
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise argparse.ArgumentTypeError(f"{text!r}: torch sees no CUDA device on this machine; use --device cpu")
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(
                f"{text!r}: there is no CUDA device {device.index}; this machine has {count} (cuda:0 to cuda:{count - 1})"
            )
    elif device.type != "cpu":
        backend = getattr(torch, device.type, None)
        available = getattr(backend, "is_available", None)
        if not (callable(available) and available()):
            raise argparse.ArgumentTypeError(f"device {text!r} is not available here; use cpu or cuda")
    return str(device)


def config_error_message(exc: BaseException) -> str:
    """One line for an invalid config: pydantic's errors as ``field: message; ...``, without its
    ``[type=...]`` details and documentation URL; other exceptions as their text."""
    from pydantic import ValidationError

    if not isinstance(exc, ValidationError):
        return str(exc)
    parts = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        # The location names the field ("selector.treshold") unless the message already does in full.
        parts.append(f"{where}: {message}" if where and where not in message else message)
    return "; ".join(parts)


class UsageError(Exception):
    """A user mistake found after parsing. `pbs.cli.main` prints it as one line,
    ``pbs <command>: error: <message>``, and returns 2, as argparse does for its own errors."""


def close_match_hint(word: str, choices: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the nearest of ``choices``, or ``""``."""
    match = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


def check_output_file(path: str | None, option: str) -> None:
    """Fails up front where ``--json PATH`` could not be written after the run: its folder is missing
    or not writable, the path is a folder, or an existing file there is read-only."""
    if path is None:
        return
    target = Path(path).expanduser()
    if target.is_dir():
        raise UsageError(f"argument {option}: {path!r} is a directory; give a file name")
    if not target.parent.is_dir():
        raise UsageError(f"argument {option}: the folder of {path!r} does not exist")
    if target.exists() and not os.access(target, os.W_OK):
        raise UsageError(f"argument {option}: {path!r} exists and is not writable")
    if not target.exists() and not os.access(target.parent, os.W_OK | os.X_OK):
        raise UsageError(f"argument {option}: the folder of {path!r} is not writable")


def check_output_folder(path: str, option: str, file_names: Iterable[str], *, force: bool) -> None:
    """Fails before a long run where its output folder could not take its files afterwards: ``path``
    is a file, a folder on its way is a file, the folder (or the nearest existing one above it) is
    not writable, or one of ``file_names`` is already there (an earlier run's results) and
    ``force`` is off.

    Raises:
        UsageError: naming ``option`` and what to do instead.
    """
    target = Path(path).expanduser()
    if target.exists() and not target.is_dir():
        raise UsageError(f"argument {option}: {path!r} is a file; give a folder (it is created if missing)")
    existing = next(folder for folder in (target, *target.parents) if folder.exists())
    if not existing.is_dir():
        raise UsageError(f"argument {option}: cannot create {path!r}: {str(existing)!r} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        problem = f"{path!r} is not writable" if existing == target else (
            f"cannot create {path!r}: {str(existing)!r} is not writable")
        raise UsageError(f"argument {option}: {problem}")
    if existing != target:
        return
    for name in file_names:
        file = target / name
        if file.is_dir():
            raise UsageError(f"argument {option}: {str(file)!r} is a directory, where this run writes a file")
        if file.exists() and not force:
            raise UsageError(f"argument {option}: {str(file)!r} already exists (an earlier run's results); give "
                             "another --out or --name, or --force to overwrite it")
        if file.exists() and not os.access(file, os.W_OK):
            raise UsageError(f"argument {option}: {str(file)!r} exists and is not writable")


def read_text_file(path: str | Path, option: str) -> str:
    """The text of the UTF-8 file given to ``option`` (a prompt), checked before any model loads:
    it exists, is a file, decodes as UTF-8 (a byte-order mark is dropped), and holds more than
    whitespace.

    Raises:
        UsageError: naming ``option`` and what is wrong.
    """
    target = Path(path).expanduser()
    if target.is_dir():
        raise UsageError(f"argument {option}: {str(path)!r} is a directory; give a text file")
    if not target.is_file():
        raise UsageError(f"argument {option}: no such file: {str(path)!r}")
    try:
        data = target.read_bytes()
    except OSError as exc:
        raise UsageError(f"argument {option}: cannot read {str(path)!r}: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UsageError(f"argument {option}: {str(path)!r} is not UTF-8 text (byte 0x{data[exc.start]:02x} at "
                         f"offset {exc.start}); save it as UTF-8") from None
    if not text.strip():
        what = "is empty" if not text else "holds only whitespace"
        raise UsageError(f"argument {option}: {str(path)!r} {what}; give a file with the prompt's text")
    return text


def check_model_files(directory: Path, gguf_file: str | None, option: str, gguf_option: str = "--gguf-file") -> None:
    """The checks of a local model that cost nothing, before anything loads: a checkpoint directory
    holds a ``config.json`` that transformers reads (a JSON file, no weights), a GGUF file starts
    with the GGUF magic bytes. Reading a GGUF file's config would de-serialise its metadata (tens
    of seconds for SmolLM2-135M), so a broken GGUF file past its first bytes is found by the load,
    inside `loading_model`.

    Raises:
        UsageError: naming ``option`` (the directory's) or ``gguf_option`` and what is wrong.
    """
    if gguf_file is not None:
        path = directory / gguf_file
        try:
            with path.open("rb") as f:
                magic = f.read(4)
        except OSError as exc:
            raise UsageError(f"argument {gguf_option}: cannot read {str(path)!r}: {exc.strerror or exc}") from None
        if magic != b"GGUF":
            raise UsageError(f"argument {gguf_option}: {str(path)!r} is not a GGUF file (it does not start with the GGUF "
                             "magic bytes)")
        return
    if not (directory / "config.json").is_file():
        ggufs = sorted(path.name for path in directory.glob("*.gguf"))
        hint = (f"; for a GGUF file in it ({', '.join(ggufs[:3])}), give --gguf-file NAME" if ggufs
                else " (save_pretrained writes one)")
        raise UsageError(f"argument {option}: {str(directory)!r} holds no config.json, so it is not a transformers "
                         f"model directory{hint}")
    with loading_model(repr(str(directory))):
        import transformers

        transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True)


@contextmanager
def loading_model(where: str) -> Iterator[None]:
    """Turns a model that fails to load inside the block into one `UsageError` line,
    ``cannot load a model from <where>: <the loader's message on one line>``.

    transformers answers a directory without a model, a broken ``config.json``, a file that is not
    GGUF or torn weights with many exception types (``ValueError``, ``OSError``, safetensors' own),
    so every ``Exception`` raised while loading counts; a missing package (``ImportError``) and
    our own `UsageError` pass through.
    """
    try:
        yield
    except (ImportError, UsageError):
        raise
    except Exception as exc:  # noqa: BLE001 -- see the docstring: any loader failure is this one mistake
        message = " ".join(str(exc).split())
        if len(message) > _LOAD_MESSAGE_CHARS:
            message = message[: _LOAD_MESSAGE_CHARS - 3].rstrip() + "..."
        raise UsageError(f"cannot load a model from {where}: {message or type(exc).__name__}") from None


_LOAD_MESSAGE_CHARS = 400
"""The loader's message is cut to this many characters: one line, where transformers writes paragraphs."""


# --- config-taking options -------------------------------------------------------------------


def read_config_option(text: str, option: str) -> Any:
    """The value of a config-taking option (``--config``, ``--method``): a preset name (a
    `pbs.PBSConfig`), JSON text, or the path of a JSON file (its parsed JSON).

    Raises:
        UsageError: an unknown preset, invalid JSON, or no such file; the message names ``option``.
    """
    from pbs.config import PBSConfig, PRESETS

    stripped = text.strip()
    if stripped in PRESETS:
        return PBSConfig.from_preset(stripped)
    if stripped.startswith(("{", "[")):
        return _parse_json(stripped, f"invalid {option}: not valid JSON")
    path = Path(stripped).expanduser()
    if path.is_file():
        try:
            content = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"invalid {option}: cannot read {str(path)!r}: {exc}") from None
        return _parse_json(content, f"invalid {option}: {str(path)!r} is not valid JSON")
    if path.suffix or "/" in stripped or "\\" in stripped or path.is_dir():  # meant as a file
        what = "is a directory, not a JSON file" if path.is_dir() else "no such file"
        raise UsageError(f"invalid {option}: {what}: {stripped!r}" + close_match_hint(stripped, PRESETS))
    raise UsageError(
        f"invalid {option}: {stripped!r} is neither a preset ({', '.join(PRESETS)}), JSON text nor a JSON file"
        + close_match_hint(stripped, PRESETS)
    )


def _parse_json(text: str, context: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{context}: {exc}") from None


def config_option(text: str | None, option: str, build: Callable[[Any], Any]) -> Any:
    """``build`` applied to `read_config_option`'s value (``None`` when the option is not given), its
    errors as one `UsageError` line naming ``option`` (pydantic's as ``field: message``,
    `config_error_message`)."""
    value = None if text is None else read_config_option(text, option)
    try:
        return build(value)
    except (ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
        raise UsageError(f"invalid {option}: {config_error_message(exc)}") from None


def check_backends(configs: Iterable[tuple[str, Any]], option: str, device: str, dtype: torch.dtype) -> None:
    """Fails before any model loads where a config names an unknown backend, or one that cannot run
    on ``device`` in ``dtype``.

    ``configs`` are ``(where, PBSConfig)`` pairs (``where``: ``""`` or e.g. ``"layer 5"``). The
    model's head dim is not known before it loads, so the check uses one every kernel takes (128):
    head-dim limits are checked when the model runs.

    Raises:
        UsageError: naming ``option``, the layer, and the backend's reasons.
    """
    from pbs.backends import CallSpec, check_backend_name, resolve_backend

    for where, config in configs:
        prefix = f"invalid {option}: " + (f"{where}: " if where else "")
        try:
            check_backend_name(config.backend)
        except ValueError as exc:
            raise UsageError(f"{prefix}{exc}") from None
        try:
            resolve_backend(config.backend, CallSpec(torch.device(device), dtype, 128, 128, config.block_size,
                                                                precision=config.precision))
        except ValueError as exc:
            dtype_name = str(dtype).removeprefix("torch.")
            message = f"{prefix}{exc} (on {device} in {dtype_name})"
            if "triton is not installed" in message:
                message += f"; install it with: {install_command(['triton'])}"
            raise UsageError(message) from None


def integration_layer_configs(integration: Any) -> list[tuple[str, Any]]:
    """``(where, PBSConfig)`` of every config a `PBSIntegrationConfig` runs: its ``pbs`` and each
    layer override that is not dense (for `check_backends`)."""
    configs = [("", integration.pbs)]
    configs += [(f"layer {i}", c) for i, c in sorted(integration.layer_overrides.items()) if c is not None]
    return configs


# --- optional packages -----------------------------------------------------------------------


@dataclass(frozen=True)
class OptionalPackage:
    """An optional dependency as a command needs it.

    Attributes:
        module: the name it imports as.
        extra: the ``pyproject.toml`` extra that installs it.
        minimum: the oldest version that works (``None``: any).
    """

    module: str
    extra: str
    minimum: str | None = None


def install_command(extras: Iterable[str]) -> str:
    """The pip command that installs ``extras`` from a checkout (run in the repository root)."""
    return f'python -m pip install -e ".[{",".join(sorted(set(extras)))}]"'


def require_packages(packages: Iterable[OptionalPackage], purpose: str) -> None:
    """Raises a one-line `UsageError` naming each package that is missing (or older than its
    ``minimum``) and the install command of their extras. Packages are found without importing
    them (``importlib.util.find_spec``), so the check costs nothing when they are there.

    Args:
        purpose: what the command needs them for, e.g. ``"pbs analyze draws its pictures with matplotlib"``.
    """
    missing, outdated, extras = [], [], []
    for package in packages:
        if importlib.util.find_spec(package.module) is None:
            missing.append(package.module)
        elif package.minimum and _older(version := _installed_version(package.module), package.minimum):
            outdated.append(f"{package.module} {version} is older than {package.minimum}")
        else:
            continue
        extras.append(package.extra)
    problems = outdated
    if missing:
        names = " and ".join([", ".join(missing[:-1]), missing[-1]] if len(missing) > 1 else missing)
        problems = [f"{names} {'are' if len(missing) > 1 else 'is'} not installed", *outdated]
    if problems:
        raise UsageError(f"{'; '.join(problems)} ({purpose}); install with: {install_command(extras)}")


def _installed_version(module: str) -> str:
    try:
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:  # importable but not installed by pip (a source tree)
        return ""


def _older(version: str, minimum: str) -> bool:
    """Whether ``version`` is older than ``minimum``; unknown (no version, no ``packaging``): no."""
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:  # packaging comes with the packages that have a minimum (transformers)
        return False
    try:
        return Version(version) < Version(minimum)
    except InvalidVersion:
        return False


# --- progress -------------------------------------------------------------------------------


def stderr_is_terminal() -> bool:
    """Whether stderr, where progress goes, is a terminal (progress is then redrawn in place)."""
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


@contextmanager
def quiet_loading_bars() -> Iterator[None]:
    """Where stderr is not a terminal (a log file, a pipe), no model-loading bars inside the block:
    transformers' own (``disable_progress_bar()``, for the rest of the process) and its GGUF
    de-quantisation bar, a plain tqdm bar that ignores that switch and would write one line redrawn
    with carriage returns. On a terminal nothing changes."""
    if stderr_is_terminal():
        yield
        return
    import transformers

    transformers.utils.logging.disable_progress_bar()
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # a transformers without GGUF support (or without gguf): nothing to quiet
        yield
        return
    original = getattr(gguf_utils, "tqdm", None)
    if not callable(original):
        yield
        return
    import functools

    gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = original
