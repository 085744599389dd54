"""Serving entry points: packed variable-length batches and merging partial attention results.

Names and layouts follow the serving stacks (PyTorch's ``varlen_attn``, FlashAttention,
FlashInfer): packed ``(T, H, D)`` tensors, ``cu_seq_q``/``cu_seq_k``, ``max_q``/``max_k``, a paged
KV cache ``(num_pages, page_size, Hkv, D)`` with ``block_table`` and ``seqused_k``, and a float32
log-sum-exp of shape ``(H, T)``. docs/serving.md says what exists and what does not yet.
"""

from pbs.serving.merge import merge_attention_states
from pbs.serving.varlen import varlen_attention

__all__ = ["merge_attention_states", "varlen_attention"]
