"""``head_choice`` keeps the pooled blocks alone only in heads where they hold the last queries'
exact attention, and adds the lines elsewhere."""

from __future__ import annotations

import pytest
import torch

import pbs
from pbs.components import SelectionInputs
from pbs.reference.block_means import sum_per_key_block
from pbs.reference.block_sets import forced_blocks
from pbs.selectors.head_choice import pooled_coverage
from pbs.selectors.vertical_slash import last_rows_attention
from tests.helpers import small_config


def _inputs(seed=1):
    from pbs.planning import build_plan

    q, k, _ = pbs.testing.make_qkv(batch=2, heads_q=4, heads_kv=2, seq_len=400, head_dim=16, seed=seed)
    config = small_config(permuter="none")
    plan, q_perm, _, _ = build_plan(q, k, config, 0.25)
    return SelectionInputs(q=q_perm, k=plan.key_permutation.apply(k), source_k=k, layout=plan.layout,
                           query_positions=plan.query_positions(), key_positions=plan.key_positions(), scale=0.25)


def _select(inputs, **fields):
    return pbs.PBSConfig(permuter="none", selector={"name": "head_choice", **fields}).selector.select(inputs)


def test_coverage_is_the_last_rows_exact_mass_in_the_kept_blocks_of_their_query_block():
    inputs = _inputs()
    layout = inputs.layout
    probs, _ = last_rows_attention(inputs, 64, slice(0, 4), inputs.source_k.flip(2))
    mass = sum_per_key_block(probs.mean(-2).flip(-1), layout.block_size)
    everything = torch.ones(2, 4, layout.num_query_blocks, layout.num_key_blocks, dtype=torch.bool)
    assert torch.allclose(pooled_coverage(mass, everything), torch.ones(2, 4))
    only_block_0 = torch.zeros_like(everything)
    only_block_0[..., 0] = True
    assert torch.allclose(pooled_coverage(mass, only_block_0), mass[..., 0])
    # Only the last query block's row counts.
    assert torch.equal(pooled_coverage(mass, everything & (torch.arange(layout.num_query_blocks) < 3)[:, None]),
                       torch.zeros(2, 4))


def test_the_choice_runs_from_the_union_to_the_pooled_selector_alone():
    inputs = _inputs()
    pooled = pbs.PBSConfig(selector={"name": "mean_pool", "threshold": 0.9}).selector.select(inputs)
    lines = pbs.PBSConfig(selector={"name": "vertical_slash", "threshold": 0.75}).selector.select(inputs)
    assert torch.equal(_select(inputs, min_coverage=1.01), pooled | lines)
    assert torch.equal(_select(inputs, min_coverage=1e-6), pooled)
    # In between, each head is one or the other, chosen by its own coverage.
    probs, _ = last_rows_attention(inputs, 64, slice(0, 4), inputs.source_k.flip(2))
    mass = sum_per_key_block(probs.mean(-2).flip(-1), inputs.layout.block_size)
    coverage = pooled_coverage(mass, pooled | forced_blocks(inputs.layout, inputs.key_positions, True))
    cut = coverage.flatten().sort().values[coverage.numel() // 2].item()
    got = _select(inputs, min_coverage=cut)
    for b in range(2):
        for h in range(4):
            want = pooled[b, h] if coverage[b, h] >= cut else (pooled | lines)[b, h]
            assert torch.equal(got[b, h], want)
    assert not torch.equal(got, pooled) and not torch.equal(got, pooled | lines)


def test_head_choice_round_trips_and_refuses_what_it_cannot_do():
    config = pbs.PBSConfig(permuter="none", selector={"name": "head_choice", "min_coverage": 0.9,
                                                      "pooled": {"name": "antidiagonal", "threshold": 0.8}})
    assert pbs.PBSConfig.model_validate_json(config.model_dump_json()) == config
    assert config.selector.pooled.name == "antidiagonal"
    with pytest.raises(ValueError, match="min_coverage"):
        pbs.PBSConfig(permuter="none", selector={"name": "head_choice", "min_coverage": 0.0})
    with pytest.raises(ValueError, match="lines"):
        pbs.PBSConfig(permuter="none", selector={"name": "head_choice", "lines": {"name": "mean_pool"}})
    with pytest.raises(ValueError, match="permuter='none'"):
        pbs.PBSConfig(permuter="last_block", selector="head_choice")


def test_the_fast_choice_picks_per_head_between_the_fast_pooled_and_union_selections():
    # pbs.kernels registers the Triton implementations; in the interpreter on the CPU.
    import pbs.kernels  # noqa: F401
    from pbs.components import selector_registry
    from pbs.planning import build_plan, finalize_selection

    q, k, _ = pbs.testing.make_qkv(batch=2, heads_q=4, heads_kv=2, seq_len=300, head_dim=32, dtype=torch.float32)
    config = pbs.PBSConfig(permuter="none", block_size=32, segment_size=64, backend="reference",
                           selector={"name": "head_choice", "min_coverage": 0.97})
    plan, q_perm, _, _ = build_plan(q, k, config, 32**-0.5)
    inputs = SelectionInputs(q=q_perm, k=None, source_k=k, key_permutation=plan.key_permutation, layout=plan.layout,
                             query_positions=plan.query_positions(), key_positions=plan.key_positions(), scale=32**-0.5)
    choice = config.selector
    fast = selector_registry.implementation(choice, "triton")(choice, inputs)
    assert isinstance(fast, pbs.BlockMask)
    got = fast.to_dense()
    pooled = selector_registry.implementation(choice.pooled, "triton")(choice.pooled, inputs).to_dense()
    lines = selector_registry.implementation(choice.lines, "triton")(choice.lines, inputs).to_dense()
    alone = [[torch.equal(got[b, h], pooled[b, h]) for h in range(4)] for b in range(2)]
    for b in range(2):
        for h in range(4):
            assert alone[b][h] or torch.equal(got[b, h], pooled[b, h] | lines[b, h])
    assert any(map(any, alone)) and not all(map(all, alone))  # both kinds of head occur here
    want = finalize_selection(choice.select(inputs), plan.layout, inputs.key_positions, True).to_dense()
    # mean_pool's kernel and reference may differ on a block at the threshold (fp32 sums).
    assert (got != want).float().mean().item() < 0.01
