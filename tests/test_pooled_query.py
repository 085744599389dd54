"""The ``pooled_query`` selector: each query block's mean query attends to every key."""

from __future__ import annotations

import torch

import pbs
from pbs.components import SelectionInputs
from pbs.selectors.pooled_query import pooled_query_block_mass
from tests.helpers import random_qkv, small_config


def _inputs(q, k, config):
    plan = pbs.plan(q, k, config)
    q_perm = plan.query_permutation.apply(q)
    return plan, SelectionInputs(
        q_perm, plan.key_permutation.apply(k), plan.layout, plan.query_positions(), plan.key_positions(),
        q.shape[-1] ** -0.5,
    )


def test_mass_is_the_mean_querys_causal_softmax_summed_per_block():
    q, k, _ = random_qkv(batch=1, heads_q=4, heads_kv=2, seq_len=200, seq_len_q=150, head_dim=16, seed=2)
    config = small_config(permuter="none", selector="pooled_query")
    plan, inputs = _inputs(q, k, config)
    mass = pooled_query_block_mass(inputs)
    bs, nq, nk = 32, 150, 200
    for h in range(4):
        for i in range(-(-nq // bs)):
            rows = q[0, h, i * bs : min(nq, (i + 1) * bs)].double()
            last = nk - nq + min(nq, (i + 1) * bs) - 1  # original position of the block's last query
            logits = (k[0, h // 2, : last + 1].double() @ rows.mean(0)) * 16**-0.5
            probs = torch.zeros(nk, dtype=torch.float64)
            probs[: last + 1] = logits.softmax(0)
            expected = torch.nn.functional.pad(probs, (0, 7 * bs - nk)).view(7, bs).sum(-1)
            torch.testing.assert_close(mass[0, h, i].double(), expected, atol=1e-5, rtol=1e-5)


def test_a_block_with_one_strong_key_is_found_where_mean_pool_misses_it():
    # Block 2 is mixed: one key that every query of the last block attends to strongly, and 31
    # keys pointing away from those queries, so its mean points away too. Mean pooling ranks it
    # last; the pooled query, attending to single keys, finds the one that matters.
    gen = torch.Generator().manual_seed(0)
    d, n = 32, 256
    q = torch.randn(1, 1, n, d, generator=gen) * 0.1
    k = torch.randn(1, 1, n, d, generator=gen) * 0.1
    direction = torch.randn(d, generator=gen)
    direction = direction / direction.norm()
    q[0, 0, -32:] += 4 * direction
    k[0, 0, 64:96] -= 0.5 * direction  # block 2 of 8
    k[0, 0, 70] += 6.5 * direction
    v = torch.randn(1, 1, n, d, generator=gen)
    base = {"block_size": 32, "segment_size": 32, "permuter": "none", "dense_fallback": {"min_seq_len": 0}}
    pooled = pbs.plan(q, k, {**base, "selector": {"name": "pooled_query", "threshold": 0.6}})
    mean_pool = pbs.plan(q, k, {**base, "selector": {"name": "mean_pool", "threshold": 0.6}})
    last = -1
    assert bool(pooled.mask.to_dense()[0, 0, last, 2])
    assert not bool(mean_pool.mask.to_dense()[0, 0, last, 2])
    # And the selection is what pbs.attention computes with.
    out = pbs.attention(q, k, v, {**base, "selector": {"name": "pooled_query", "threshold": 0.6}})
    assert out.shape == q.shape
