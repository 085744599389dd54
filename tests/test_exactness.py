"""With every allowed block selected, PBS equals dense causal attention (Theorem 3.3 + segmented causality)."""

from __future__ import annotations

import pytest
import torch

import pbs
from pbs.reference import dense_attention
from pbs.testing import relative_error
from tests.helpers import assert_max_abs_error_within_torch, random_qkv, small_config

ALL_BLOCKS = {"name": "budget", "density": 1.0}


@pytest.mark.parametrize("permuter", pbs.list_permuters())
@pytest.mark.parametrize("gqa", ["per_head", "shared"])
def test_full_selection_equals_dense_causal(permuter, gqa):
    # Default block 128 / segment 256, batch 2, N not a multiple of 128.
    q, k, v = random_qkv(batch=2, heads_q=4, heads_kv=2, seq_len=700, head_dim=16, seed=1)
    config = pbs.PBSConfig(permuter=permuter, selector=ALL_BLOCKS, gqa=gqa, backend="reference")
    out, plan = pbs.attention(q, k, v, config, return_plan=True)
    assert plan.density == pytest.approx(1.0)
    assert relative_error(out, dense_attention(q, k, v)) < 1e-5
    assert_max_abs_error_within_torch(out, q, k, v)  # against dense causal attention in float64


@pytest.mark.parametrize("permuter", pbs.list_permuters())
@pytest.mark.parametrize("nq", [1, 37, 200])
def test_full_selection_equals_dense_for_a_cached_prefix(permuter, nq):
    q, k, v = random_qkv(batch=2, heads_q=4, heads_kv=1, seq_len=300, seq_len_q=nq, seed=nq)
    config = small_config(permuter=permuter, selector=ALL_BLOCKS, backend="reference")
    out = pbs.attention(q, k, v, config)
    assert out.shape == q.shape
    assert relative_error(out, dense_attention(q, k, v)) < 1e-5
    assert_max_abs_error_within_torch(out, q, k, v)


@pytest.mark.parametrize("permuter", ["last_block", "key_aware_query", "random"])
def test_full_selection_equals_dense_non_causal(permuter):
    q, k, v = random_qkv(batch=1, heads_q=2, heads_kv=2, seq_len=200, seed=2)
    config = small_config(permuter=permuter, selector=ALL_BLOCKS, causal=False)
    out = pbs.attention(q, k, v, config)
    assert relative_error(out, dense_attention(q, k, v, causal=False)) < 1e-5
    assert_max_abs_error_within_torch(out, q, k, v, causal=False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_output_keeps_the_input_dtype(dtype):
    q, k, v = random_qkv(batch=1, heads_q=2, heads_kv=1, seq_len=130, dtype=dtype)
    out = pbs.attention(q, k, v, small_config())
    assert out.dtype == dtype and out.shape == q.shape


def test_shared_mode_never_replicates_keys():
    q, k, v = random_qkv(batch=1, heads_q=8, heads_kv=2, seq_len=256)
    plan_shared = pbs.plan(q, k, small_config(permuter="last_block", gqa="shared"))
    plan_per_head = pbs.plan(q, k, small_config(permuter="last_block", gqa="per_head"))
    assert plan_shared.key_permutation.apply(k).shape[1] == 2
    assert plan_per_head.key_permutation.apply(k).shape[1] == 8
    identity = pbs.plan(q, k, small_config(gqa="per_head", permuter="key_aware_query"))
    assert identity.key_permutation.apply(k) is k  # keys not permuted: no copy even per head
    unpermuted = pbs.plan(q, k, small_config(gqa="per_head"))  # the default permuter, none
    assert unpermuted.key_permutation.apply(k) is k


def test_plan_then_run_equals_attention():
    q, k, v = random_qkv(batch=2, heads_q=4, heads_kv=2, seq_len=260)
    config = small_config(permuter="key_aware_query")
    p = pbs.plan(q, k, config)
    torch.testing.assert_close(pbs.run(p, q, k, v), pbs.attention(q, k, v, config))
    with pytest.raises(ValueError, match="plan was made for"):
        pbs.run(p, q[:, :, :100], k, v)


def test_sparse_selection_is_close_but_not_equal_on_structured_input():
    q, k, v = pbs.testing.make_qkv(seq_len=2048, heads_q=4, heads_kv=2, head_dim=32)
    out, plan = pbs.attention(q, k, v, return_plan=True)
    err = relative_error(out, dense_attention(q, k, v))
    assert plan.density < 0.9
    assert 0 < err < 0.6
