"""``head_choice`` keeps the pooled blocks alone only in heads where they hold the last queries'
exact attention, and adds the lines elsewhere."""

from __future__ import annotations

import pytest
import torch

import pbs
from pbs.backends import planner_for
from pbs.components import SelectionInputs
from pbs.reference.block_sets import forced_blocks
from pbs.selectors.head_choice import last_row_query_block, last_rows_block_mass, pooled_coverage
from tests.helpers import small_config


def _inputs(seed=1):
    q, k, _ = pbs.testing.make_qkv(batch=2, heads_q=4, heads_kv=2, seq_len=400, head_dim=16, seed=seed)
    return _inputs_of(q, k)


def _inputs_of(q, k):
    from pbs.planning import build_plan

    config = small_config(permuter="none")
    plan, q_perm, _, _ = build_plan(q, k, config, 0.25)
    return SelectionInputs(q=q_perm, k=plan.key_permutation.apply(k), source_k=k, layout=plan.layout,
                           query_positions=plan.query_positions(), key_positions=plan.key_positions(), scale=0.25)


def _select(inputs, **fields):
    return pbs.PBSConfig(permuter="none", selector={"name": "head_choice", **fields}).selector.select(inputs)


def test_coverage_is_the_last_rows_exact_mass_in_the_kept_blocks_of_their_query_block():
    inputs = _inputs()
    layout = inputs.layout
    mass = last_rows_block_mass(inputs, 64)
    assert torch.allclose(mass.sum(-1), torch.ones(2, 4))
    last = last_row_query_block(inputs)
    assert torch.equal(last, torch.full((2, 4), layout.num_query_blocks - 1))
    everything = torch.ones(2, 4, layout.num_query_blocks, layout.num_key_blocks, dtype=torch.bool)
    assert torch.allclose(pooled_coverage(mass, everything, last), torch.ones(2, 4))
    only_block_0 = torch.zeros_like(everything)
    only_block_0[..., 0] = True
    assert torch.allclose(pooled_coverage(mass, only_block_0, last), mass[..., 0])
    # Only the last row's query block counts.
    earlier = everything & (torch.arange(layout.num_query_blocks) < layout.num_query_blocks - 1)[:, None]
    assert torch.equal(pooled_coverage(mass, earlier, last), torch.zeros(2, 4))


@pytest.mark.parametrize("permuter", ["last_block", "key_aware_query"])
def test_under_a_permutation_the_mass_follows_the_keys_and_the_last_row_its_block(permuter):
    from pbs.planning import build_plan

    q, k, _ = pbs.testing.make_qkv(batch=1, heads_q=4, heads_kv=2, seq_len=400, head_dim=16, seed=2)
    config = small_config(permuter=permuter, gqa="per_head")
    plan, q_perm, _, _ = build_plan(q, k, config, 0.25)
    permuted = SelectionInputs(q=q_perm, k=None, source_k=k, key_permutation=plan.key_permutation, layout=plan.layout,
                               query_positions=plan.query_positions(), key_positions=plan.key_positions(), scale=0.25)
    plain = _inputs_of(q, k)
    # The same keys' mass, regrouped: summed per key, the permuted and plain masses agree.
    slot_mass = last_rows_block_mass(permuted, 64)
    assert torch.allclose(slot_mass.sum(-1), last_rows_block_mass(plain, 64).sum(-1))
    # Brute force for one head: a block's mass is its keys' mass, wherever the keys came from.
    from pbs.selectors.vertical_slash import last_rows_attention

    probs, _ = last_rows_attention(plain, 64, slice(0, 4), k.flip(2))
    per_key = probs.mean(-2).flip(-1)[0, 3]
    all_key_pos = plan.key_positions()  # per query head (per_head GQA) or per key head
    key_pos = all_key_pos[0, 3 if all_key_pos.shape[1] == 4 else 1]
    want = torch.zeros(plan.layout.num_key_blocks)
    for slot, position in enumerate(key_pos.tolist()):
        want[slot // 32] += per_key[position]
    assert torch.allclose(slot_mass[0, 3], want, atol=1e-6)
    if permuter == "last_block":  # it moves keys (key_aware_query moves queries only)
        assert not torch.allclose(slot_mass, last_rows_block_mass(plain, 64))
    # The last row sits in the query block that holds slot position 399.
    want = (plan.query_positions() == 399).int().argmax(-1) // 32
    assert torch.equal(last_row_query_block(permuted), want)


def test_the_choice_runs_from_the_union_to_the_pooled_selector_alone():
    inputs = _inputs()
    pooled = pbs.PBSConfig(selector={"name": "mean_pool", "threshold": 0.9}).selector.select(inputs)
    lines = pbs.PBSConfig(selector={"name": "vertical_slash", "threshold": 0.75}).selector.select(inputs)
    assert torch.equal(_select(inputs, min_coverage=1.01), pooled | lines)
    assert torch.equal(_select(inputs, min_coverage=1e-6), pooled)
    # In between, each head is one or the other, chosen by its own coverage.
    coverage = pooled_coverage(last_rows_block_mass(inputs, 64),
                               pooled | forced_blocks(inputs.layout, inputs.key_positions, True),
                               last_row_query_block(inputs))
    cut = coverage.flatten().sort().values[coverage.numel() // 2].item()
    got = _select(inputs, min_coverage=cut)
    for b in range(2):
        for h in range(4):
            want = pooled[b, h] if coverage[b, h] >= cut else (pooled | lines)[b, h]
            assert torch.equal(got[b, h], want)
    assert not torch.equal(got, pooled) and not torch.equal(got, pooled | lines)


def test_head_choice_round_trips_and_checks_its_fields():
    config = pbs.PBSConfig(permuter="none", selector={"name": "head_choice", "min_coverage": 0.9,
                                                      "pooled": {"name": "antidiagonal", "threshold": 0.8}})
    assert pbs.PBSConfig.model_validate_json(config.model_dump_json()) == config
    assert config.selector.pooled.name == "antidiagonal"
    with pytest.raises(ValueError, match="min_coverage"):
        pbs.PBSConfig(permuter="none", selector={"name": "head_choice", "min_coverage": 0.0})
    with pytest.raises(ValueError, match="lines"):
        pbs.PBSConfig(permuter="none", selector={"name": "head_choice", "lines": {"name": "mean_pool"}})


def test_the_fast_choice_picks_per_head_between_the_fast_pooled_and_union_selections():
    # The triton planners, in the interpreter on the CPU.
    from pbs.planning import build_plan
    from pbs.reference.block_sets import finalize_selection

    q, k, _ = pbs.testing.make_qkv(batch=2, heads_q=4, heads_kv=2, seq_len=300, head_dim=32, dtype=torch.float32)
    config = pbs.PBSConfig(permuter="none", block_size=32, segment_size=64, backend="reference",
                           selector={"name": "head_choice", "min_coverage": 0.97})
    plan, q_perm, _, _ = build_plan(q, k, config, 32**-0.5)
    inputs = SelectionInputs(q=q_perm, k=None, source_k=k, key_permutation=plan.key_permutation, layout=plan.layout,
                             query_positions=plan.query_positions(), key_positions=plan.key_positions(), scale=32**-0.5)
    choice = config.selector
    fast = planner_for("selector", choice.name, "triton")(choice, inputs)
    assert isinstance(fast, pbs.BlockMask)
    got = fast.to_dense()
    pooled = planner_for("selector", choice.pooled.name, "triton")(choice.pooled, inputs).to_dense()
    lines = planner_for("selector", choice.lines.name, "triton")(choice.lines, inputs).to_dense()
    alone = [[torch.equal(got[b, h], pooled[b, h]) for h in range(4)] for b in range(2)]
    for b in range(2):
        for h in range(4):
            assert alone[b][h] or torch.equal(got[b, h], pooled[b, h] | lines[b, h])
    assert any(map(any, alone)) and not all(map(all, alone))  # both kinds of head occur here
    want = finalize_selection(choice.select(inputs), plan.layout, inputs.key_positions, True).to_dense()
    # mean_pool's kernel and reference may differ on a block at the threshold (fp32 sums).
    assert (got != want).float().mean().item() < 0.01
