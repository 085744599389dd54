"""The fp32 oracle against PyTorch SDPA, and the block-sparse reference against a token-level mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pbs
from pbs.reference import block_attention_mass, block_sparse_attention_reference, dense_attention
from pbs.types import BlockMask
from tests.helpers import random_qkv, small_config


@pytest.mark.parametrize("nq", [200, 77])
@pytest.mark.parametrize("causal", [True, False])
def test_dense_attention_matches_sdpa(nq, causal):
    q, k, v = random_qkv(batch=2, heads_q=6, heads_kv=2, seq_len=200, seq_len_q=nq, dtype=torch.float64)
    k_rep, v_rep = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)
    mask = torch.arange(200)[None, :] <= torch.arange(200 - nq, 200)[:, None] if causal else None
    expected = F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=mask)
    torch.testing.assert_close(dense_attention(q, k, v, causal=causal).double(), expected, rtol=1e-5, atol=1e-6)


def _token_level(q_perm, k_perm, v_perm, dense_blocks, qpos, kpos, block, group):
    """Attention with an explicit (Nq, Nk) mask built token by token."""
    b, hq, nq, d = q_perm.shape
    nk = k_perm.shape[2]
    out = torch.zeros(b, hq, nq, v_perm.shape[-1])
    for bi in range(b):
        for h in range(hq):
            kh = h // group
            token_mask = dense_blocks[bi, h].repeat_interleave(block, 0)[:nq].repeat_interleave(block, 1)[:, :nk]
            token_mask = token_mask & (kpos[bi, kh][None, :] <= qpos[bi, h][:, None])
            logits = (q_perm[bi, h] @ k_perm[bi, kh].T) * d**-0.5
            probs = logits.masked_fill(~token_mask, float("-inf")).softmax(-1).nan_to_num(0.0)
            out[bi, h] = probs @ v_perm[bi, kh]
    return out


@pytest.mark.parametrize("permuter", ["random", "key_aware_query"])
@pytest.mark.parametrize("density", [0.05, 0.4])
def test_block_sparse_reference_matches_token_level_mask(permuter, density):
    q, k, v = random_qkv(batch=2, heads_q=4, heads_kv=2, seq_len=300, seq_len_q=250)
    config = small_config(permuter=permuter, selector={"name": "budget", "density": density}, gqa="shared")
    plan = pbs.plan(q, k, config)
    q_perm, k_perm, v_perm = (plan.query_permutation.apply(q), plan.key_permutation.apply(k), plan.key_permutation.apply(v))
    out = block_sparse_attention_reference(q_perm, k_perm, v_perm, plan.mask, plan.query_positions(), plan.key_positions())
    expected = _token_level(q_perm, k_perm, v_perm, plan.mask.to_dense(), plan.query_positions(), plan.key_positions(), 32, 2)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_empty_rows_give_zero_not_nan():
    q, k, v = random_qkv(batch=1, heads_q=2, heads_kv=2, seq_len=64)
    layout = pbs.plan(q, k, small_config()).layout
    empty = BlockMask.from_dense(torch.zeros(1, 2, 2, 2, dtype=torch.bool), layout)
    pos = torch.arange(64).expand(1, 2, 64)
    out = block_sparse_attention_reference(q, k, v, empty, pos, pos)
    assert torch.equal(out, torch.zeros_like(out))


def test_block_mass_rows_sum_to_one():
    q, k, _ = random_qkv(batch=1, heads_q=2, heads_kv=1, seq_len=300, seq_len_q=130)
    plan = pbs.plan(q, k, small_config(permuter="random"))
    mass = block_attention_mass(plan.query_permutation.apply(q), plan.key_permutation.apply(k), plan.query_positions(), plan.key_positions(), plan.layout)
    torch.testing.assert_close(mass.sum(-1), torch.ones(1, 2, plan.layout.num_query_blocks))
    assert not (mass * ~plan.layout.allowed_blocks()).any()


def _explicit_attention(q, k, v, causal):
    """Masked softmax in float64, one (batch, head) at a time: query i sits at position Nk - Nq + i."""
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    out = torch.zeros(b, hq, nq, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for h in range(hq):
            kh = h // (hq // hkv)
            logits = (q[bi, h].double() @ k[bi, kh].double().T) * d**-0.5
            if causal:
                future = torch.arange(nk)[None, :] > torch.arange(nk - nq, nk)[:, None]
                logits = logits.masked_fill(future, float("-inf"))
            out[bi, h] = logits.softmax(-1) @ v[bi, kh].double()
    return out


@pytest.mark.parametrize("heads_q, heads_kv", [(6, 2), (4, 4), (3, 1)])
@pytest.mark.parametrize("nq", [96, 37])
@pytest.mark.parametrize("causal", [True, False])
def test_dense_attention_matches_an_explicit_masked_softmax(heads_q, heads_kv, nq, causal):
    q, k, v = random_qkv(batch=2, heads_q=heads_q, heads_kv=heads_kv, seq_len=96, seq_len_q=nq)
    out = dense_attention(q, k, v, causal=causal)
    assert out.dtype == torch.float32 and out.shape == (2, heads_q, nq, 16)
    torch.testing.assert_close(out.double(), _explicit_attention(q, k, v, causal), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_dense_attention_refuses_more_queries_than_keys(causal):
    # It gave NaN rows (43% of them in one case) for queries before the first key.
    q, k, v = random_qkv(batch=1, heads_q=2, heads_kv=2, seq_len=64, seq_len_q=100)
    with pytest.raises(ValueError, match=r"Nq = 100.*Nk = 64.*queries are the last Nq of the Nk positions, so Nq must be <= Nk"):
        dense_attention(q, k, v, causal=causal)


def test_dense_attention_refuses_heads_that_do_not_group():
    # It failed in a reshape.
    q, k, v = random_qkv(batch=1, heads_q=3, heads_kv=2, seq_len=64)
    with pytest.raises(ValueError, match=r"query heads \(q.shape\[1\] = 3\) must be a multiple of .* \(k.shape\[1\] = 2\)"):
        dense_attention(q, k, v)


@pytest.mark.parametrize("mutate, error, message", [
    (lambda q, k, v: (q[0], k, v), ValueError, r"q must have 4 dimensions \(B, Hq, Nq, D\)"),
    (lambda q, k, v: (q, k, v[..., :32, :]), ValueError, r"k and v must agree in \(B, Hkv, Nk\)"),
    (lambda q, k, v: (q, k[..., :8], v), ValueError, r"head dim D, got q: 16, k: 8"),
    (lambda q, k, v: (q.numpy(), k, v), TypeError, r"q must be a torch.Tensor"),
], ids=["rank_3_q", "k_v_lengths", "head_dims", "not_a_tensor"])
def test_dense_attention_names_other_bad_shapes(mutate, error, message):
    with pytest.raises(error, match=message):
        dense_attention(*mutate(*random_qkv(batch=1, heads_q=2, heads_kv=1, seq_len=64)))


def test_reference_helpers_stay_float32_under_a_float64_default_dtype():
    from pbs.reference.block_means import block_means
    from pbs.reference.density_probe import probe_density

    q, k, _ = random_qkv(batch=1, heads_q=2, heads_kv=1, seq_len=300, seq_len_q=130)
    plan = pbs.plan(q, k, small_config(permuter="random"))
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        mass = block_attention_mass(q, plan.key_permutation.apply(k), plan.query_positions(), plan.key_positions(), plan.layout)
        coverage = pbs.reference.attention_coverage(mass, plan.mask.to_dense(), plan.layout)
        means = block_means(k, 32)
        probe = probe_density(q, k, block_size=32, num_blocks=4, threshold=1.0, scale=0.25)
    finally:
        torch.set_default_dtype(before)
    assert [x.dtype for x in (mass, coverage, means, probe)] == [torch.float32] * 4
