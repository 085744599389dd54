"""Pure-PyTorch reference path: the oracle, the kernels' eager twins and the math components share.

Eager twins of `pbs.kernels` (same stem): `block_means`, `threshold_select`, `block_sets`
(forced blocks; the allowed/diagonal/candidate sets are `pbs.layout.Layout` methods),
`density_probe`, `block_sparse_attn`, `gather` (the key permutation applied to K and V) and
`pad_rows` (a packed or paged batch padded to token-major buffers). The `last_block`, `antidiagonal`
and `sampled_rows` kernels have their twins in the component files of the same name
(`pbs.permuters.last_block`, `pbs.selectors.antidiagonal`, `pbs.selectors.sampled_rows`), which
hold each component's config with its reference implementation. Shared by components:
`logits.grouped_logits` (GQA logits without copying K) and `seeded` (seeded draws).
"""

from pbs.reference.block_mass import attention_coverage, block_attention_mass
from pbs.reference.block_sparse_attn import block_sparse_attention_reference
from pbs.reference.dense import dense_attention

__all__ = [
    "attention_coverage",
    "block_attention_mass",
    "block_sparse_attention_reference",
    "dense_attention",
]
