"""The ``vertical_slash`` selector: scores, line-to-block mapping and a copy pattern end to end."""

from __future__ import annotations

import math
import pytest
import torch

import pbs
from pbs.backends import planner_for
from pbs.components import SelectionInputs
from pbs.selectors.vertical_slash import (
    blocks_of_lines,
    kept_lines,
    offset_prefix,
    vertical_and_slash_scores,
)
from pbs.reference.threshold_select import cumsum_long_rows, select_by_cumulative_threshold
from tests.helpers import small_config

# Every interpreted launch here has its addresses checked (tests/interpreter_bounds.py).
pytestmark = pytest.mark.usefixtures("checked_addresses")


def test_scores_split_a_fixed_key_from_a_fixed_offset():
    nk, rows = 100, 4
    query_pos = torch.arange(nk - rows, nk)[None, None]  # rows at 96..99
    probs = torch.zeros(1, 1, rows, nk)
    for r, p in enumerate(query_pos[0, 0].tolist()):
        probs[0, 0, r, 0] = 0.5  # every row reads key 0: a vertical line
        probs[0, 0, r, p - 50] = 0.5  # and the key 50 before it: a slash
    vertical, slash = vertical_and_slash_scores(probs, nk - 1)
    assert vertical.sum().item() == pytest.approx(1.0) and slash.sum().item() == pytest.approx(1.0)
    assert vertical[0, 0, 0].item() == pytest.approx(0.5)
    assert torch.allclose(vertical[0, 0, 46:50], torch.full((4,), 0.125))
    assert slash[0, 0, 50].item() == pytest.approx(0.5)
    assert torch.allclose(slash[0, 0, 96:100], torch.full((4,), 0.125))
    assert smallest_set_reaching(slash, 0.5)[0, 0].nonzero().flatten().tolist() == [50]


def test_scores_with_queries_that_end_before_the_keys():
    # Rows at positions 10..12 of 16 keys (a cross-chunk case): offsets count from each row.
    probs = torch.zeros(1, 1, 3, 16)
    probs[0, 0, :, 0] = 1.0  # rows at 10, 11, 12 all read key 0: offsets 10, 11, 12
    _, slash = vertical_and_slash_scores(probs, 12)
    assert torch.allclose(slash[0, 0, 10:13], torch.full((3,), 1 / 3)) and slash.sum().item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="last_position"):
        vertical_and_slash_scores(probs, 16)


def smallest_set_reaching(scores, threshold):
    return select_by_cumulative_threshold(scores, scores > 0, threshold)


def test_smallest_set_reaching_keeps_the_fewest_top_entries():
    scores = torch.tensor([[0.1, 0.4, 0.0, 0.3, 0.2]])
    assert smallest_set_reaching(scores, 0.65).tolist() == [[False, True, False, True, False]]
    assert smallest_set_reaching(scores, 0.7).tolist() == [[False, True, False, True, False]]
    assert smallest_set_reaching(scores, 0.75).tolist() == [[False, True, False, True, True]]
    # Zero scores are never kept, even at threshold 1.
    assert not smallest_set_reaching(scores, 1.0)[0, 2]


def _inputs(permuter: str, seq_len: int = 300, seq_len_q: int | None = None):
    q, k, _ = pbs.testing.make_qkv(batch=1, heads_q=2, heads_kv=1, seq_len=seq_len, head_dim=16, seq_len_q=seq_len_q)
    from pbs.planning import build_plan

    config = small_config(permuter=permuter)
    plan, q_perm, _, _ = build_plan(q, k, config, 16**-0.5)
    return SelectionInputs(
        q=q_perm, k=plan.key_permutation.apply(k), layout=plan.layout, query_positions=plan.query_positions(),
        key_positions=plan.key_positions(), scale=16**-0.5,
    )


def _token_level_blocks(inputs: SelectionInputs, keys: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Brute force: block (i, j) holds a query slot and a key slot on a kept line."""
    layout = inputs.layout
    bs = layout.block_size
    out = torch.zeros(keys.shape[:2] + (layout.num_query_blocks, layout.num_key_blocks), dtype=torch.bool)
    group = layout.heads_q // inputs.key_positions.shape[1]
    for h in range(keys.shape[1]):
        qpos = inputs.query_positions[0, h]
        kpos = inputs.key_positions[0, h // group]
        diff = qpos[:, None] - kpos[None, :]
        on_line = keys[0, h][kpos][None, :] | (offsets[0, h][diff.clamp(min=0)] & (diff >= 0))
        for i in range(layout.num_query_blocks):
            for j in range(layout.num_key_blocks):
                out[0, h, i, j] = on_line[i * bs:(i + 1) * bs, j * bs:(j + 1) * bs].any()
    return out


def _random_lines(inputs: SelectionInputs, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """About 1% of the keys and of the offsets kept, for two heads."""
    gen = torch.Generator().manual_seed(seed)
    nk = inputs.layout.seq_len_k
    return torch.rand(1, 2, nk, generator=gen) < 0.01, torch.rand(1, 2, nk, generator=gen) < 0.01


@pytest.mark.parametrize("seq_len_q", [None, 130])
def test_lines_map_to_exactly_the_blocks_they_cross_when_unpermuted(seq_len_q):
    inputs = _inputs("none", seq_len=300, seq_len_q=seq_len_q)
    keys, offsets = _random_lines(inputs, seed=0)
    got = blocks_of_lines(keys, offsets, inputs, slice(0, 2)) & inputs.allowed_blocks()
    want = _token_level_blocks(inputs, keys, offsets) & inputs.allowed_blocks()
    assert torch.equal(got, want)


def test_lines_cover_at_least_the_blocks_they_cross_when_permuted():
    inputs = _inputs("last_block", seq_len=300)
    keys, offsets = _random_lines(inputs, seed=1)
    got = blocks_of_lines(keys, offsets, inputs, slice(0, 2)) & inputs.allowed_blocks()
    want = _token_level_blocks(inputs, keys, offsets) & inputs.allowed_blocks()
    assert (got | ~want).all()
    # Keys are located exactly: a selection from kept keys alone matches the brute force.
    no_offsets = torch.zeros_like(offsets)
    assert torch.equal(blocks_of_lines(keys, no_offsets, inputs, slice(0, 2)) & inputs.allowed_blocks(),
                       _token_level_blocks(inputs, keys, no_offsets) & inputs.allowed_blocks())


def _copy_pattern(seq_len: int, period: int, head_dim: int = 32):
    """Queries that read the key ``period`` positions back (an induction head reading a repeat)."""
    gen = torch.Generator().manual_seed(0)
    k = torch.nn.functional.normalize(torch.randn(1, 1, seq_len, head_dim, generator=gen), dim=-1)
    source = (torch.arange(seq_len) - period).clamp(min=0)
    q = 200.0 * k[:, :, source]
    v = torch.randn(1, 1, seq_len, head_dim, generator=gen)
    return q, k, v


def test_a_copy_line_is_selected_and_the_output_stays_exact():
    seq_len, period, block = 1024, 448, 64
    q, k, v = _copy_pattern(seq_len, period)
    config = pbs.PBSConfig(
        permuter="none", selector={"name": "vertical_slash", "threshold": 0.9}, block_size=block, segment_size=128,
        backend="reference", dense_fallback={"min_seq_len": 0, "max_density": None},
    )
    out, plan = pbs.attention(q, k, v, config=config, return_plan=True)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    selected = plan.mask.to_dense()[0, 0]
    for i in range(period // block + 1, seq_len // block):
        assert selected[i, (i * block - period) // block], f"query block {i} misses its copy source"
    assert plan.density < 0.4
    assert (out - dense).abs().max().item() < 1e-2


@pytest.mark.parametrize("permuter,gqa", [("last_block", "shared"), ("last_block", "per_head"), ("none", "shared")])
def test_original_order_keys_and_permuted_keys_select_the_same(permuter, gqa):
    q, k, _ = pbs.testing.make_qkv(batch=2, heads_q=4, heads_kv=2, seq_len=300, head_dim=16)
    from pbs.planning import build_plan

    config = small_config(permuter=permuter, gqa=gqa, selector={"name": "vertical_slash", "threshold": 0.7})
    plan, q_perm, _, _ = build_plan(q, k, config, 16**-0.5)
    common = dict(q=q_perm, layout=plan.layout, query_positions=plan.query_positions(),
                  key_positions=plan.key_positions(), scale=16**-0.5)
    from_permuted = SelectionInputs(k=plan.key_permutation.apply(k), **common)
    from_source = SelectionInputs(k=None, source_k=k, key_permutation=plan.key_permutation, **common)
    assert torch.equal(config.selector.select(from_permuted), config.selector.select(from_source))


def test_a_separate_vertical_threshold_keeps_more_keys():
    inputs = _inputs("none", seq_len=300)
    low = pbs.config.PBSConfig(selector={"name": "vertical_slash", "threshold": 0.5}).selector.select(inputs)
    high = pbs.config.PBSConfig(
        selector={"name": "vertical_slash", "threshold": 0.5, "vertical_threshold": 0.99}
    ).selector.select(inputs)
    assert (high | ~low).all() and high.sum() > low.sum()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run scripts/gpu_check.sh on the GPU machine)")
@pytest.mark.parametrize("seq_len,seq_len_q", [(4096, None), (3000, 1000), (8333, None)])
@pytest.mark.parametrize("selector", [{"name": "vertical_slash", "threshold": 0.6}, "vertical_slash_pooled",
                                      "vertical_slash_pooled_deep", {"name": "head_choice", "min_coverage": 0.8}])
def test_gpu_plan_and_attention_match_the_cpu_reference(seq_len, seq_len_q, selector):
    # fp32 inputs so that ties in the rankings mostly match the CPU's.
    q, k, v = pbs.testing.make_qkv(batch=2, heads_q=8, heads_kv=2, seq_len=seq_len, seq_len_q=seq_len_q,
                                   head_dim=64, dtype=torch.float32, device="cuda", seed=5)
    if isinstance(selector, str):  # a preset: the union goes through the fused merge
        selector = pbs.PBSConfig.from_preset(selector).selector
    config = pbs.PBSConfig(selector=selector, permuter="none", dense_fallback={"min_seq_len": 0, "max_density": None})
    out, plan = pbs.attention(q, k, v, config, return_plan=True)
    cpu_config = config.model_copy(update={"backend": "reference"})
    cpu_out, cpu_plan = pbs.attention(q.cpu(), k.cpu(), v.cpu(), cpu_config, return_plan=True)
    gpu_mask, cpu_mask = plan.mask.to_dense().cpu(), cpu_plan.mask.to_dense()
    # head_choice: a head whose coverage sits at min_coverage may choose differently (one of 16).
    tolerance = 1e-3 if config.selector.name != "head_choice" else 1 / 16
    assert (gpu_mask != cpu_mask).float().mean().item() < tolerance
    assert plan.density == pytest.approx(cpu_plan.density, abs=2e-3 if tolerance < 1e-2 else 3e-2)
    error = (out.cpu() - cpu_out).abs()
    if config.selector.name == "head_choice":  # compared on the heads planned alike
        same = (gpu_mask == cpu_mask).flatten(2).all(-1)
        assert same.float().mean().item() >= 0.9
        error = error[same]
    assert error.max().item() < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run scripts/gpu_check.sh on the GPU machine)")
def test_gpu_scores_and_fused_union_at_32k_in_bf16():
    # Long rows exercise the persistent tile loop and the atomics that add up the slash scores.
    from pbs.kernels.vertical_slash import line_scores
    from pbs.planning import build_plan
    from pbs.selectors.vertical_slash import _scores_of_reversed_rows, last_rows_attention

    q, k, _ = pbs.testing.make_qkv(batch=1, heads_q=8, heads_kv=2, seq_len=32768, head_dim=128,
                                   dtype=torch.bfloat16, device="cuda", seed=3)
    config = pbs.PBSConfig.from_preset("vertical_slash_pooled").model_copy(update={"backend": "triton"})
    plan, q_perm, _, _ = build_plan(q, k, config, 128**-0.5)
    inputs = SelectionInputs(q=q_perm, k=None, source_k=k, key_permutation=plan.key_permutation, layout=plan.layout,
                             query_positions=plan.query_positions(), key_positions=plan.key_positions(),
                             scale=128**-0.5)
    vertical, slash = line_scores(inputs.q, inputs.source_k, inputs.layout, inputs.scale, 64)
    probs, last = last_rows_attention(inputs, 64, slice(0, 8), k.flip(2))
    want_vertical, want_slash = _scores_of_reversed_rows(probs, last)
    assert (vertical - want_vertical).abs().max().item() < 1e-3
    assert (slash - want_slash).abs().max().item() < 1e-3
    assert slash.sum(-1).sub(1).abs().max().item() < 1e-3
    union = config.selector
    fused = planner_for("selector", union.name, "triton")(union, inputs)
    each = [planner_for("selector", m.name, "triton")(m, inputs).to_dense() for m in union.selectors]
    assert torch.equal(fused.to_dense(), each[0] | each[1])
    choice = pbs.PBSConfig(permuter="none", selector={"name": "head_choice", "min_coverage": 0.8}).selector
    chosen = planner_for("selector", choice.name, "triton")(choice, inputs).to_dense()
    lines, pooled = each
    for h in range(8):
        assert torch.equal(chosen[0, h], pooled[0, h]) or torch.equal(chosen[0, h], pooled[0, h] | lines[0, h])


def test_the_two_level_scan_equals_cumsum():
    gen = torch.Generator().manual_seed(2)
    values = torch.rand(2, 3, 5000, generator=gen)
    assert torch.allclose(cumsum_long_rows(values, torch.float32), values.cumsum(-1), rtol=1e-5, atol=1e-4)
    flags = torch.rand(2, 3, 9000, generator=gen) < 0.1
    assert torch.equal(cumsum_long_rows(flags, torch.int32), flags.cumsum(-1, dtype=torch.int32))
    short = torch.rand(4, 100, generator=gen)
    assert torch.equal(cumsum_long_rows(short, torch.float32), short.cumsum(-1))


# The Triton twin (pbs.kernels.vertical_slash), in the interpreter on the CPU.
def _triton_inputs(seq_len, seq_len_q, dtype, seed=0, block=32, causal=True):
    q, k, _ = pbs.testing.make_qkv(batch=2, heads_q=4, heads_kv=2, seq_len=seq_len, seq_len_q=seq_len_q,
                                   head_dim=32, dtype=dtype, seed=seed)
    from pbs.planning import build_plan

    config = pbs.PBSConfig(permuter="none", block_size=block, segment_size=2 * block, backend="reference", causal=causal)
    plan, q_perm, _, _ = build_plan(q, k, config, 32**-0.5)
    return SelectionInputs(q=q_perm, k=None, source_k=k, key_permutation=plan.key_permutation, layout=plan.layout,
                           query_positions=plan.query_positions(), key_positions=plan.key_positions(), scale=32**-0.5)


@pytest.mark.parametrize("seq_len,seq_len_q", [(300, None), (300, 130), (256, None)])
def test_triton_scores_match_the_reference(seq_len, seq_len_q):
    from pbs.kernels.vertical_slash import line_scores
    from pbs.selectors.vertical_slash import _scores_of_reversed_rows, last_rows_attention

    inputs = _triton_inputs(seq_len, seq_len_q, torch.float32)
    vertical, slash = line_scores(inputs.q, inputs.source_k, inputs.layout, inputs.scale, 64)
    probs, last = last_rows_attention(inputs, 64, slice(0, 4), inputs.source_k.flip(2))
    want_vertical, want_slash = _scores_of_reversed_rows(probs, last)
    assert torch.allclose(vertical, want_vertical, atol=1e-5) and torch.allclose(slash, want_slash, atol=1e-5)


@pytest.mark.parametrize("causal,ragged", [(True, True), (False, False)])
def test_stacked_heads_score_what_each_head_scores_alone(monkeypatch, causal, ragged):
    # LINES_HEADS_PER_PROGRAM > 1: one program scores the rows of several query heads of a KV
    # group on one read of K, 2 sequences, 4 query heads per KV head; ragged: a padded batch
    # whose second sequence is shorter (its own lengths on the device).
    import pbs.kernels.vertical_slash as vertical_slash
    from pbs.planning import make_layout

    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 8, 150, 32, generator=gen), torch.randn(2, 2, 300, 32, generator=gen)
    layout = make_layout(q, k, pbs.PBSConfig(causal=causal))
    lengths = torch.tensor([[150, 300], [40, 90]], dtype=torch.int32) if ragged else None
    monkeypatch.setattr(vertical_slash, "LINES_HEADS_PER_PROGRAM", 1)
    alone = vertical_slash.line_scores(q, k, layout, 0.2, 64, lengths=lengths)
    monkeypatch.setattr(vertical_slash, "LINES_HEADS_PER_PROGRAM", 4)
    assert vertical_slash._heads_per_program(4, 64) == 4
    stacked = vertical_slash.line_scores(q, k, layout, 0.2, 64, lengths=lengths)
    torch.testing.assert_close(stacked, alone, rtol=0, atol=1e-6)
    assert stacked[1].abs().sum() > 0


@pytest.mark.parametrize("seq_len,seq_len_q,threshold,causal",
                         [(300, None, 0.6, True), (300, 130, 0.75, True), (260, None, 0.9, True), (300, None, 0.75, False)])
@pytest.mark.parametrize("force_sink", [True, False])
def test_triton_selection_matches_the_reference(seq_len, seq_len_q, threshold, causal, force_sink):
    from pbs.backends.planners import vertical_slash_select
    from pbs.reference.block_sets import finalize_selection

    inputs = _triton_inputs(seq_len, seq_len_q, torch.float32, seed=1, causal=causal)
    inputs.force_sink_block = force_sink
    selector = pbs.PBSConfig(selector={"name": "vertical_slash", "threshold": threshold}).selector
    fast = vertical_slash_select(selector, inputs)
    reference = finalize_selection(selector.select(inputs), inputs.layout, inputs.key_positions, force_sink)
    assert torch.equal(fast.counts, reference.counts)
    assert torch.equal(fast.indices, reference.indices)
    assert torch.equal(fast.full_counts, reference.full_counts)


def _line_scores_with_ties(seq_len: int, seed: int) -> torch.Tensor:
    """(2, 2, 3, seq_len) rows summing to one, with zeros and runs of equal scores."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.rand(2, 2, 3, seq_len, generator=gen) ** 8  # a few large entries, many small ones
    raw[..., ::7] = 0.0  # zero scores are never kept
    raw[..., 100:140] = raw[..., 100:101]  # a run of ties, which the reference takes in index order
    return raw / raw.sum(-1, keepdim=True)


@pytest.mark.parametrize("seq_len", [700, 2500])  # one tile and several (1024-score tiles here)
@pytest.mark.parametrize("threshold,vertical_threshold,total", [(0.6, None, 1.0), (0.9, 0.5, 1.0), (0.99, None, 1.0),
                                                               (0.9, None, 0.5)])  # short of the share: keep all
def test_kept_lines_kernel_equals_the_sorting_reference(seq_len, threshold, vertical_threshold, total):
    from pbs.kernels.vertical_slash import kept_line_blocks

    block = 64
    scores = _line_scores_with_ties(seq_len, seed=seq_len) * total
    vertical_blocks, prefix = kept_line_blocks(scores, threshold, vertical_threshold, block)
    keys, offsets = kept_lines(scores[0], scores[1], threshold, vertical_threshold)
    tk = -(-seq_len // block)
    want_blocks = torch.nn.functional.pad(keys, (0, tk * block - seq_len)).view(2, 3, tk, block).any(-1)
    assert torch.equal(vertical_blocks.bool(), want_blocks)
    assert torch.equal(prefix, offset_prefix(offsets))


@pytest.mark.parametrize("digit_bits,compact_after,threshold,total",
                         [(2, None, 0.9, 0.5), (1, None, 0.9, 1.0), (4, 2, 0.9, 1.0), (2, 3, 0.9, 0.5)])
def test_kept_lines_kernel_finds_the_same_cut_with_narrower_digits_or_a_compacted_bucket(
        monkeypatch, digit_bits, compact_after, threshold, total):
    import pbs.kernels.vertical_slash as vertical_slash

    monkeypatch.setattr(vertical_slash, "KEPT_LINES_DIGIT_BITS", digit_bits)
    monkeypatch.setattr(vertical_slash, "KEPT_LINES_COMPACT_AFTER", compact_after)
    scores = _line_scores_with_ties(2500, seed=3) * total
    vertical_blocks, prefix = vertical_slash.kept_line_blocks(scores, threshold, 0.6, 64)
    keys, offsets = kept_lines(scores[0], scores[1], threshold, 0.6)
    want_blocks = torch.nn.functional.pad(keys, (0, 40 * 64 - 2500)).view(2, 3, 40, 64).any(-1)
    assert torch.equal(vertical_blocks.bool(), want_blocks)
    assert torch.equal(prefix, offset_prefix(offsets))


# 0.125 has the float bits 0x3E000000: after two passes its ties sit on the compacted bucket's lower edge.
@pytest.mark.parametrize("value,count", [(0.1, 10), (0.125, 8)])
@pytest.mark.parametrize("compact_after", [None, 2])
def test_kept_lines_kernel_takes_tied_scores_in_index_order(monkeypatch, value, count, compact_after):
    import pbs.kernels.vertical_slash as vertical_slash
    from pbs.kernels.vertical_slash import kept_line_blocks

    monkeypatch.setattr(vertical_slash, "KEPT_LINES_COMPACT_AFTER", compact_after)
    scores = torch.zeros(2, 1, 1, 64)
    scores[:, ..., 10:10 + count] = value  # equal shares: 0.35 needs the first ceil(0.35 / value) of them
    vertical_blocks, prefix = kept_line_blocks(scores, 0.35, None, 16)
    needed = math.ceil(0.35 / value)
    assert prefix[0, 0, 1:].diff(prepend=torch.zeros(1, dtype=torch.int32)).nonzero().flatten().tolist() == \
        list(range(10, 10 + needed))
    assert vertical_blocks[0, 0].tolist() == [1, 0, 0, 0]


def test_triton_selection_falls_back_to_the_reference_for_permuted_keys():
    from pbs.backends.planners import lines_fast_path

    assert not lines_fast_path(_inputs("last_block"))
    assert lines_fast_path(_triton_inputs(300, None, torch.float32))


def test_triton_selection_in_half_precision_stays_close_to_the_reference():
    from pbs.backends.planners import vertical_slash_select
    from pbs.reference.block_sets import finalize_selection

    inputs = _triton_inputs(300, None, torch.float16, seed=2)
    selector = pbs.PBSConfig(selector={"name": "vertical_slash", "threshold": 0.7}).selector
    fast = vertical_slash_select(selector, inputs).to_dense()
    reference = finalize_selection(selector.select(inputs), inputs.layout, inputs.key_positions, True).to_dense()
    # fp16 products summed in another order can flip a key or offset at the threshold, nothing more.
    assert (fast != reference).float().mean().item() < 0.02


def test_the_preset_is_the_measured_configuration():
    config = pbs.PBSConfig.from_preset("vertical_slash", block_size=32, segment_size=64)
    assert config.permuter.name == "none"
    assert config.selector.name == "vertical_slash" and config.selector.threshold == 0.75
    q, k, v = pbs.testing.make_qkv(batch=1, heads_q=2, heads_kv=1, seq_len=256, head_dim=16)
    out, plan = pbs.attention(q, k, v, config.model_copy(update={"backend": "reference"}), return_plan=True)
    assert plan is not None and 0 < plan.density < 1  # the dense fallback applies on CUDA only
    assert out.shape == q.shape


def line_kernels_compile_report() -> dict:
    """Compiles, for sm_90 (run by compile_in_subprocess), the line kernels as the GPU builds them
    (bf16, D 128, 64 rows, 32 query and 8 KV heads): `line_scores`' two kernels with one head per
    program, two (the default) and four stacked, and `kept_line_blocks`' kernel with compaction
    after three passes (the default) and without (other digit widths only change constants).
    Returns registers and spills per variant."""
    import pbs.kernels.vertical_slash as vertical_slash
    from pbs.planning import make_layout
    from tests.sm90_compile import resource_usage, scratch_dir, sm90_driver
    from tests.test_paged import _compile_only

    q = torch.empty(1, 32, 4096, 128, dtype=torch.bfloat16)
    k = torch.empty(1, 8, 4096, 128, dtype=torch.bfloat16)
    layout = make_layout(q, k, pbs.PBSConfig())
    report = {}
    with sm90_driver():
        for heads in (1, 2, 4):
            compiled = []
            vertical_slash.LINES_HEADS_PER_PROGRAM = heads
            with _compile_only(vertical_slash, ["_row_stats", "_row_lines"], compiled):
                vertical_slash.line_scores(q, k, layout, 0.1, 64)
            report[f"line_scores heads {heads}"] = [resource_usage(c.asm["cubin"], scratch_dir()) for c in compiled]
        vertical_slash.LINES_HEADS_PER_PROGRAM = 2
        scores = torch.empty(2, 1, 32, 4096, dtype=torch.float32)
        for bits, compact_after in ((4, None), (4, 3)):
            compiled = []
            vertical_slash.KEPT_LINES_DIGIT_BITS, vertical_slash.KEPT_LINES_COMPACT_AFTER = bits, compact_after
            with _compile_only(vertical_slash, ["_kept_lines"], compiled):
                vertical_slash.kept_line_blocks(scores, 0.75, None, 128)
            report[f"kept_lines {bits} bits, compact {compact_after}"] = [
                resource_usage(c.asm["cubin"], scratch_dir()) for c in compiled]
    return report


def test_the_line_kernels_compile_for_sm90():
    # The interpreter runs none of the code generator: a construct it accepts (a constexpr name
    # bound again in an unrolled loop, say) can still fail to compile for the GPU.
    from tests.sm90_compile import compile_in_subprocess

    report = compile_in_subprocess("tests.test_vertical_slash:line_kernels_compile_report")
    assert len(report) == 5 and all(len(kernels) >= 1 for kernels in report.values())
    # The launches the defaults run keep everything in registers.
    for name in ("line_scores heads 2", "kept_lines 4 bits, compact 3"):
        assert all(usage["LOCAL"] == 0 for usage in report[name]), f"register spills ({name}): {report[name]}"


def test_the_launch_sweeps_start_from_the_module_defaults():
    # benchmarks/sweep_line_scores.py times its first variant as the default launch: it must be.
    import pbs.kernels.vertical_slash as vs
    from benchmarks.sweep_line_scores import VARIANTS

    # `_row_lines` launches with Triton's default of 4 warps.
    row_default = f"{vs.KEY_TILE},{vs.PROGRAMS_PER_SM},4,{vs.LINES_STAGES},{vs.LINES_HEADS_PER_PROGRAM}"
    assert VARIANTS["row_lines"][0] == row_default
    tile = vs.KEPT_LINES_TILES[1]
    kept_default = f"{tile},{vs.KEPT_LINES_WARPS},{vs.KEPT_LINES_DIGIT_BITS},{vs.KEPT_LINES_COMPACT_AFTER or 0}"
    assert VARIANTS["kept_lines"][0] == kept_default
