"""The ``union`` selector keeps exactly the blocks its members keep, and round-trips through JSON."""

from __future__ import annotations

import pytest
import torch

import pbs
from pbs.backends import planner_for
from pbs.components import SelectionInputs
from pbs.types import BlockMask
from tests.helpers import small_config


def _inputs():
    q, k, _ = pbs.testing.make_qkv(batch=1, heads_q=4, heads_kv=2, seq_len=400, head_dim=16)
    from pbs.planning import build_plan

    config = small_config(permuter="none")
    plan, q_perm, _, _ = build_plan(q, k, config, 16**-0.5)
    return SelectionInputs(q=q_perm, k=plan.key_permutation.apply(k), layout=plan.layout,
                           query_positions=plan.query_positions(), key_positions=plan.key_positions(), scale=16**-0.5)


def test_union_is_the_or_of_its_members():
    inputs = _inputs()
    members = [{"name": "vertical_slash", "threshold": 0.3}, {"name": "mean_pool", "threshold": 0.5}]
    union = pbs.PBSConfig(selector={"name": "union", "selectors": members}).selector
    parts = [pbs.PBSConfig(selector=m).selector.select(inputs) for m in members]
    got = union.select(inputs)
    assert torch.equal(got, parts[0] | parts[1])
    # Not a trivial case: the union differs from at least one member.
    assert not (torch.equal(got, parts[0]) and torch.equal(got, parts[1]))


def test_union_accepts_members_that_return_a_block_mask():
    inputs = _inputs()
    union = pbs.PBSConfig(selector={"name": "union", "selectors": ["budget", {"name": "mean_pool", "threshold": 0.5}]})
    budget_alone = pbs.PBSConfig(selector="budget").selector.select(inputs)
    budget_dense = budget_alone.to_dense() if isinstance(budget_alone, pbs.BlockMask) else budget_alone
    assert (union.selector.select(inputs) | ~budget_dense).all()


def test_union_config_round_trips_and_rejects_bad_members():
    config = pbs.PBSConfig(permuter="none", selector={"name": "union", "selectors": ["mean_pool", "vertical_slash"]})
    assert pbs.PBSConfig.model_validate_json(config.model_dump_json()) == config
    with pytest.raises(ValueError, match="at least 2"):
        pbs.PBSConfig(selector={"name": "union", "selectors": ["mean_pool"]})
    with pytest.raises(ValueError, match="list of selector configs"):
        pbs.PBSConfig(selector={"name": "union", "selectors": "mean_pool"})
    with pytest.raises(ValueError, match="nope"):
        pbs.PBSConfig(selector={"name": "union", "selectors": ["mean_pool", "nope"]})


def test_the_fast_union_runs_each_members_fast_implementation_and_matches_the_reference():
    # The members' triton planners, in the interpreter on the CPU.
    from pbs.planning import build_plan
    from pbs.reference.block_sets import finalize_selection

    q, k, _ = pbs.testing.make_qkv(batch=1, heads_q=4, heads_kv=2, seq_len=300, head_dim=32, dtype=torch.float32)
    config = pbs.PBSConfig(permuter="none", block_size=32, segment_size=64, backend="reference", selector={
        "name": "union", "selectors": [{"name": "vertical_slash", "threshold": 0.6}, {"name": "mean_pool", "threshold": 0.8}]})
    plan, q_perm, _, _ = build_plan(q, k, config, 32**-0.5)
    inputs = SelectionInputs(q=q_perm, k=None, source_k=k, key_permutation=plan.key_permutation, layout=plan.layout,
                             query_positions=plan.query_positions(), key_positions=plan.key_positions(), scale=32**-0.5)
    fast = planner_for("selector", config.selector.name, "triton")
    assert fast is not None
    fused = fast(config.selector, inputs)
    # The members are merged inside vertical_slash's compaction: a BlockMask, no dense round trip.
    assert isinstance(fused, BlockMask)
    got = fused.to_dense()
    want = finalize_selection(config.selector.select(inputs), plan.layout, inputs.key_positions, True).to_dense()
    # mean_pool's kernel and reference may differ on a block at the threshold (fp32 sums).
    assert (got != want).float().mean().item() < 0.01
    # Exactly the OR of the members' own fast selections.
    members = [planner_for("selector", m.name, "triton")(m, inputs).to_dense() for m in config.selector.selectors]
    assert torch.equal(got, members[0] | members[1])
    assert torch.equal(fused.counts, got.sum(-1, dtype=torch.int32))


def test_the_fast_union_of_three_members_is_the_or_of_their_fast_selections():
    from pbs.planning import build_plan

    q, k, _ = pbs.testing.make_qkv(batch=1, heads_q=4, heads_kv=2, seq_len=300, head_dim=32, dtype=torch.float32)
    members = [{"name": "mean_pool", "threshold": 0.7}, {"name": "vertical_slash", "threshold": 0.5},
               {"name": "antidiagonal", "threshold": 0.7}]
    config = pbs.PBSConfig(permuter="none", block_size=32, segment_size=64, backend="reference",
                           selector={"name": "union", "selectors": members})
    plan, q_perm, _, _ = build_plan(q, k, config, 32**-0.5)
    inputs = SelectionInputs(q=q_perm, k=None, source_k=k, key_permutation=plan.key_permutation, layout=plan.layout,
                             query_positions=plan.query_positions(), key_positions=plan.key_positions(), scale=32**-0.5)
    got = planner_for("selector", config.selector.name, "triton")(config.selector, inputs).to_dense()
    each = [planner_for("selector", m.name, "triton")(m, inputs).to_dense() for m in config.selector.selectors]
    assert torch.equal(got, each[0] | each[1] | each[2])


def test_the_pooled_lines_preset_is_the_measured_configuration():
    config = pbs.PBSConfig.from_preset("vertical_slash_pooled")
    assert config.permuter.name == "none" and config.selector.name == "union"
    members = [(m.name, m.threshold) for m in config.selector.selectors]
    assert members == [("vertical_slash", 0.75), ("mean_pool", 0.9)]
    assert pbs.PBSConfig.model_validate_json(config.model_dump_json()) == config
