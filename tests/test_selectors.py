"""Selector contracts (driven by the registry), monotonicity and forced blocks.

Algorithm 2, Eq. 3 and XAttention are checked against independent transcriptions in
tests/test_paper_algorithms.py.
"""

from __future__ import annotations

import pytest
import torch

import pbs
from pbs.components import SelectionInputs, selector_registry
from pbs.reference.block_sets import forced_blocks
from tests.helpers import random_qkv, small_config


def _selection_inputs(permuter="last_block", seq_len=300, seq_len_q=None, gqa="shared", seed=0):
    q, k, _ = pbs.testing.make_qkv(
        batch=2, heads_q=4, heads_kv=2, seq_len=seq_len, head_dim=32, seq_len_q=seq_len_q, seed=seed
    )
    from pbs.planning import build_plan

    config = small_config(permuter=permuter, gqa=gqa)
    plan, q_perm, _, _ = build_plan(q, k, config, 32**-0.5)
    return plan, SelectionInputs(
        q=q_perm, k=plan.key_permutation.apply(k), layout=plan.layout, query_positions=plan.query_positions(),
        key_positions=plan.key_positions(), scale=32**-0.5,
    )


@pytest.mark.parametrize("name", pbs.list_selectors())
@pytest.mark.parametrize("permuter", ["identity", "last_block", "key_aware_query"])
@pytest.mark.parametrize("seq_len_q", [None, 150])
def test_selector_contract(name, permuter, seq_len_q):
    q, k, _ = pbs.testing.make_qkv(batch=2, heads_q=4, heads_kv=2, seq_len=300, head_dim=32, seq_len_q=seq_len_q)
    config = small_config(permuter=permuter, selector=name)
    plan = pbs.plan(q, k, config)
    layout, mask = plan.layout, plan.mask
    tq, tk = layout.num_query_blocks, layout.num_key_blocks
    assert mask.counts.shape == (2, 4, tq) and mask.indices.shape == (2, 4, tq, tk)
    assert mask.counts.dtype == torch.int32 and mask.indices.dtype == torch.int16
    dense = mask.to_dense()
    # Never a block wholly in the future; always the forced blocks.
    assert not (dense & ~layout.allowed_blocks()).any()
    forced = forced_blocks(layout, plan.key_positions(), force_sink_block=True)
    assert (dense | ~forced).all()
    # Indices sorted ascending and padded with -1.
    valid = torch.arange(tk) < mask.counts[..., None].long()
    idx = mask.indices.long()
    assert (idx[valid] >= 0).all() and (idx[~valid] == -1).all()
    shifted = torch.where(valid, idx, tk + torch.arange(tk))
    assert (shifted[..., 1:] > shifted[..., :-1]).all()
    assert 0 < plan.density <= 1


@pytest.mark.parametrize("name", ["mean_pool", "antidiagonal", "oracle"])
def test_raising_the_threshold_never_removes_a_block(name):
    field = "coverage" if name == "oracle" else "threshold"
    plan_inputs = _selection_inputs()
    _, inputs = plan_inputs
    previous = None
    for tau in [0.3, 0.6, 0.8, 0.9, 0.95, 1.0]:
        selected = selector_registry.get(name)(**{field: tau}).select(inputs)
        if previous is not None:
            assert (selected | ~previous).all(), f"threshold {tau} dropped a block"
        previous = selected
    # At tau = 1 every ranked block is kept: the candidates, or for the oracle (coverage of the
    # true mass) every allowed block.
    ranked = inputs.layout.allowed_blocks() if name == "oracle" else inputs.candidate_blocks()
    assert torch.equal(previous, ranked.expand_as(previous))


def test_budget_selector_hits_its_density():
    q, k, _ = random_qkv(batch=1, heads_q=2, heads_kv=1, seq_len=8192, head_dim=16)
    for density in [0.1, 0.3, 0.5, 1.0]:
        config = small_config(block_size=64, segment_size=128, permuter="identity",
                              selector={"name": "budget", "density": density})
        plan = pbs.plan(q, k, config)
        layout = plan.layout
        forced = forced_blocks(layout, plan.key_positions()).sum(-1)[0, 0]
        expected = torch.maximum(forced, torch.round(density * layout.allowed_counts().double()).long())
        assert torch.equal(plan.mask.counts[0, 0].long(), expected)
        assert plan.density == pytest.approx(density, abs=0.01)


def test_oracle_reaches_its_coverage():
    _, inputs = _selection_inputs(seq_len=512)
    from pbs.reference import attention_coverage, block_attention_mass

    selected = selector_registry.get("oracle")(coverage=0.8).select(inputs)
    mass = block_attention_mass(inputs.q, inputs.k, inputs.query_positions, inputs.key_positions, inputs.layout, inputs.scale)
    assert (attention_coverage(mass, selected, inputs.layout) >= 0.8 - 1e-5).all()


def test_sink_block_follows_the_permuted_position_zero():
    q, k, _ = random_qkv(batch=1, heads_q=2, heads_kv=2, seq_len=256)
    plan = pbs.plan(q, k, small_config(permuter="random", selector={"name": "mean_pool", "threshold": 0.01}))
    sink_slot = plan.key_permutation.inverse[..., 0]  # (B, Hk)
    dense = plan.mask.to_dense()
    for h in range(2):
        assert dense[0, h, :, int(sink_slot[0, h]) // 32].all()
    no_sink = pbs.plan(q, k, small_config(permuter="random", selector={"name": "mean_pool", "threshold": 0.01}, force_sink_block=False))
    assert no_sink.mask.num_selected().sum() <= plan.mask.num_selected().sum()


def test_threshold_outside_range_is_rejected():
    for bad in [0.0, -0.1, 1.5]:
        with pytest.raises(ValueError, match="threshold"):
            pbs.PBSConfig(selector={"name": "mean_pool", "threshold": bad})
