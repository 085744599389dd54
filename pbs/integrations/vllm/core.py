"""What the vLLM adapters share, with no vLLM import: the plugin's config, which layers pbs refuses
and why, the split of a step's batch into the requests pbs takes and the rest, the engine's own
kernel on the rest, the `pbs.varlen_attention` call over vLLM's paged cache, and the
once-per-request log line.

A vLLM V1 step is one packed batch: request ``i`` owns the query rows ``bounds_q[i]:bounds_q[i+1]``
(its new tokens) and has ``seq_lens[i]`` keys in the paged cache (its cached context, then its new
tokens, already written when attention runs). Its queries are the last ``q_len`` of its
``seq_len`` positions: bottom-right causal alignment, as `pbs.varlen_attention` takes them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from pbs.api import attention
from pbs.config import PRESETS, PBSConfig
from pbs.integrations.dispatch import PBSIntegrationConfig, choose_attention
from pbs.serving import varlen_attention
from pbs.types import PagedTensor

CONFIG_ENV = "PBS_VLLM_CONFIG"
"""The environment variable that enables the plugin and holds its config (`parse_config`)."""
ADDITIONAL_CONFIG_KEY = "pbs"
"""The key of vLLM's ``--additional-config`` (``VllmConfig.additional_config``) that does the same."""
TRACE_ENV = "PBS_VLLM_TRACE"
"""A file path: each step where pbs takes requests appends one JSON line there (`BatchSplit.trace_line`)."""

# Under vLLM's own logger tree, so the line is printed with vLLM's format and level.
logger = logging.getLogger("vllm.plugins.pbs")

_INTEGRATION_KEYS = frozenset(PBSIntegrationConfig.model_fields)


def parse_config(value: Any, source: str) -> PBSIntegrationConfig:
    """The plugin's config from one source.

    Args:
        value: a preset name of `pbs.config.PRESETS`; a `PBSConfig` as a dict or JSON object; or
            the fields of `PBSIntegrationConfig` that the plugin reads (``pbs``, ``min_seq_len``,
            ``min_query_len``) as a dict or JSON object, e.g. ``{"pbs": "pbs_paper",
            "min_seq_len": 4096}``. An object with any of those keys is read as the latter.
        source: where ``value`` came from, for the error message.

    Raises:
        ValueError: a value neither form accepts, or ``skip_first_layers``/``layer_overrides``
            (the plugin splits each step once for every layer, so every layer runs one config).
    """
    try:
        if isinstance(value, str) and value.lstrip().startswith("{"):
            value = json.loads(value)
        if isinstance(value, Mapping) and _INTEGRATION_KEYS & set(value):
            config = PBSIntegrationConfig.model_validate(dict(value))
        else:
            config = PBSIntegrationConfig(pbs=PBSConfig.coerce(value))
    except (ValueError, TypeError) as error:
        raise ValueError(
            f"{source}: not a pbs config ({error}). Give a preset name {sorted(PRESETS)}, a PBSConfig "
            f"as JSON, or JSON with the keys 'pbs', 'min_seq_len', 'min_query_len'"
        ) from None
    for field, unset in (("skip_first_layers", 0), ("layer_overrides", {})):
        if getattr(config, field) != unset:
            raise ValueError(
                f"{source}: {field} is not supported by the vLLM plugin (it splits each step's batch once, for "
                f"every layer, so every layer runs the same config); leave it out"
            )
    return config


def resolve_config(additional_config: Mapping[str, Any] | None, environ: Mapping[str, str] = os.environ) -> PBSIntegrationConfig | None:
    """The plugin's config for an engine, or None when the plugin is not enabled.

    It is enabled by ``PBS_VLLM_CONFIG`` (`CONFIG_ENV`) or by the ``"pbs"`` key of vLLM's
    ``--additional-config`` (`ADDITIONAL_CONFIG_KEY`); each holds what `parse_config` reads.
    Both at once must agree.

    Raises:
        ValueError: a value `parse_config` refuses, or two sources that disagree.
    """
    from_env = environ.get(CONFIG_ENV)
    from_engine = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
    configs = []
    if from_env is not None and from_env.strip():
        configs.append(parse_config(from_env, f"${CONFIG_ENV}"))
    if from_engine is not None:
        configs.append(parse_config(from_engine, f"--additional-config '{ADDITIONAL_CONFIG_KEY}'"))
    if len(configs) == 2 and configs[0] != configs[1]:
        raise ValueError(
            f"${CONFIG_ENV} and --additional-config '{ADDITIONAL_CONFIG_KEY}' give different pbs configs; give one"
        )
    return configs[0] if configs else None


def enabled_for(engine_config: Any, *, unknown: bool = False) -> bool:
    """Whether the plugin is enabled for the engine whose ``VllmConfig`` is ``engine_config``
    (`resolve_config` of its ``additional_config``); with ``engine_config`` None (no engine config
    is current), the environment decides, or ``unknown`` when that says no."""
    if engine_config is None:
        return unknown or resolve_config(None) is not None
    return resolve_config(engine_config.additional_config) is not None


@dataclasses.dataclass(frozen=True)
class BatchSplit:
    """A step's requests split between pbs and the engine's own (stock) kernel.

    Attributes:
        bounds_q: the ``N + 1`` query boundaries of the packed batch (read on the host).
        seq_lens: each request's keys (cached context plus new tokens).
        pbs_requests: the requests pbs takes, in batch order.
        stock_requests: every other request, in batch order.
    """

    bounds_q: tuple[int, ...]
    seq_lens: tuple[int, ...]
    pbs_requests: tuple[int, ...]
    stock_requests: tuple[int, ...]

    def q_len(self, i: int) -> int:
        return self.bounds_q[i + 1] - self.bounds_q[i]

    def trace_line(self) -> str:
        """One JSON line: ``{"pbs": [[q_len, seq_len], ...], "stock": [[q_len, seq_len], ...]}``."""
        pairs = lambda requests: [[self.q_len(i), self.seq_lens[i]] for i in requests]  # noqa: E731
        return json.dumps({"pbs": pairs(self.pbs_requests), "stock": pairs(self.stock_requests)})


def split_batch(bounds_q: Sequence[int], seq_lens: Sequence[int], config: PBSIntegrationConfig) -> BatchSplit:
    """Which requests of a step pbs takes: the rule of the transformers integration
    (`pbs.integrations.dispatch.choose_attention`) applied to each request's lengths.

    pbs takes a request with more than one new token whose keys reach
    ``config.pbs.dense_fallback.min_seq_len``, unless it is a chunk after a cached context with
    fewer than ``config.min_query_len`` new tokens. Decode tokens, short prompts, short chunks
    and empty entries stay with the stock kernel.

    Args:
        bounds_q: ``N + 1`` cumulative query lengths (``query_start_loc`` on the host).
        seq_lens: ``N`` key counts (``seq_lens`` on the host).
        config: the plugin's config.

    Raises:
        ValueError: boundaries and lengths of different counts, or a request with more new tokens
            than keys.
    """
    bounds_q, seq_lens = tuple(int(b) for b in bounds_q), tuple(int(n) for n in seq_lens)
    if len(bounds_q) != len(seq_lens) + 1:
        raise ValueError(f"query_start_loc has {len(bounds_q)} entries for {len(seq_lens)} seq_lens; expected one more")
    taken, rest = [], []
    for i, kv_len in enumerate(seq_lens):
        q_len = bounds_q[i + 1] - bounds_q[i]
        if q_len > kv_len:
            raise ValueError(f"request {i} has {q_len} new tokens but {kv_len} keys (seq_lens)")
        chosen = None
        if q_len > 0:
            chosen, _ = choose_attention(config, layer_idx=None, q_len=q_len, kv_len=kv_len, has_mask=False)
        (taken if chosen is not None else rest).append(i)
    return BatchSplit(bounds_q, seq_lens, tuple(taken), tuple(rest))


def token_rows(bounds_q: Sequence[int], requests: Sequence[int], device: torch.device) -> slice | torch.Tensor:
    """The packed rows of ``requests``: a slice when they are one run of rows (no copy), else an
    int64 index tensor on ``device``."""
    spans = [(bounds_q[i], bounds_q[i + 1]) for i in requests if bounds_q[i + 1] > bounds_q[i]]
    if not spans:
        return slice(0, 0)
    if all(end == start for (_, end), (start, _) in zip(spans, spans[1:])):
        return slice(spans[0][0], spans[-1][1])
    return torch.cat([torch.arange(start, end) for start, end in spans]).to(device)


_UNCUT_FIELDS = ("dcp_local_seq_lens", "encoder_seq_lens", "mm_req_doc_ranges", "rswa_prefix_lens")


def splittable(common: Any) -> bool:
    """Whether `subset_metadata` can cut this step's ``CommonAttentionMetadata``: plain causal
    attention, and none of the per-request fields it does not cut (decode context parallelism,
    encoder lengths, multimodal ranges, reference sliding windows) set."""
    return common.causal is True and all(getattr(common, name, None) is None for name in _UNCUT_FIELDS)


def subset_metadata(common: Any, split: BatchSplit) -> Any:
    """vLLM's ``CommonAttentionMetadata`` of the step, cut to ``split.stock_requests``: what the
    engine's own builder then builds the stock kernel's metadata from. The fields an attention
    builder reads for decoder layers are cut (query starts, lengths, block table, request count,
    token count, maxima); the slot mapping is kept whole (the cache was written before attention)."""
    requests = list(split.stock_requests)
    q_lens = [split.q_len(i) for i in requests]
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    starts_cpu = torch.tensor(starts, dtype=common.query_start_loc_cpu.dtype)
    device = common.seq_lens.device
    index = torch.tensor(requests, dtype=torch.long, device=device)
    cut = lambda x: None if x is None else x.index_select(0, index.to(x.device))  # noqa: E731
    return dataclasses.replace(
        common,
        query_start_loc=starts_cpu.to(common.query_start_loc.device),
        query_start_loc_cpu=starts_cpu,
        seq_lens=cut(common.seq_lens),
        seq_lens_cpu_upper_bound=cut(common.seq_lens_cpu_upper_bound),
        is_prefilling=cut(common.is_prefilling),
        num_reqs=len(requests),
        num_actual_tokens=starts[-1],
        max_query_len=max(q_lens),
        max_seq_len=max(split.seq_lens[i] for i in requests),
        block_table_tensor=cut(common.block_table_tensor),
        positions=None,
    )


@dataclasses.dataclass
class PbsRows:
    """One step's `pbs.varlen_attention` call over the requests pbs takes.

    Attributes:
        config: the plugin's config.
        lengths: ``(q_len, seq_len)`` of each request, in the call's order.
        tokens: their rows of the packed query and output (`token_rows`).
        cu_seq_q: ``(n + 1,)`` int32: their cumulative query lengths, from 0.
        seqused_k: ``(n,)`` int32: their key counts.
        block_table: ``(n, max_pages)`` int32: their rows of the engine's block table.
        to_log: indices into ``lengths`` of the requests not logged yet; the first layer that runs
            the call measures and logs them, and empties it.
    """

    config: PBSIntegrationConfig
    lengths: list[tuple[int, int]]
    tokens: slice | torch.Tensor
    cu_seq_q: torch.Tensor
    seqused_k: torch.Tensor
    block_table: torch.Tensor
    to_log: list[int]

    @property
    def max_q(self) -> int:
        return max(q for q, _ in self.lengths)

    @property
    def max_k(self) -> int:
        return max(k for _, k in self.lengths)

    @property
    def host_bounds(self) -> tuple[list[int], list[int]]:
        """``cu_seq_q``'s and ``seqused_k``'s values, known on the host when the step is split: each
        layer's `pbs.varlen_attention` call reads no length on the device."""
        bounds = [0]
        for q_len, _ in self.lengths:
            bounds.append(bounds[-1] + q_len)
        return bounds, [k for _, k in self.lengths]


def pbs_rows(split: BatchSplit, block_table: torch.Tensor, config: PBSIntegrationConfig, log: "RequestLog") -> PbsRows:
    """The call of `split`'s pbs requests; ``block_table`` is the engine's ``(N, max_pages)`` table
    (its rows are selected on its device). Reads each request's first page on the host, for `log`."""
    requests = list(split.pbs_requests)
    device = block_table.device
    lengths = [(split.q_len(i), split.seq_lens[i]) for i in requests]
    cu = [0]
    for q_len, _ in lengths:
        cu.append(cu[-1] + q_len)
    index = torch.tensor(requests, dtype=torch.long, device=device)
    table = block_table.index_select(0, index).to(torch.int32)
    first_pages = table[:, 0].tolist()
    return PbsRows(
        config=config,
        lengths=lengths,
        tokens=token_rows(split.bounds_q, requests, device),
        cu_seq_q=torch.tensor(cu, dtype=torch.int32, device=device),
        seqused_k=torch.tensor([k for _, k in lengths], dtype=torch.int32, device=device),
        block_table=table,
        to_log=log.new_requests(first_pages, lengths),
    )


@dataclasses.dataclass
class StepSplit:
    """What a builder needs to split one step (`split_step`).

    Attributes:
        bounds_q: the ``N + 1`` query boundaries on the host.
        split: which requests pbs takes and which the stock kernel runs.
        rows: the call of pbs's requests.
        stock: vLLM's ``CommonAttentionMetadata`` cut to the stock requests, or None when pbs takes
            every request.
        stock_tokens: the stock requests' rows of the packed query (`token_rows`), or None.
    """

    bounds_q: list[int]
    split: BatchSplit
    rows: PbsRows
    stock: Any
    stock_tokens: slice | torch.Tensor | None


def split_step(common: Any, seq_lens: Sequence[int], config: PBSIntegrationConfig | None,
               log: "RequestLog") -> StepSplit | None:
    """One step's split between pbs and the stock kernel, or None when the stock kernel runs it
    whole (no config, a step `subset_metadata` cannot cut, or no request for pbs).

    Args:
        common: vLLM's ``CommonAttentionMetadata`` of the step.
        seq_lens: the ``num_reqs`` key counts on the host (each adapter knows where its engine
            keeps them).
        config: the builder's config (None: the plugin is off for its layers).
        log: the builder's `RequestLog`.
    """
    if config is None or not splittable(common):
        return None
    n = common.num_reqs
    bounds_q = common.query_start_loc_cpu[: n + 1].tolist()
    split = split_batch(bounds_q, seq_lens, config)
    if not split.pbs_requests:
        return None
    append_trace(split)
    rows = pbs_rows(split, common.block_table_tensor[:n], config, log)
    if not split.stock_requests:
        return StepSplit(bounds_q, split, rows, None, None)
    stock_tokens = token_rows(bounds_q, split.stock_requests, common.query_start_loc.device)
    return StepSplit(bounds_q, split, rows, subset_metadata(common, split), stock_tokens)


def attention_refusals(impl: Any, *, decoder: bool, sliding_window: bool, cache_dtype_unsupported: bool,
                       extra: Sequence[tuple[str, bool]] = ()) -> list[str]:
    """Why pbs cannot run one layer's attention (empty: it can), from vLLM's impl of the layer:
    what pbs's kernels lack, checked once for every adapter. The adapter reads the facts whose
    fields its backend spells its own way: ``decoder`` (a decoder's self-attention),
    ``sliding_window`` (one is set), ``cache_dtype_unsupported`` (a KV cache pbs cannot read, such
    as fp8); ``extra``: the backend's own ``(reason, refused)`` pairs."""
    checks = (
        (f"attention type {impl.attn_type}", not decoder),
        ("ALiBi", impl.alibi_slopes is not None),
        ("a sliding window", sliding_window),
        ("logit softcapping", bool(impl.logits_soft_cap)),
        ("attention sinks", impl.sinks is not None),
        (f"kv_cache_dtype {impl.kv_cache_dtype}", cache_dtype_unsupported),
        *extra,
    )
    return [reason for reason, refused in checks if refused]


def layer_refusals(layers: Mapping[str, Any], impl_class: type) -> list[str]:
    """Why some of a metadata builder's ``layers`` (name -> vLLM ``Attention`` layer) cannot run
    pbs: those whose impl is not the adapter's ``impl_class``, or whose impl refused
    (`attention_refusals`, kept as ``impl.pbs_refusals``). Empty: all of them can."""
    reasons = []
    for name, layer in layers.items():
        impl = layer.impl
        if not isinstance(impl, impl_class):
            reasons.append(f"{name}: its attention is {type(impl).__name__}")
        elif impl.pbs_refusals:
            reasons.append(f"{name}: {', '.join(impl.pbs_refusals)}")
    return reasons


def run_stock_rows(stock_forward: Any, stock: slice | torch.Tensor | None, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, output: torch.Tensor, *, new_rows_too: bool) -> None:
    """Runs the engine's own kernel on the packed rows of the requests pbs does not take
    (``stock``: a slice, an index tensor, or None for none): ``stock_forward(query, key, value,
    output)`` on those rows, its output written back into ``output``. ``new_rows_too``: the
    backend reads the step's new keys and values from ``key`` and ``value`` (so they are cut to
    the same rows); otherwise it reads them from its cache and takes them whole."""
    if stock is None:
        return
    if isinstance(stock, slice):
        stock_forward(query[stock], *((key[stock], value[stock]) if new_rows_too else (key, value)), output[stock])
        return
    out = output.new_empty((stock.numel(), *output.shape[1:]))
    kv = (key.index_select(0, stock), value.index_select(0, stock)) if new_rows_too else (key, value)
    stock_forward(query.index_select(0, stock), *kv, out)
    output.index_copy_(0, stock, out)


def attend_rows(
    rows: PbsRows, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, scale: float,
    output: torch.Tensor, *, block_table: torch.Tensor | None = None, layer_name: str = "",
) -> None:
    """Runs ``rows``' requests through `pbs.varlen_attention` over the paged cache and writes their
    output rows; logs the requests of ``rows.to_log`` first (and empties it).

    Args:
        rows: the step's pbs call (`pbs_rows`).
        query: ``(T, Hq, D)``: the step's packed queries (all requests).
        key_cache, value_cache: ``(num_pages, page_size, Hkv, D)`` views of the engine's cache
            (any strides), or a gathered copy with its own ``block_table``.
        scale: the layer's softmax scale.
        output: ``(T, Hq, Dv)``: the step's output; only ``rows.tokens`` are written.
        block_table: replaces ``rows.block_table`` (for a gathered copy of the pages).
        layer_name: the layer, for the log line.
    """
    table = rows.block_table if block_table is None else block_table
    q = query[rows.tokens]
    if rows.to_log:
        _log_requests(rows, q, key_cache, value_cache, table, scale, layer_name)
    in_place = isinstance(rows.tokens, slice)  # a view of output: written in place
    result = varlen_attention(
        q, key_cache, value_cache, rows.cu_seq_q, None, rows.max_q, rows.max_k, rows.config.pbs,
        scale=scale, out=output[rows.tokens] if in_place else None, block_table=table, seqused_k=rows.seqused_k,
        host_bounds=rows.host_bounds,
    )
    if not in_place:
        output[rows.tokens] = result


def _log_requests(
    rows: PbsRows, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, table: torch.Tensor,
    scale: float, layer_name: str,
) -> None:
    """Logs each request of ``rows.to_log`` once, with the density `pbs.attention` plans for it in
    this layer: a second planning (and attention) of one layer per request, for the log only."""
    bounds = rows.cu_seq_q.tolist()
    for j in rows.to_log:
        q_len, seq_len = rows.lengths[j]
        q_seq = q[bounds[j] : bounds[j + 1]].transpose(0, 1).unsqueeze(0)
        k_seq, v_seq = (PagedTensor(cache, table[j], seq_len).gather() for cache in (key_cache, value_cache))
        _, plan = attention(q_seq, k_seq, v_seq, rows.config.pbs, scale=scale, return_plan=True)
        if plan.fallback is not None:
            what = f"dense in {layer_name or 'its first layer'} ({plan.fallback})"
        else:
            what = f"density {float(plan.density):.3f} in {layer_name or 'its first layer'}"
        logger.info("pbs ran on a request: %d new tokens after %d cached (%d keys); %s",
                    q_len, seq_len - q_len, seq_len, what)
    rows.to_log = []


class RequestLog:
    """Which requests pbs ran on were logged already, so that each is logged once.

    vLLM's attention metadata carries no request ids; a request is known by its first page (its
    block-table entry 0, which stays while the request lives) and by where its last chunk ended: a
    chunk that starts where the last logged chunk of the same first page ended continues that
    request. Two live requests that share their first page through the prefix cache can each be
    logged once more than that.
    """

    def __init__(self) -> None:
        self._ends: dict[int, int] = {}

    def new_requests(self, first_pages: Sequence[int], lengths: Sequence[tuple[int, int]]) -> list[int]:
        """Indices of the requests not logged yet; records where each one's chunk ends."""
        new = []
        for j, (page, (q_len, seq_len)) in enumerate(zip(first_pages, lengths)):
            if self._ends.get(page) != seq_len - q_len:
                new.append(j)
            self._ends[page] = seq_len
        return new


def append_trace(split: BatchSplit, environ: Mapping[str, str] = os.environ) -> None:
    """Appends ``split.trace_line()`` to the file named by ``PBS_VLLM_TRACE``, if it is set."""
    path = environ.get(TRACE_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as file:
            file.write(split.trace_line() + "\n")
