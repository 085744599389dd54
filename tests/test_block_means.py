"""`pbs.kernels.block_means` against its eager twin `pbs.reference.block_means`, through the
Triton interpreter on CPU (fp32/fp16, with and without a gather through a permutation)."""

from __future__ import annotations

import pytest
import torch

import pbs
from pbs.kernels.block_means import block_means
from pbs.reference.block_means import block_means as reference_block_means
from tests.planning_helpers import (
    case_config,
)

# Every interpreted launch here has its addresses checked (tests/interpreter_bounds.py).
pytestmark = pytest.mark.usefixtures("checked_addresses")


# -- block means-------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gather", [False, True])
def test_block_means_match_reference(dtype, gather):
    q, k, _ = pbs.testing.make_qkv(batch=2, heads_q=4, heads_kv=2, seq_len=200, head_dim=24, dtype=dtype)
    if gather:
        perm = pbs.plan(q.float(), k.float(), case_config(32, 64, "per_head")).key_permutation
        expected = reference_block_means(perm.apply(k), 32)
        actual = block_means(k, 32, perm.indices)
    else:
        expected = reference_block_means(k, 32)
        actual = block_means(k, 32)
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_a_padded_batch_averages_each_entry_s_own_rows_and_reads_none_past_them():
    # Entry b holds lengths[b] rows (on and off a block, none, all); the rows past it are NaN, so
    # a read of any of them would poison its block. Each entry equals the kernel on its rows alone.
    lengths = torch.tensor([20, 0, 64, 33])
    x = torch.randn(4, 2, 64, 16)
    for b, n in enumerate(lengths.tolist()):
        x[b, :, n:] = float("nan")
    means = block_means(x, 16, lengths=lengths)
    assert means.shape == (4, 2, 4, 16) and not means.isnan().any()
    for b, n in enumerate(lengths.tolist()):
        blocks = -(-n // 16)
        if n:
            torch.testing.assert_close(means[b, :, :blocks], block_means(x[b:b + 1, :, :n], 16)[0], rtol=0, atol=0)
        assert (means[b, :, blocks:] == 0).all()
