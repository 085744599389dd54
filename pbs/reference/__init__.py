"""Pure-PyTorch reference path: the oracle and the kernels' eager twins."""

from pbs.reference.block_mass import attention_coverage, block_attention_mass
from pbs.reference.block_sparse import block_sparse_attention_reference
from pbs.reference.dense import dense_attention

__all__ = [
    "attention_coverage",
    "block_attention_mass",
    "block_sparse_attention_reference",
    "dense_attention",
]
