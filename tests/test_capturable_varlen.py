"""`pbs.varlen_attention(..., capturable=True)`: the path without host reads (issue 28, point 6).

On the CPU: every sequence's mask equals `pbs.plan` of that sequence alone, the dense policy decides
per sequence as `pbs.dense.DensePolicy` does, the output and LSE equal the eager varlen call, and
paged equals packed. On the GPU: a CUDA graph captured at fixed maxima replays with new lengths
and matches the eager call.
"""

from __future__ import annotations

import pytest
import torch

import pbs
from pbs.backends.padding import pad_packed
from pbs.dense import DensePolicy
from pbs.ragged_layout import ragged_geometry
from pbs.serving.capturable import plan_ragged
from tests.test_paged import paged_cache
from tests.test_serving import ALL_BLOCKS, make_sequences, pack

SMALL = {"block_size": 16, "segment_size": 16}  # many blocks at small lengths
CONFIGS = {
    "defaults": {},
    "mean_pooling": {"permuter": "none", "selector": "mean_pool"},
    "vertical_slash": {"permuter": "none", "selector": {"name": "vertical_slash", "threshold": 0.6, "last_rows": 20}},
    "xattention": {"permuter": "none", "selector": {"name": "antidiagonal", "threshold": 0.8}},
}
# Prefills, chunks after a prefix (len_q < len_k), lengths on and off the block, one query, and an
# empty sequence.
LENGTHS = [(96, 96), (32, 160), (1, 300), (0, 0), (129, 129), (127, 400), (128, 128), (16, 17)]


def padded_plan(sequences, config, packed_queries: bool = False):
    """`plan_ragged` of the packed ``sequences``: queries padded, or with ``packed_queries`` read
    packed (as the capturable path hands them when the backend declares ``ragged_rows``)."""
    q, k, v, cu_seq_q, cu_seq_k, max_q, max_k = pack(sequences)
    config = pbs.PBSConfig.coerce(config)
    len_q, len_k = ((cu[1:] - cu[:-1]).long() for cu in (cu_seq_q, cu_seq_k))
    geometry = ragged_geometry(len_q, len_k, max_q, max_k, config.block_size)
    k_pad = pad_packed(k, cu_seq_k, geometry.padded_len_k)
    if packed_queries:
        return plan_ragged(config, geometry, q, k_pad, q.shape[-1] ** -0.5, cu_seq_q)
    q_pad = pad_packed(q, cu_seq_q, geometry.padded_len_q)
    return plan_ragged(config, geometry, q_pad, k_pad, q.shape[-1] ** -0.5)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("group", [1, 4])
def test_each_sequence_gets_the_mask_it_gets_alone(name, group):
    config = {**CONFIGS[name], **SMALL, "backend": "reference"}
    sequences = make_sequences(LENGTHS, heads_q=2 * group, heads_kv=2)
    mask, dense = padded_plan(sequences, config)
    assert dense is None  # the policy applies on CUDA only by default
    selected, full = mask.to_dense(), mask.full_counts
    for i, (q, k, _) in enumerate(sequences):
        tq, tk = -(-q.shape[2] // 16), -(-k.shape[2] // 16)
        assert not selected[i, :, tq:].any() and not selected[i, :, :, tk:].any()
        assert (mask.counts[i, :, tq:] == 0).all()
        if q.shape[2] == 0:
            continue
        alone = pbs.plan(q, k, config).mask
        assert torch.equal(selected[i, :, :tq, :tk], alone.to_dense()[0]), f"sequence {i} {tuple(q.shape)}"
        assert torch.equal(full[i, :, :tq], alone.full_counts[0]), f"sequence {i}: full_counts"


@pytest.mark.parametrize("kind, name", [("selector", n) for n in pbs.list_selectors()]
                         + [("permuter", n) for n in pbs.list_permuters()])
def test_every_registered_component_is_planned_as_alone_or_refused_with_its_reason(kind, name):
    """The registry drives this: a component with a ``ragged`` planner gets each sequence's mask
    of `pbs.plan` alone; one without gets the refusal `ragged_reasons` derives (issue 36)."""
    from pbs.backends.ragged_planners import ragged_reasons

    config = pbs.PBSConfig(**SMALL, backend="reference", **({"permuter": "none", "selector": name}
                                                              if kind == "selector" else {"permuter": name}))
    sequences = make_sequences([(40, 40), (17, 90), (0, 0)], heads_q=4, heads_kv=2)
    reasons = ragged_reasons(config)
    if reasons:
        assert any(f"config.{kind} {name!r} has no planner for padded batches" in r for r in reasons), reasons
        with pytest.raises(ValueError, match=f"config.{kind} {name!r} has no planner for padded batches"):
            pbs.varlen_attention(*pack(sequences), config, capturable=True)
        return
    mask, _ = padded_plan(sequences, config)
    for i, (q, k, _) in enumerate(sequences):
        if q.shape[2]:
            tq, tk = -(-q.shape[2] // 16), -(-k.shape[2] // 16)
            assert torch.equal(mask.to_dense()[i, :, :tq, :tk], pbs.plan(q, k, config).mask.to_dense()[0])


def test_the_gpu_planners_read_each_sequence_s_lengths_from_the_device(monkeypatch):
    # CUDA runs the eager path's line-score and threshold kernels over the padded batch with the
    # lengths on the device; here they run in the interpreter against the PyTorch operations the
    # CPU uses (the defaults: lines and mean pooling).
    import pbs.backends.ragged_planners as planners
    import pbs.kernels.vertical_slash as vertical_slash
    from pbs.kernels.vertical_slash import line_scores

    config = {**CONFIGS["defaults"], **SMALL, "backend": "reference"}
    sequences = make_sequences([(40, 40), (1, 90), (0, 0), (70, 200), (16, 17)], heads_q=4, heads_kv=2)
    q, k, v, cu_seq_q, cu_seq_k, max_q, max_k = pack(sequences)
    len_q, len_k = ((cu[1:] - cu[:-1]).long() for cu in (cu_seq_q, cu_seq_k))
    geometry = ragged_geometry(len_q, len_k, max_q, max_k, 16)
    q_pad, k_pad = pad_packed(q, cu_seq_q, geometry.padded_len_q), pad_packed(k, cu_seq_k, geometry.padded_len_k)
    selector = pbs.PBSConfig.coerce(config).selector.selectors[0]  # the lines
    lengths = torch.stack((len_q, len_k), 1).to(torch.int32)
    kernel = line_scores(q_pad, k_pad, geometry.layout(4, 2), 0.25, selector.last_rows, lengths=lengths)
    torch_ops = planners.line_scores_torch(selector, geometry, q_pad, k_pad, 0.25, slice(0, 4))
    torch.testing.assert_close(kernel, torch_ops, rtol=0, atol=1e-6)
    assert kernel[:, 2].abs().sum() == 0  # the empty sequence
    # The packed queries read in place (the Gluon kernel's ragged_rows path) score alike, and pool alike.
    packed = line_scores(q, k_pad, geometry.layout(4, 2), 0.25, selector.last_rows, lengths=lengths,
                         q_row_starts=cu_seq_q)
    assert torch.equal(packed, kernel)
    monkeypatch.setattr(vertical_slash, "LINES_HEADS_PER_PROGRAM", 2)  # both query heads of a KV head, one read
    stacked = line_scores(q, k_pad, geometry.layout(4, 2), 0.25, selector.last_rows, lengths=lengths,
                          q_row_starts=cu_seq_q)
    torch.testing.assert_close(stacked, kernel, rtol=0, atol=1e-6)
    monkeypatch.undo()
    from pbs.kernels.block_means import block_means

    pooled = block_means(q_pad, 16, lengths=len_q)
    assert pooled.abs().sum() > 0
    assert torch.equal(block_means(q, 16, lengths=len_q, row_starts=cu_seq_q, padded_rows=geometry.padded_len_q),
                       pooled)
    without = padded_plan(sequences, config)[0].to_dense()
    monkeypatch.setattr(planners, "uses_gpu_planners", lambda device: True)
    assert torch.equal(padded_plan(sequences, config)[0].to_dense(), without)


# A sequence the length rule leaves without planned queries made the line kernel divide 0 by 0
# (its lines NaN, unused but stored): under the interpreter that is numpy's warning, made an error here.
@pytest.mark.filterwarnings("error:invalid value encountered in divide:RuntimeWarning")
@pytest.mark.parametrize("packed_queries", [False, True], ids=["padded-q", "packed-q"])
@pytest.mark.parametrize("name, policy", [("defaults", "none"), ("defaults", "length"), ("mean_pooling", "length"),
                                          ("vertical_slash", "length")])
def test_the_gpu_planners_write_each_sequence_s_lists_as_the_cpu_path_masks_it(monkeypatch, name, policy,
                                                                               packed_queries):
    """On CUDA the planners write the lists (forced blocks, the union's merge, the dense rows and the
    full/masked split included) with no bool mask in between; here they run in the interpreter and
    give the CPU path's mask and split. With the length rule on, the sequences it sends to dense
    are not planned (the planners get them as not ``planned``) and still get every allowed block."""
    import pbs.backends.ragged_planners as planners
    import pbs.serving.capturable as capturable

    fallback = ({"min_seq_len": 100, "max_density": 1.0, "max_planned_density": 1.0, "planning_cost_pairs": 0,
                 "devices": ["cpu"]}
                if policy == "length" else {"devices": []})
    config = {**CONFIGS[name], **SMALL, "dense_fallback": fallback}  # "auto": a named backend skips the policy
    sequences = make_sequences([(40, 40), (1, 90), (0, 0), (70, 200), (16, 17), (129, 129)], heads_q=4, heads_kv=2)
    cpu_mask, cpu_dense = padded_plan(sequences, config)
    seen = []
    member_mask = capturable.member_mask
    monkeypatch.setattr(capturable, "member_mask", lambda s, inputs: seen.append(inputs.planned) or member_mask(s, inputs))
    monkeypatch.setattr(planners, "uses_gpu_planners", lambda device: True)
    mask, dense = padded_plan(sequences, config, packed_queries)
    assert torch.equal(mask.to_dense(), cpu_mask.to_dense())
    assert torch.equal(mask.counts, cpu_mask.counts)
    assert torch.equal(mask.full_counts, cpu_mask.full_counts)
    if policy == "length":
        assert dense.tolist() == cpu_dense.tolist() == [True, True, True, False, True, False]
        assert seen[0].tolist() == [False, False, False, True, False, True]
    else:
        assert dense is None and seen == [None]


def test_a_row_limit_leaves_the_rows_past_it_empty_without_ranking_them():
    from pbs.kernels.threshold_select import empty_block_mask_tensors, threshold_select_rows

    layout = pbs.Layout(2, 2, 2, 64, 64, 16, 16, segmented=False)
    scores = torch.randn(2, 2, 4, 4)
    allowed = torch.ones(4, 4, dtype=torch.bool).tril()
    diagonal = torch.eye(4, dtype=torch.bool)
    results = []
    for limits in (None, torch.tensor([4, 1], dtype=torch.int32)):
        counts, indices = empty_block_mask_tensors(layout, scores.device)
        threshold_select_rows(scores, layout, 0.9, counts, indices, head_offset=0, key_inverse=None, from_logits=True,
                              candidates=allowed, diagonal=diagonal, row_limits=limits)
        results.append((counts, indices))
    (full_counts, full_indices), (counts, indices) = results
    assert torch.equal(counts[0], full_counts[0]) and torch.equal(indices[0], full_indices[0])
    assert torch.equal(counts[1, :, :1], full_counts[1, :, :1]) and torch.equal(indices[1, :, :1], full_indices[1, :, :1])
    assert (counts[1, :, 1:] == 0).all() and (indices[1, :, 1:] == -1).all() and (full_counts[1, :, 1:] > 0).all()


def test_rows_sorted_at_their_own_width_class_give_the_full_width_lists():
    # A padded batch whose entries' own key blocks (0, 10, 20, 40, 100 of Tk 100) fall in every
    # width class from 128 down to 16: the lists equal those of rows sorted at Tk's width, and
    # each row's list is written up to Tk (-1 past its count) by the one launch that takes it.
    from pbs.kernels.threshold_select import empty_block_mask_tensors, threshold_select_rows

    own = torch.tensor([0, 10, 20, 40, 100], dtype=torch.int32)
    tq, tk = 2, 100
    layout = pbs.Layout(5, 1, 1, tq * 16, tk * 16, 16, 16, segmented=False)
    rows = torch.arange(tq)[None, :, None] + own[:, None, None] - tq  # each entry's last tq query blocks
    cols = torch.arange(tk)[None, None, :]
    allowed = (cols <= rows) & (cols < own[:, None, None]) & (rows >= 0)
    diagonal = allowed & (cols == rows)
    scores = torch.randn(5, 1, tq, tk)
    results = []
    for limits in (None, own):
        counts, indices = empty_block_mask_tensors(layout, scores.device)
        indices.fill_(7)  # poisoned: every entry must be written
        threshold_select_rows(scores, layout, 0.9, counts, indices, head_offset=0, key_inverse=None,
                              from_logits=True, candidates=allowed, diagonal=diagonal, key_limits=limits)
        results.append((counts, indices))
    (full_counts, full_indices), (counts, indices) = results
    assert torch.equal(counts, full_counts) and torch.equal(indices, full_indices)
    assert (counts[0] == 0).all() and (indices[0] == -1).all() and (counts[1:] > 0).all()


def test_the_lengths_are_sequence_lengths_not_the_maxima():
    # The same sequence planned with larger maxima (more padding) gets the same mask.
    sequences = make_sequences([(129, 129), (40, 200)])
    config = {**SMALL, "backend": "reference"}
    mask, _ = padded_plan(sequences, config)
    q, k, v, cu_seq_q, cu_seq_k, _, _ = pack(sequences)
    len_q, len_k = ((cu[1:] - cu[:-1]).long() for cu in (cu_seq_q, cu_seq_k))
    geometry = ragged_geometry(len_q, len_k, 300, 500, 16)
    wider, _ = plan_ragged(pbs.PBSConfig.coerce(config), geometry, pad_packed(q, cu_seq_q, 304),
                           pad_packed(k, cu_seq_k, 512), 16 ** -0.5)
    tq, tk = mask.counts.shape[-1], mask.layout.num_key_blocks
    assert torch.equal(wider.to_dense()[:, :, :tq, :tk], mask.to_dense())
    assert not wider.to_dense()[:, :, tq:].any() and not wider.to_dense()[:, :, :, tk:].any()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_output_and_lse_equal_the_eager_varlen_call(name):
    config = {**CONFIGS[name], **SMALL, "backend": "reference"}
    q, k, v, cu_seq_q, cu_seq_k, max_q, max_k = pack(make_sequences(LENGTHS, heads_q=8, heads_kv=2))
    eager, eager_lse = pbs.varlen_attention(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, config, return_lse=True)
    out, lse = pbs.varlen_attention(q, k, v, cu_seq_q, cu_seq_k, max_q + 5, max_k + 40, config, return_lse=True,
                                    capturable=True)
    torch.testing.assert_close(out, eager, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse, eager_lse, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_the_triton_kernel_gives_the_reference_result(dtype):
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on the CPU (tests/conftest.py)
    lengths = [(70, 70), (1, 90), (0, 0), (65, 200)]
    q, k, v, cu_seq_q, cu_seq_k, max_q, max_k = pack(make_sequences(lengths, dtype=dtype, device=device))
    config = {"block_size": 64, "segment_size": 64}
    expected, expected_lse = pbs.varlen_attention(q.float().cpu(), k.float().cpu(), v.float().cpu(), cu_seq_q.cpu(),
                                                  cu_seq_k.cpu(), max_q, max_k, {**config, "backend": "reference"},
                                                  return_lse=True, capturable=True)
    out, lse = pbs.varlen_attention(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, {**config, "backend": "triton"},
                                    return_lse=True, capturable=True)
    tolerance = 2e-3 if dtype == torch.float16 else 2e-5
    torch.testing.assert_close(out.float().cpu(), expected, rtol=0, atol=tolerance)
    torch.testing.assert_close(lse.cpu(), expected_lse, rtol=0, atol=tolerance)


POLICIES = {
    "length": {"min_seq_len": 150},
    # Above the padded key length: every sequence is dense, decided from the shapes without planning.
    "length, every sequence": {"min_seq_len": 1000},
    # The sequences of at most 10000 query-key pairs (96 x 96, 32 x 160 and 5 x 40) are dense from
    # their shapes; the probe is off, so that the others (200 x 200 and 129 x 300) are planned.
    "planning cost": {"min_seq_len": 0, "max_density": 1.0, "max_planned_density": 1.0, "planning_cost_pairs": 10000,
                      "probe_blocks": 0},
    "probe": {"min_seq_len": 0, "max_density": 0.9, "planning_cost_pairs": 0},
    # max_density 1.0 sends nothing to dense: the probe's limit lowered per sequence,
    # 1 - 150 / (Nq x Nk), does (0.25 for 5 x 40, 0.97 and more for the others).
    "probe at 1 - planning_cost_pairs / (Nq x Nk)": {"min_seq_len": 0, "max_density": 1.0,
                                                      "max_planned_density": 1.0, "planning_cost_pairs": 150},
    "planned density": {"min_seq_len": 0, "max_density": 1.0, "max_planned_density": 0.95, "planning_cost_pairs": 0},
    "none": {"min_seq_len": 0, "max_density": 1.0, "max_planned_density": 1.0, "planning_cost_pairs": 0},
}


def mixed_sequences():
    """Random sequences (flat attention: dense by the probe and the plan) between structured ones
    (`pbs.testing.make_qkv`: their probe estimates 0.86-0.87 and plans 0.91 at block 16)."""
    random = make_sequences([(96, 96), (200, 200), (5, 40)], heads_q=4, heads_kv=2, seed=3)
    structured = [pbs.testing.make_qkv(1, 4, 2, n, 16, seq_len_q=m, seed=1) for m, n in [(32, 160), (129, 300)]]
    return [random[0], structured[0], random[1], structured[1], random[2]]


@pytest.mark.parametrize("rule", list(POLICIES))
def test_the_dense_policy_decides_each_sequence_as_it_decides_alone(rule):
    config = pbs.PBSConfig.coerce({**SMALL, "dense_fallback": {**POLICIES[rule], "devices": ["cpu"]}})
    sequences = mixed_sequences()
    mask, dense = padded_plan(sequences, config)
    expected, rules = [], []
    for q, k, v in sequences:
        attended = DensePolicy(config).attend(q, k, v, q.shape[-1] ** -0.5)
        expected.append(attended.reason is not None)
        rules.append(attended.rule)
    assert dense.tolist() == expected
    if rule == "planning cost":
        assert rules == ["planning_cost", "planning_cost", None, None, "planning_cost"]
    if rule.startswith("probe at"):
        assert "probe" in rules and "planning_cost" not in rules
    if rule != "none":
        assert any(expected), "the rule must send a sequence to dense attention for the test to mean anything"
    if not rule.startswith("length"):
        assert not all(expected)
    # A dense sequence runs every allowed block; the output matches the eager call, which ran SDPA.
    selected = mask.to_dense()
    for i, (q, k, _) in enumerate(sequences):
        if dense[i]:
            tq, tk = -(-q.shape[2] // 16), -(-k.shape[2] // 16)
            assert selected[i, :, :tq, :tk].sum() == mask.layout.heads_q * pbs.Layout(
                1, 1, 1, q.shape[2], k.shape[2], 16, 16, segmented=False).total_allowed_blocks
    packed = pack(sequences)
    eager = pbs.varlen_attention(*packed, config)
    torch.testing.assert_close(pbs.varlen_attention(*packed, config, capturable=True), eager, rtol=0, atol=1e-5)


def test_nothing_is_planned_when_every_key_length_is_below_min_seq_len(monkeypatch):
    import pbs.serving.capturable

    def no_planning(*args, **kwargs):
        raise AssertionError("planned although every sequence is dense by its length")

    monkeypatch.setattr(pbs.serving.capturable, "member_mask", no_planning)
    config = {**SMALL, "dense_fallback": {"min_seq_len": 1000, "devices": ["cpu"]}}
    packed = pack(mixed_sequences())
    eager = pbs.varlen_attention(*packed, config)  # SDPA per sequence
    torch.testing.assert_close(pbs.varlen_attention(*packed, config, capturable=True), eager, rtol=0, atol=1e-5)
    with pytest.raises(AssertionError, match="planned although"):  # the patch bites where planning runs
        pbs.varlen_attention(*packed, {**config, "dense_fallback": {"min_seq_len": 100, "planning_cost_pairs": 0,
                                                                    "devices": ["cpu"]}},
                             capturable=True)


@pytest.mark.parametrize("page_size", [16, 128])
def test_paged_equals_packed(page_size):
    lengths = [(96, 96), (32, 160), (0, 0), (129, 300)]
    sequences = make_sequences(lengths, heads_q=4, heads_kv=2)
    q, k, v, cu_seq_q, cu_seq_k, max_q, max_k = pack(sequences)
    config = {**SMALL, "backend": "reference"}
    packed = pbs.varlen_attention(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, config, capturable=True)
    k_cache, v_cache, block_table, seqused_k = paged_cache(sequences, page_size)  # NaN outside the sequences
    paged = pbs.varlen_attention(q, k_cache, v_cache, cu_seq_q, None, max_q, max_k, config, capturable=True,
                                 block_table=block_table, seqused_k=seqused_k)
    torch.testing.assert_close(paged, packed, rtol=0, atol=0)


def test_writes_into_out_and_returns_it():
    q, k, v, cu_seq_q, cu_seq_k, max_q, max_k = pack(make_sequences([(20, 20), (0, 0), (7, 30)]))
    out = torch.full((q.shape[0], q.shape[1], v.shape[-1]), float("nan"))
    result = pbs.varlen_attention(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, {**SMALL, "backend": "reference"},
                                  out=out, capturable=True)
    assert result is out and torch.isfinite(out).all()


@pytest.mark.parametrize("config,field", [
    ({"permuter": "last_block"}, "config.permuter 'last_block' has no planner for padded batches"),
    ({"permuter": "none", "selector": "oracle"}, "config.selector 'oracle' has no planner"),
    ({"selector": {"name": "union", "selectors": ["mean_pool", "budget"]}}, "config.selector 'budget' has no planner"),
    ({"backend": "flex"}, "config.backend 'flex' does not declare capturable; backends that do: hopper, triton, reference"),
])
def test_configs_it_cannot_plan_are_clear_errors(config, field):
    q, k, v, cu_seq_q, cu_seq_k, max_q, max_k = pack(make_sequences([(20, 20)]))
    with pytest.raises(ValueError, match=field.replace("(", r"\(")):
        pbs.varlen_attention(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, config, capturable=True)


def test_what_capturable_runs_comes_from_the_registries(monkeypatch):
    """A selector is planned once a ``ragged`` planner is registered for it, and a backend runs
    once it declares ``capturable``: no list of names decides (issue 36)."""
    import dataclasses

    from pbs.backends import registry
    from pbs.backends.ragged_planners import RAGGED

    q, k, v, cu_seq_q, cu_seq_k, max_q, max_k = pack(make_sequences([(20, 20), (9, 40)]))
    config = {**SMALL, "backend": "reference", "selector": "budget"}
    with pytest.raises(ValueError, match="config.selector 'budget' has no planner for padded batches"):
        pbs.varlen_attention(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, config, capturable=True)
    seen = []

    def every_allowed_block(selector, inputs):
        seen.append(selector.name)
        return inputs.geometry.allowed[:, None].expand(-1, inputs.q.shape[1], -1, -1).clone()

    monkeypatch.setitem(registry._PLANNERS, ("selector", "budget", RAGGED), every_allowed_block)
    out = pbs.varlen_attention(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, config, capturable=True)
    full = pbs.varlen_attention(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, {**config, **ALL_BLOCKS})
    assert seen == ["budget"]
    torch.testing.assert_close(out, full, rtol=0, atol=1e-6)
    # The reference backend without its capturable declaration is refused, by name and by auto.
    monkeypatch.setitem(registry._BACKENDS, "reference", dataclasses.replace(registry._BACKENDS["reference"],
                                                                             capturable=False))
    with pytest.raises(ValueError, match="config.backend 'reference' does not declare capturable"):
        pbs.varlen_attention(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, config, capturable=True)
    with pytest.raises(ValueError, match="no backend can run this call.*does not declare capturable"):
        pbs.varlen_attention(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, {**config, "backend": "auto"}, capturable=True)


def test_a_backend_declaring_ragged_rows_writes_the_packed_output_itself(monkeypatch):
    """A backend that declares ``ragged_rows`` gets the caller's packed queries and ``out`` and
    ``cu_seq_q`` (`AttentionCall.row_starts`), and its LSE is returned as it is, with no copy back;
    the result is the eager call's."""
    import dataclasses

    from pbs.backends import registry
    from pbs.serving.capturable import write_packed

    config = {**SMALL, "backend": "reference"}
    q, k, v, cu_seq_q, cu_seq_k, max_q, max_k = pack(make_sequences(LENGTHS, heads_q=8, heads_kv=2))
    eager, eager_lse = pbs.varlen_attention(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, config, return_lse=True)
    reference = registry._BACKENDS["reference"]
    calls = []

    def run_ragged(call):
        calls.append(call)
        q_pad = pad_packed(call.q, call.row_starts, call.plan.mask.layout.seq_len_q)  # it reads them packed
        o_pad, lse_pad = reference.run(dataclasses.replace(call, q=q_pad, out=None, row_starts=None))
        return call.out, write_packed(call.out, o_pad, lse_pad, call.row_starts)

    monkeypatch.setitem(registry._BACKENDS, "reference", dataclasses.replace(reference, run=run_ragged,
                                                                             ragged_rows=True))
    out = torch.full_like(q, float("nan"))
    returned, lse = pbs.varlen_attention(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, config, return_lse=True,
                                         capturable=True, out=out)
    assert len(calls) == 1 and calls[0].out is out and calls[0].q is q and torch.equal(calls[0].row_starts, cu_seq_q)
    assert returned is out
    torch.testing.assert_close(out, eager, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse, eager_lse, rtol=0, atol=1e-5)


def test_outside_a_capture_the_lengths_are_still_checked():
    q, k, v, cu_seq_q, cu_seq_k, max_q, max_k = pack(make_sequences([(20, 20), (5, 30)]))
    with pytest.raises(ValueError, match="max_k must be at least the longest key sequence, 30"):
        pbs.varlen_attention(q, k, v, cu_seq_q, cu_seq_k, max_q, 29, capturable=True)
    with pytest.raises(ValueError, match="cu_seq_q must start at 0"):
        pbs.varlen_attention(q, k, v, cu_seq_q + 1, cu_seq_k, max_q, max_k, capturable=True)


# -- the GPU: capture once, replay with new lengths ---------------------------------------------------------


def structured_batch(lengths, heads_q=8, heads_kv=2, head_dim=128, dtype=torch.bfloat16, seed=0):
    """Packed CUDA inputs of `pbs.testing.make_qkv`'s structured sequences (sinks, heavy hitters,
    slashes: sparse enough that the defaults plan, unlike random inputs): ``q, k, v, cu_seq_q, cu_seq_k``."""
    sequences = []
    for i, (len_q, len_k) in enumerate(lengths):
        if len_k == 0:
            empty = torch.empty(1, heads_q, 0, head_dim, dtype=dtype, device="cuda")
            sequences.append((empty, empty[:, :heads_kv], empty[:, :heads_kv]))
            continue
        sequences.append(pbs.testing.make_qkv(1, heads_q, heads_kv, len_k, head_dim, seq_len_q=len_q, seed=seed + i,
                                              dtype=dtype, device="cuda"))
    return pack(sequences)[:5]


# A serving engine's bucket: the packed totals, N and the maxima are fixed; the lengths vary.
TOTAL_Q, TOTAL_K, MAX_Q, MAX_K = 6144, 9216, 4096, 6144
BATCHES = [
    [(4096, 4096), (2048, 5120), (0, 0)],  # two prefills and an empty slot
    [(1, 3000), (3071, 3071), (3072, 3145)],  # a decode row, a prefill, a chunk after a prefix
    [(2000, 3000), (4096, 4096), (48, 2120)],
]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["defaults", "mean_pooling"])
def test_a_captured_graph_replays_with_new_lengths(name):
    # min_seq_len sends the keys below 3050 to dense attention: a decision that changes between replays.
    config = {**CONFIGS[name], "dense_fallback": {"min_seq_len": 3050}}
    for lengths in BATCHES:
        assert sum(x[0] for x in lengths) == TOTAL_Q and sum(x[1] for x in lengths) == TOTAL_K
    static = list(structured_batch(BATCHES[0]))
    out = torch.empty(TOTAL_Q, 8, 128, dtype=torch.bfloat16, device="cuda")

    def call():
        return pbs.varlen_attention(*static, MAX_Q, MAX_K, config, out=out, return_lse=True, capturable=True)

    call()  # warm-up: compiles, checks the arguments on the host
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # any host read inside raises
        _, lse = call()
    for seed, lengths in enumerate(BATCHES[1:] + BATCHES[:1], start=1):
        fresh = structured_batch(lengths, seed=10 * seed)
        for buffer, value in zip(static, fresh):
            buffer.copy_(value)
        graph.replay()
        expected, expected_lse = pbs.varlen_attention(*fresh, MAX_Q, MAX_K, config, return_lse=True, capturable=True)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        torch.testing.assert_close(lse, expected_lse, rtol=0, atol=0)
        # The eager path (each sequence through pbs.attention: Triton planners, dense by cuDNN):
        # the same attention, up to bf16 rounding and a rare threshold tie.
        eager = pbs.varlen_attention(*fresh, MAX_Q, MAX_K, config)
        close = (out.float() - eager.float()).abs() <= 2e-2
        assert close.float().mean() > 0.999, f"{lengths}: {close.float().mean():.5f} of the outputs agree"


@pytest.mark.gpu
def test_a_captured_graph_at_full_density_equals_dense_attention():
    config = {"selector": {"name": "mean_pool", "threshold": 1.0}, "dense_fallback": {"min_seq_len": 0}}
    static = list(structured_batch([(1000, 3000), (2000, 2000)]))
    out = torch.empty(3000, 8, 128, dtype=torch.bfloat16, device="cuda")

    def call():
        return pbs.varlen_attention(*static, 2048, 3000, config, out=out, capturable=True)

    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    fresh = structured_batch([(2000, 2500), (1000, 2500)], seed=7)
    for buffer, value in zip(static, fresh):
        buffer.copy_(value)
    graph.replay()
    q, k, v, cu_seq_q, cu_seq_k = fresh
    for i in range(2):
        a, b = cu_seq_q[i].item(), cu_seq_q[i + 1].item()
        c, d = cu_seq_k[i].item(), cu_seq_k[i + 1].item()
        qs, ks, vs = (x.transpose(0, 1)[None].float() for x in (q[a:b], k[c:d], v[c:d]))
        visible = torch.ones(b - a, d - c, dtype=torch.bool, device="cuda").tril(d - c - (b - a))
        expected = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=visible, enable_gqa=True)
        torch.testing.assert_close(out[a:b].float(), expected[0].transpose(0, 1), rtol=0, atol=2e-2)


@pytest.mark.gpu
def test_a_captured_graph_reads_a_paged_cache_at_new_lengths():
    # A serving step over a paged cache: the graph reads block_table and seqused_k from the device,
    # so new requests (other pages, other lengths) replay it. 128-row pages, handed out shuffled.
    config = {"dense_fallback": {"min_seq_len": 3050}}
    first = [(4096, 4096), (2048, 5120), (0, 0)]
    second = [(1, 3000), (3071, 3071), (3072, 3145)]

    def paged_batch(lengths, seed):
        q, k, v, cu_seq_q, cu_seq_k = structured_batch(lengths, seed=seed)
        sequences = []
        for i in range(len(lengths)):
            ks, vs = (x[cu_seq_k[i]:cu_seq_k[i + 1]].transpose(0, 1)[None] for x in (k, v))
            sequences.append((None, ks, vs))
        k_cache, v_cache, block_table, seqused_k = paged_cache(sequences, 128, seed=seed, spare_pages=8)
        # The graph's tables keep one shape: as many pages per sequence as MAX_K needs.
        table = torch.full((len(lengths), MAX_K // 128), -1, dtype=torch.int32, device="cuda")
        table[:, : block_table.shape[1]] = block_table[:, : MAX_K // 128]
        return q, k_cache, v_cache, cu_seq_q, table, seqused_k

    static = list(paged_batch(first, seed=0))
    fresh = paged_batch(second, seed=1)
    pages = max(static[1].shape[0], fresh[1].shape[0])
    for i in (1, 2):  # caches of one size for both batches
        static[i] = torch.cat([static[i], static[i].new_zeros(pages - static[i].shape[0], *static[i].shape[1:])])
    out = torch.empty(TOTAL_Q, 8, 128, dtype=torch.bfloat16, device="cuda")

    def call(q, k_cache, v_cache, cu_seq_q, table, seqused_k, out=None):
        return pbs.varlen_attention(q, k_cache, v_cache, cu_seq_q, None, MAX_Q, MAX_K, config, out=out,
                                    block_table=table, seqused_k=seqused_k, capturable=True)

    call(*static, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(*static, out=out)
    for buffer, value in zip(static, fresh):
        buffer.zero_()
        buffer[: value.shape[0]].copy_(value)
    graph.replay()
    torch.testing.assert_close(out, call(*fresh), rtol=0, atol=0)
    q, k_cache, v_cache, cu_seq_q, table, seqused_k = fresh
    eager = pbs.varlen_attention(q, k_cache, v_cache, cu_seq_q, None, MAX_Q, MAX_K, config, block_table=table,
                                 seqused_k=seqused_k)
    assert ((out.float() - eager.float()).abs() <= 2e-2).float().mean() > 0.999


@pytest.mark.gpu
def test_capture_without_capturable_is_a_clear_error():
    static = structured_batch([(100, 100)])
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="pass capturable=True"):
        with torch.cuda.graph(graph):
            pbs.varlen_attention(*static, 100, 100)
