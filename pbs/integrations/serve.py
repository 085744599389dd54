"""An OpenAI-compatible server whose prefills run through PBS: the engine of ``pbs serve``.

The server is transformers' own serving stack (the one behind ``transformers serve``), pinned to one
model:

* transformers' request handlers answer ``POST /v1/completions``, ``POST /v1/chat/completions`` and
  ``POST /v1/responses`` (streaming or not; they need ``fastapi``, ``uvicorn`` and ``openai``);
* every request goes through transformers' continuous batching (``ContinuousBatchingManager``):
  each step packs the new tokens of the scheduled requests (whole prompts, chunks of long prompts,
  decode tokens) into one forward;
* the model's attention is `pbs.integrations.transformers.CONTINUOUS_BATCHING_NAME`, so in each step
  the requests whose keys reach ``min_seq_len`` run through `pbs.varlen_attention`, and decode
  tokens and short prompts run dense (`pbs.integrations.continuous_batching`). With
  ``attention="sdpa"`` the same server runs transformers' SDPA instead: the baseline.

Only the routes above and ``GET /v1/models`` and ``GET /health`` are served (transformers' app also
has audio and model-loading routes, which a server pinned to one text model does not need). The
model is loaded once, before the server listens, and never unloaded.

Nothing here imports transformers or the server packages until a server is built, so this module
imports without them. (Nor does it use ``from __future__ import annotations``: FastAPI reads the
routes' annotations, ``Request`` among them, which are local names of `build_server`.)
"""

import contextlib
import dataclasses
import statistics
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Literal

import torch

import pbs.integrations.transformers as pbs_hf
from pbs.integrations.dispatch import PBSIntegrationConfig

__all__ = [
    "SERVER_PACKAGES",
    "BatchingOptions",
    "ServedModel",
    "Server",
    "batching_config",
    "build_server",
    "dispatch_summary",
    "load_model",
]

# What the server needs beside transformers (transformers' own "serving" extra, less what it does
# not use here): the import names.
SERVER_PACKAGES: tuple[str, ...] = ("fastapi", "uvicorn", "openai")
# The oldest transformers whose serving package (transformers.cli.serving) this module was run with.
MIN_TRANSFORMERS = "5.17"

Attention = Literal["pbs", "sdpa"]


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """The one model a server answers for.

    Attributes:
        name: the name clients send as ``"model"`` (a request may also leave it out).
        directory: the local model directory (``save_pretrained``, or the folder of ``gguf_file``).
        gguf_file: a GGUF file inside ``directory`` (config, tokenizer and weights read from it),
            or ``None``.
    """

    name: str
    directory: Path
    gguf_file: str | None = None


@dataclasses.dataclass(frozen=True)
class BatchingOptions:
    """Continuous-batching settings; ``None`` leaves transformers' default (sized from free memory).

    Attributes:
        max_batch_tokens: most new tokens one step packs; a longer prompt is prefilled in chunks.
        num_blocks: pages of the paged KV cache.
        page_size: tokens per page.
    """

    max_batch_tokens: int | None = None
    num_blocks: int | None = None
    page_size: int | None = None


def load_model(served: ServedModel, *, attention: Attention, device: str, dtype: torch.dtype) -> tuple[Any, Any]:
    """Loads ``served`` (never downloading) and points its attention at ``attention``.

    Returns:
        ``(model, tokenizer)``: the model in eval mode on ``device`` in ``dtype``, with
        ``"pbs"`` attention switched to the continuous-batching route (`pbs.integrations.transformers.register`
        must have run), or left on ``"sdpa"``.
    """
    import importlib.util

    import transformers

    files: dict[str, Any] = {"gguf_file": served.gguf_file} if served.gguf_file is not None else {}
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(served.directory), local_files_only=True, **files)
    kwargs: dict[str, Any] = {"attn_implementation": "sdpa", "dtype": dtype, "local_files_only": True, **files}
    if importlib.util.find_spec("accelerate") is not None:  # straight onto the device, not through CPU memory
        kwargs["device_map"] = device
    model = transformers.AutoModelForCausalLM.from_pretrained(str(served.directory), **kwargs).to(device).eval()
    if attention == "pbs":
        pbs_hf.switch_attention(model, pbs_hf.CONTINUOUS_BATCHING_NAME)
    return model, tokenizer


def batching_config(options: BatchingOptions) -> Any:
    """transformers' ``ContinuousBatchingConfig`` for ``options``.

    Both attentions run under the same settings, with three of transformers' defaults turned off:

    * CUDA graphs: the PBS route reads each step's request lengths on the host, which a graph
      cannot replay;
    * the decode path over a block table (``max_blocks_per_request=0``): transformers may take it for
      any implementation whose name contains "flash", the PBS route's among them, and it calls
      FlashAttention's kernel instead of the attention function;
    * swapping SDPA for FlashAttention (``auto_switch_to_flash``), so the baseline is the SDPA it is
      named after.
    """
    import transformers

    fields = {f.name for f in dataclasses.fields(transformers.ContinuousBatchingConfig)}
    # The page size is page_size in transformers 5.24, block_size in 5.17.
    page_field = "page_size" if "page_size" in fields else "block_size"
    wanted = {
        "max_batch_tokens": options.max_batch_tokens,
        "num_blocks": options.num_blocks,
        page_field: options.page_size,
        "use_cuda_graph": False,
        "max_blocks_per_request": 0,
        "auto_switch_to_flash": False,
    }
    return transformers.ContinuousBatchingConfig(**{k: v for k, v in wanted.items() if v is not None and k in fields})


@dataclasses.dataclass
class Server:
    """A built server: its ASGI ``app`` (run it with uvicorn) and what it serves.

    Attributes:
        app: the FastAPI application.
        served: the model it answers for.
        attention: ``"pbs"`` or ``"sdpa"``.
        integration: the PBS config in effect (``None`` for ``"sdpa"``).
        model: the loaded model.
        trace: the list of `pbs.integrations.transformers.Dispatch` records given to `build_server`
            (filled while the server runs), or ``None``.
    """

    app: Any
    served: ServedModel
    attention: Attention
    integration: PBSIntegrationConfig | None
    model: Any
    trace: list[pbs_hf.Dispatch] | None
    _shutdown: Any = dataclasses.field(repr=False, default=None)

    def shutdown(self) -> None:
        """Stops the continuous-batching thread and drops the model (also run when the app stops)."""
        if self._shutdown is not None:
            self._shutdown()


def build_server(
    served: ServedModel,
    *,
    attention: Attention = "pbs",
    integration: PBSIntegrationConfig | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    batching: BatchingOptions = BatchingOptions(),
    trace: list[pbs_hf.Dispatch] | None = None,
) -> Server:
    """Loads ``served`` and builds the app that serves it (nothing listens yet).

    Args:
        served: the model.
        attention: ``"pbs"`` (registers ``integration`` with `pbs.integrations.transformers.register`)
            or ``"sdpa"``.
        integration: the PBS config (``None``: the defaults); ignored for ``"sdpa"``.
        device, dtype: where and how the model runs.
        batching: continuous-batching settings.
        trace: a list that `pbs.integrations.transformers.trace_dispatch` fills, kept open by the
            caller while the server runs; ``GET /pbs/dispatch`` then sums it up (`dispatch_summary`).
            Tracing measures each PBS request's density with a second solo call: for inspection.

    Returns:
        A `Server`.

    Raises:
        ValueError: an ``attention`` other than ``"pbs"`` and ``"sdpa"``.
    """
    if attention not in ("pbs", "sdpa"):
        raise ValueError(f"attention must be 'pbs' or 'sdpa', got {attention!r}")
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler
    from transformers.cli.serving.response import ResponseHandler
    from transformers.cli.serving.utils import X_REQUEST_ID, CBWorkerDeadError, GenerationState

    if attention == "pbs":
        integration = pbs_hf.register(integration)
    else:
        integration = None
    model, tokenizer = load_model(served, attention=attention, device=device, dtype=dtype)
    manager = _pinned_model_manager(served, model, tokenizer)
    state = GenerationState(continuous_batching=True, cb_config=batching_config(batching))

    def shutdown() -> None:
        state.shutdown()  # stops the batching thread, which would otherwise keep the process alive
        manager.shutdown()

    @contextlib.asynccontextmanager
    async def lifespan(app: Any):
        yield
        shutdown()

    app = FastAPI(lifespan=lifespan)
    handlers = dict(model_manager=manager, generation_state=state)
    chat, completion, response = ChatCompletionHandler(**handlers), CompletionHandler(**handlers), ResponseHandler(**handlers)

    @app.exception_handler(CBWorkerDeadError)
    async def _batching_died(_request: Request, exc: CBWorkerDeadError):
        return JSONResponse({"error": str(exc)}, status_code=503)

    @app.middleware("http")
    async def _request_id(request: Request, call_next):
        request.state.request_id = request.headers.get(X_REQUEST_ID) or str(uuid.uuid4())
        answer = await call_next(request)
        answer.headers[X_REQUEST_ID] = request.state.request_id
        return answer

    @app.post("/v1/completions")
    async def _completions(request: Request, body: dict):
        return await completion.handle_request(body, request.state.request_id)

    @app.post("/v1/chat/completions")
    async def _chat_completions(request: Request, body: dict):
        return await chat.handle_request(body, request.state.request_id)

    @app.post("/v1/responses")
    async def _responses(request: Request, body: dict):
        return await response.handle_request(body, request.state.request_id)

    # The routes below are coroutines: a plain function would run in one of AnyIO's worker threads,
    # which outlive the server by their idle timeout (10 s) and so hold the process after Ctrl-C.
    @app.get("/v1/models")
    async def _models():
        return JSONResponse({"object": "list", "data": [
            {"id": served.name, "object": "model", "created": 0, "owned_by": "local"}
        ]})

    @app.get("/health")
    async def _health():
        if not state.is_cb_alive():
            return JSONResponse({"status": "unhealthy", "reason": "continuous batching worker died"}, status_code=503)
        return JSONResponse({"status": "ok"})

    if trace is not None:
        @app.get("/pbs/dispatch")
        async def _dispatch():
            return JSONResponse(dispatch_summary(trace))

    return Server(app, served, attention, integration, model, trace, shutdown)


def _pinned_model_manager(served: ServedModel, model: Any, tokenizer: Any) -> Any:
    """transformers' ``ModelManager`` serving ``model`` under ``served.name`` alone: a request naming
    another model is refused (400), and the model is never unloaded."""
    from transformers.cli.serving.model_manager import ModelManager

    class PinnedModelManager(ModelManager):
        # The loader hooks of transformers' manager (the same in 5.17 and 5.24), answered with the model
        # loaded by `load_model`, whatever name the manager derived from ``served.name``.
        def _load_processor(self, *args: Any, **kwargs: Any) -> Any:
            return tokenizer

        def _load_model(self, *args: Any, **kwargs: Any) -> Any:
            return model

    return PinnedModelManager(device=str(model.device), dtype="auto", force_model=served.name)


def dispatch_summary(records: list[pbs_hf.Dispatch]) -> dict[str, Any]:
    """What the traced attention calls ran, summed over the records so far.

    Args:
        records: `pbs.integrations.transformers.Dispatch` records (one per layer and request of a step).

    Returns:
        ``{"pbs_calls", "pbs_query_tokens", "mean_density", "min_density", "dense_calls",
        "dense_query_tokens"}``: the layer calls that ran PBS and the query tokens they covered,
        the mean and lowest density of those calls (``None`` without any), and the dense calls and
        their query tokens, each by reason (`pbs.integrations.dispatch.FALLBACK_REASONS` keys).
    """
    snapshot = list(records)  # the batching thread appends while this runs
    pbs_calls = [r for r in snapshot if r.path == "pbs"]
    densities = [r.density for r in pbs_calls if r.density is not None]
    dense_calls: Counter[str] = Counter()
    dense_tokens: Counter[str] = Counter()
    for r in snapshot:
        if r.path == "sdpa":
            dense_calls[str(r.reason)] += 1
            dense_tokens[str(r.reason)] += r.q_len
    return {
        "pbs_calls": len(pbs_calls),
        "pbs_query_tokens": sum(r.q_len for r in pbs_calls),
        "mean_density": statistics.fmean(densities) if densities else None,
        "min_density": min(densities) if densities else None,
        "dense_calls": dict(dense_calls),
        "dense_query_tokens": dict(dense_tokens),
    }
