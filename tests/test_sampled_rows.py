"""``sampled_rows``: the exact block mass of sampled query rows, thresholded as estimated coverage."""

from __future__ import annotations

import pytest
import torch

import pbs
from pbs.components import SelectionInputs
from pbs.planning import build_plan
from pbs.reference.block_sets import forced_blocks
from pbs.reference import block_attention_mass
from pbs.selectors.sampled_rows import sampled_block_mass, sampled_row_slots
from tests.helpers import random_qkv, small_config


def _inputs(permuter, seq_len=300, seq_len_q=None, gqa="per_head"):
    q, k, _ = random_qkv(batch=2, heads_q=4, heads_kv=2, seq_len=seq_len, seq_len_q=seq_len_q, head_dim=16, seed=7)
    config = small_config(permuter=permuter, gqa=gqa, selector="sampled_rows")
    plan, q_perm, _, _ = build_plan(q, k, config, 0.25)
    k_perm = plan.key_permutation.apply(k)
    return plan, SelectionInputs(q_perm, k_perm, plan.layout, plan.query_positions(), plan.key_positions(), 0.25)


def test_row_slots_are_spread_and_end_at_the_last_row():
    slots = sampled_row_slots(3, 32, 80, 4)
    assert slots.tolist() == [[7, 15, 23, 31], [39, 47, 55, 63], [71, 79, 79, 79]]


@pytest.mark.parametrize("permuter, seq_len_q, gqa", [("none", None, "per_head"), ("last_block", None, "shared"), ("last_block", 192, "per_head")])
def test_sampling_every_row_gives_the_true_block_mass(permuter, seq_len_q, gqa):
    # Whole blocks only: a partial last block repeats its last row, so it is not the plain mean.
    plan, inputs = _inputs(permuter, seq_len=320, seq_len_q=seq_len_q, gqa=gqa)
    exact = block_attention_mass(inputs.q, inputs.k, inputs.query_positions, inputs.key_positions, plan.layout, 0.25)
    sampled = sampled_block_mass(inputs, plan.layout.block_size)
    torch.testing.assert_close(sampled, exact, atol=1e-5, rtol=1e-5)


def test_rows_sum_to_one_and_stay_causal():
    plan, inputs = _inputs("last_block", seq_len=300)
    mass = sampled_block_mass(inputs, 4)
    torch.testing.assert_close(mass.sum(-1), torch.ones(mass.shape[:-1]))
    assert (mass[..., ~plan.layout.allowed_blocks()] == 0).all()


def test_threshold_counts_forced_blocks_first_and_reaches_its_estimate():
    plan, inputs = _inputs("last_block", seq_len=300)
    config = pbs.selectors.SampledRowsSelector(rows_per_block=4, threshold=0.8)
    selected = config.select(inputs)
    forced = forced_blocks(plan.layout, inputs.key_positions, True)
    assert (selected | ~forced).all()
    mass = sampled_block_mass(inputs, 4)
    kept = (mass * selected).sum(-1)
    assert (kept >= 0.8 - 1e-5).all()
    # Minimal: dropping the smallest kept non-forced block falls under the threshold.
    droppable = selected & ~forced
    smallest = mass.masked_fill(~droppable, float("inf")).amin(-1)
    has = droppable.any(-1)
    assert ((kept - smallest)[has] < 0.8 + 1e-6).all()


def test_rows_per_block_is_checked_against_the_block_size():
    with pytest.raises(ValueError, match=r"rows_per_block \(64\) must be at most block_size \(32\)"):
        small_config(selector={"name": "sampled_rows", "rows_per_block": 64})


@pytest.mark.parametrize(
    "permuter, gqa, seq_len, seq_len_q, rows",
    [("none", "shared", 300, None, 4), ("last_block", "per_head", 300, None, 8), ("last_block", "shared", 320, 200, 4)],
)
def test_triton_selection_matches_the_reference(permuter, gqa, seq_len, seq_len_q, rows):
    """The GPU implementation (run by the Triton interpreter on CPU) selects the reference's blocks."""
    from pbs.backends.planners import sampled_rows_select
    from pbs.kernels.sampled_rows import sampled_block_shares
    from pbs.reference.block_sets import finalize_selection
    from tests.planning_helpers import assert_same_selection

    q, k, _ = random_qkv(batch=2, heads_q=4, heads_kv=2, seq_len=seq_len, seq_len_q=seq_len_q, head_dim=16, seed=3)
    config = small_config(permuter=permuter, gqa=gqa, selector={"name": "sampled_rows", "rows_per_block": rows, "threshold": 0.85})
    plan, q_perm, _, _ = build_plan(q, k, config.model_copy(update={"backend": "reference"}), 0.25)
    inputs = SelectionInputs(
        q_perm, None, plan.layout, plan.query_positions(), plan.key_positions(), 0.25,
        source_k=k, key_permutation=plan.key_permutation,
    )
    actual = sampled_rows_select(config.selector, inputs)
    reference = finalize_selection(config.selector.select(inputs), plan.layout, plan.key_positions(), True)
    mass = sampled_block_mass(inputs, rows)
    shares = sampled_block_shares(
        q_perm, k, plan.query_positions(), plan.key_positions(), plan.layout, rows, 0.25,
        plan.layout.allowed_blocks(), key_indices=plan.key_positions(),
    )
    torch.testing.assert_close(shares, mass, atol=1e-5, rtol=1e-5)
    forced = forced_blocks(plan.layout, plan.key_positions(), True)
    assert_same_selection(actual, reference, mass, plan.layout.allowed_blocks(), 0.85, ranked_first=forced)
