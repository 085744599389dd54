"""The permutation theorems of the paper (Lemma 3.1, 3.2, Theorem 3.3) and Permutation invariants."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pbs
from pbs.permuters._segments import sort_within_segments
from pbs.reference import dense_attention
from pbs.types import Permutation
from tests.helpers import random_qkv, small_config


def _segment_shuffle(batch, heads, n, segment, seed):
    scores = torch.rand(batch, heads, n, generator=torch.Generator().manual_seed(seed))
    return Permutation.from_indices(sort_within_segments(scores, 0, (n // segment) * segment, segment))


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 3),
    heads=st.integers(1, 3),
    n=st.integers(1, 200),
    segment=st.sampled_from([4, 16, 64]),
    seed=st.integers(0, 10_000),
)
def test_permutation_is_segmented_bijection(batch, heads, n, segment, seed):
    perm = _segment_shuffle(batch, heads, n, segment, seed)
    arange = torch.arange(n)
    # A bijection: every index appears once and inverse undoes it.
    assert torch.equal(perm.indices.sort(-1).values, arange.expand(batch, heads, n))
    assert torch.equal(perm.inverse.gather(-1, perm.indices), arange.expand(batch, heads, n))
    # Tokens only move inside their segment; the remainder never moves.
    full = (n // segment) * segment
    assert torch.equal(perm.indices[..., :full] // segment, arange[:full].expand(batch, heads, full) // segment)
    assert torch.equal(perm.indices[..., full:], arange[full:].expand(batch, heads, n - full))
    x = torch.randn(batch, heads, n, 3)
    assert torch.equal(perm.unapply(perm.apply(x)), x)


@pytest.mark.parametrize("seed", range(3))
def test_permuting_keys_and_values_together_leaves_attention_unchanged(seed):
    # Lemma 3.1, non-causal (any permutation of the source sequence).
    q, k, v = random_qkv(batch=2, heads_q=4, heads_kv=2, seq_len=96, seed=seed)
    perm = Permutation.from_indices(torch.stack([torch.randperm(96) for _ in range(4)]).view(2, 2, 96))
    out = dense_attention(q, k, v, causal=False)
    out_perm = dense_attention(q, perm.apply(k), perm.apply(v), causal=False)
    torch.testing.assert_close(out_perm, out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_permuting_queries_permutes_the_output(seed):
    # Lemma 3.2, non-causal.
    q, k, v = random_qkv(batch=2, heads_q=4, heads_kv=2, seq_len=80, seed=seed)
    perm = Permutation.from_indices(torch.stack([torch.randperm(80) for _ in range(8)]).view(2, 4, 80))
    out = dense_attention(q, k, v, causal=False)
    torch.testing.assert_close(dense_attention(perm.apply(q), k, v, causal=False), perm.apply(out), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", pbs.list_permuters())
@pytest.mark.parametrize("gqa", ["per_head", "shared"])
def test_every_permuter_gives_segmented_bijections(name, gqa):
    q, k, _ = random_qkv(batch=2, heads_q=4, heads_kv=2, seq_len=333, seq_len_q=333)
    config = small_config(permuter=name, gqa=gqa, selector="mean_pool")
    plan = pbs.plan(q, k, config)
    layout = plan.layout
    for perm, n, lo, hi, heads in (
        # Keys get one order per query head only in per-head mode, and only when they move at all.
        (plan.key_permutation, 333, 0, layout.permutable_key_len,
         4 if gqa == "per_head" and not plan.key_permutation.is_identity else 2),
        (plan.query_permutation, 333, *layout.permutable_query_range, 4),
    ):
        assert perm.indices.shape == (2, heads, n)
        arange = torch.arange(n)
        assert torch.equal(perm.indices.sort(-1).values, arange.expand(2, heads, n))
        assert torch.equal(perm.inverse.gather(-1, perm.indices), arange.expand(2, heads, n))
        s = layout.segment_size
        assert torch.equal(perm.indices[..., lo:hi] // s, (arange[lo:hi] // s).expand(2, heads, hi - lo))
        outside = torch.cat([arange[:lo], arange[hi:]])
        assert torch.equal(perm.indices[..., outside], outside.expand(2, heads, len(outside)))


def test_query_segments_follow_positions_when_queries_continue_a_prefix():
    # Nq < Nk: queries start at position 40, so only segments wholly inside [40, 300) may move.
    q, k, _ = random_qkv(batch=1, heads_q=2, heads_kv=2, seq_len=300, seq_len_q=260)
    plan = pbs.plan(q, k, small_config(permuter="key_aware_query"))
    lo, hi = plan.layout.permutable_query_range
    assert (lo, hi) == (64 - 40, 256 - 40)
    positions = plan.query_positions()
    assert torch.equal(positions[..., lo:hi] // 64, (torch.arange(lo, hi) + 40).expand(1, 2, hi - lo) // 64)
    assert not torch.equal(plan.query_permutation.indices[..., lo:hi], torch.arange(lo, hi).expand(1, 2, hi - lo))


def test_last_block_matches_equations_3_and_4():
    # s = mean_rows(softmax(Q_last K^T / sqrt(d))), no mask (Eq. 3), then argsort(-s) per segment.
    q, k, _ = random_qkv(batch=1, heads_q=1, heads_kv=1, seq_len=256, head_dim=8, seed=3)
    k[0, 0, 100] = q[0, 0, -32:].mean(0) * 50  # a heavy hitter at position 100 (segment 1)
    plan = pbs.plan(q, k, small_config(permuter="last_block", gqa="per_head"))
    s = (q[0, 0, -32:] @ k[0, 0].T / 8**0.5).softmax(-1).mean(0)
    expected = torch.cat([seg.argsort(descending=True, stable=True) + 64 * g for g, seg in enumerate(s.view(4, 64))])
    assert torch.equal(plan.key_permutation.indices[0, 0], expected)
    assert int(plan.key_permutation.indices[0, 0, 64]) == 100
