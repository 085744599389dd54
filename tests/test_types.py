"""BlockMask, Layout and Permutation values."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pbs.layout import Layout
from pbs.types import BlockMask, Permutation, full_block_counts


def _layout(nq=300, nk=300, block=32, segment=64, causal=True, b=2, h=3):
    return Layout(batch=b, heads_q=h, heads_kv=1, seq_len_q=nq, seq_len_k=nk, block_size=block, segment_size=segment, causal=causal)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 1000), p=st.floats(0.0, 1.0))
def test_block_mask_dense_round_trip(seed, p):
    layout = _layout()
    gen = torch.Generator().manual_seed(seed)
    dense = torch.rand(2, 3, layout.num_query_blocks, layout.num_key_blocks, generator=gen) < p
    mask = BlockMask.from_dense(dense, layout)
    assert torch.equal(mask.to_dense(), dense)
    assert torch.equal(mask.counts, dense.sum(-1).int())
    for b, h, i in itertools.product(range(2), range(3), range(layout.num_query_blocks)):
        n = int(mask.counts[b, h, i])
        assert mask.indices[b, h, i, :n].tolist() == dense[b, h, i].nonzero().flatten().tolist()
        assert (mask.indices[b, h, i, n:] == -1).all()


def test_block_mask_rejects_wrong_input():
    layout = _layout()
    with pytest.raises(TypeError, match="bool"):
        BlockMask.from_dense(torch.zeros(2, 3, 10, 10), layout)
    with pytest.raises(ValueError, match=r"\(B, Hq, Tq, Tk\) = \(2, 3, 10, 10\)"):
        BlockMask.from_dense(torch.zeros(2, 3, 10, 9, dtype=torch.bool), layout)


def test_density_is_counted_against_allowed_blocks():
    layout = _layout()
    allowed = layout.allowed_blocks().expand(2, 3, -1, -1)
    assert BlockMask.from_dense(allowed.clone(), layout).density() == pytest.approx(1.0)
    half = allowed & (torch.arange(layout.num_key_blocks) % 2 == 0)
    expected = half.sum().item() / allowed.sum().item()
    assert BlockMask.from_dense(half, layout).density() == pytest.approx(expected)


def _brute_force_block_sets(layout: Layout):
    """Allowed / diagonal blocks from explicit token positions and every slot's possible range."""
    s, bs = layout.segment_size, layout.block_size
    full = layout.permutable_key_len
    lo_q, hi_q = layout.permutable_query_range

    def key_range(slot):
        return (slot // s * s, slot // s * s + s - 1) if slot < full else (slot, slot)

    def query_range(slot):
        pos = slot + layout.query_offset
        return (pos // s * s, pos // s * s + s - 1) if lo_q <= slot < hi_q else (pos, pos)

    tq, tk = layout.num_query_blocks, layout.num_key_blocks
    allowed = torch.zeros(tq, tk, dtype=torch.bool)
    diagonal = torch.zeros(tq, tk, dtype=torch.bool)
    needs_check = torch.zeros(tq, tk, dtype=torch.bool)
    for i in range(tq):
        q_slots = range(i * bs, min((i + 1) * bs, layout.seq_len_q))
        qs = [query_range(t) for t in q_slots]
        q_segments = {(t + layout.query_offset) // s for t in q_slots}
        for j in range(tk):
            k_slots = range(j * bs, min((j + 1) * bs, layout.seq_len_k))
            ks = [key_range(t) for t in k_slots]
            # Some permutation could put a key no later than some query in the pair of blocks.
            allowed[i, j] = (not layout.causal) or min(k[0] for k in ks) <= max(q[1] for q in qs)
            # The query block's own segment(s), the partial last segment counted as one.
            diagonal[i, j] = allowed[i, j] and any(t // s in q_segments for t in k_slots)
            # Some permutation could put a key after some query: a per-token check is needed.
            needs_check[i, j] = layout.causal and max(k[1] for k in ks) >= min(q[0] for q in qs) and allowed[i, j]
    return allowed, diagonal, needs_check


@pytest.mark.parametrize(
    "nq, nk, block, segment, causal",
    [(300, 300, 32, 64, True), (100, 300, 32, 64, True), (37, 250, 16, 64, True), (128, 128, 32, 128, True), (200, 300, 32, 64, False), (5, 40, 16, 32, True)],
)
def test_layout_block_sets_match_brute_force(nq, nk, block, segment, causal):
    layout = _layout(nq=nq, nk=nk, block=block, segment=segment, causal=causal)
    allowed, diagonal, needs_check = _brute_force_block_sets(layout)
    assert torch.equal(layout.allowed_blocks(), allowed)
    assert torch.equal(layout.diagonal_blocks(), diagonal)
    # Every block that may hold a future token is on the diagonal, so it is always computed.
    assert not (needs_check & ~diagonal).any()
    assert torch.equal(layout.candidate_blocks(), allowed & ~diagonal)
    assert layout.total_allowed_blocks == int(allowed.sum())


def _brute_force_full_blocks(layout: Layout) -> torch.Tensor:
    """``(Tq, Tk)`` bool: key block ``j`` needs no per-token check for query block ``i``.

    From per-token effective positions: every key slot's latest possible position is before the
    earliest possible position of every query slot (causal), and no slot of the key block lies past
    ``Nk`` (a padded slot always needs the check)."""
    s, bs = layout.segment_size, layout.block_size
    permutable_keys = layout.permutable_key_len
    lo_q, hi_q = layout.permutable_query_range
    tq, tk = layout.num_query_blocks, layout.num_key_blocks
    full = torch.zeros(tq, tk, dtype=torch.bool)
    for i in range(tq):
        q_lo = min(
            (t + layout.query_offset) // s * s if lo_q <= t < hi_q else t + layout.query_offset
            for t in range(i * bs, min((i + 1) * bs, layout.seq_len_q))
        )
        for j in range(tk):
            slots = range(j * bs, (j + 1) * bs)
            if any(t >= layout.seq_len_k for t in slots):
                continue
            k_hi = max(t // s * s + s - 1 if t < permutable_keys else t for t in slots)
            full[i, j] = (not layout.causal) or k_hi < q_lo
    return full


FULL_COUNT_LAYOUTS = [
    # nq, nk, block, segment, causal, segmented
    (300, 300, 32, 64, True, True),  # Nk not a multiple of the block: partial last key block
    (256, 256, 32, 64, True, True),
    (100, 300, 32, 64, True, True),  # cached prefix, Nk - Nq not a multiple of the block
    (37, 250, 16, 64, True, True),
    (128, 128, 32, 128, True, True),
    (5, 40, 16, 32, True, True),
    (300, 300, 32, 32, True, False),  # unpermuted (the `none` permuter's one-block segments)
    (100, 300, 32, 32, True, False),
    (200, 300, 32, 64, False, True),  # non-causal: every block full but the partial last one
    (256, 256, 32, 64, False, True),
    (200, 300, 32, 32, False, False),
]


@pytest.mark.parametrize("nq, nk, block, segment, causal, segmented", FULL_COUNT_LAYOUTS)
def test_full_counts_match_brute_force(nq, nk, block, segment, causal, segmented):
    layout = Layout(batch=2, heads_q=3, heads_kv=1, seq_len_q=nq, seq_len_k=nk, block_size=block,
                    segment_size=segment, causal=causal, segmented=segmented)
    full = _brute_force_full_blocks(layout)
    # The full blocks of a query block are a prefix of the key blocks, which is what lets an
    # ascending list be split by one count.
    first = layout.first_masked_blocks()
    assert torch.equal(full, torch.arange(layout.num_key_blocks)[None, :] < first[:, None])
    if not causal:
        assert torch.equal(first, torch.full_like(first, layout.num_key_blocks - (nk % block != 0)))
    # What needs the check is on the diagonal (always computed), or the partial last key block.
    partial = torch.zeros(layout.num_key_blocks, dtype=torch.bool)
    partial[-1] = nk % block != 0
    assert not (layout.allowed_blocks() & ~full & ~layout.diagonal_blocks() & ~partial).any()

    gen = torch.Generator().manual_seed(nq + nk)
    for p in (0.3, 1.0):  # random lists (future blocks included) and every block
        dense = torch.rand(2, 3, layout.num_query_blocks, layout.num_key_blocks, generator=gen) < p
        mask = BlockMask.from_dense(dense, layout)
        assert mask.full_counts.dtype == torch.int32
        assert torch.equal(mask.full_counts, (dense & full).sum(-1).int())
        # The full entries are the head of each list: the first full_counts entries, all full.
        for b, h, i in itertools.product(range(2), range(3), range(layout.num_query_blocks)):
            listed = mask.indices[b, h, i, : int(mask.counts[b, h, i])].long()
            n_full = int(mask.full_counts[b, h, i])
            assert full[i, listed[:n_full]].all() and not full[i, listed[n_full:]].any()


@pytest.mark.parametrize("permuter", ["random", "key_aware_query", "last_block", "none"])
@pytest.mark.parametrize("seq_len, seq_len_q", [(300, None), (256, 150)])
def test_full_blocks_hold_only_past_keys_for_real_permutations(permuter, seq_len, seq_len_q):
    """Checked on the plan's actual positions: every key of a full block is at or before every
    query of its query block and inside ``Nk``; a per-token check there would change nothing."""
    import pbs
    from pbs.testing import make_qkv

    q, k, _ = make_qkv(heads_q=2, heads_kv=1, seq_len=seq_len, seq_len_q=seq_len_q, head_dim=16, seed=4)
    config = pbs.PBSConfig(block_size=16, segment_size=64, permuter=permuter, gqa="per_head",
                           selector={"name": "budget", "density": 1.0}, backend="reference")
    plan = pbs.plan(q, k, config)
    mask, layout, bs = plan.mask, plan.layout, plan.layout.block_size
    qpos, kpos = plan.query_positions(), plan.key_positions()
    for h, i in itertools.product(range(2), range(layout.num_query_blocks)):
        listed = mask.indices[0, h, i, : int(mask.counts[0, h, i])].long()
        n_full = int(mask.full_counts[0, h, i])
        earliest_query = int(qpos[0, h, i * bs : (i + 1) * bs].min())
        for j in listed[:n_full].tolist():
            assert (j + 1) * bs <= layout.seq_len_k
            hk = h * kpos.shape[1] // 2  # the query head's key head (an identity permutation has one)
            assert int(kpos[0, hk, j * bs : (j + 1) * bs].max()) <= earliest_query
    # The permutations here move keys inside segments: some lists have a masked tail to keep.
    assert (mask.full_counts < mask.counts).any()


def test_full_counts_travel_with_the_mask():
    layout = _layout()
    dense = layout.allowed_blocks().expand(2, 3, -1, -1).clone()
    mask = BlockMask.from_dense(dense, layout)
    assert torch.equal(mask.to("cpu").full_counts, mask.full_counts)
    # A given split is kept (so a test can check that a backend reads it), a wrong shape is not.
    claimed = BlockMask(mask.counts, mask.indices, layout, full_counts=mask.counts.clone())
    assert torch.equal(claimed.full_counts, mask.counts)
    assert torch.equal(claimed.to("cpu").full_counts, mask.counts)
    with pytest.raises(ValueError, match="full_counts must have the shape of counts"):
        BlockMask(mask.counts, mask.indices, layout, full_counts=mask.counts[:, :1])


def test_full_counts_are_derived_on_first_read_and_kept():
    layout = _layout()
    dense = layout.allowed_blocks().expand(2, 3, -1, -1).clone()
    mask = BlockMask.from_dense(dense, layout)
    assert mask.__dict__.get("_full_counts") is None  # nothing derived for a mask nobody reads
    first = mask.full_counts
    assert first is mask.full_counts  # derived once
    assert torch.equal(first, full_block_counts(mask.counts, mask.indices, layout))


def test_the_masking_rule_is_written_once():
    """`Layout.first_masked_blocks` is the only place that works out where the per-token check
    starts; the kernels and the FlexAttention lowering read ``BlockMask.full_counts``."""
    import re
    from pathlib import Path

    package = Path(__file__).resolve().parents[1] / "pbs"
    where = [
        str(path.relative_to(package)) for path in sorted(package.rglob("*.py"))
        if re.search(r"^\s*def \w*(first_masked|count_masked)\w*\(", path.read_text(), re.MULTILINE)
    ]
    assert where == ["layout.py"]


def test_on_diagonal_segment_is_allowed_whole():
    # Prefill, block 128, segment 256: query block 0 may see key block 1 of its own segment.
    layout = _layout(nq=1024, nk=1024, block=128, segment=256)
    allowed = layout.allowed_blocks()
    assert allowed[0, 1] and not allowed[0, 2] and allowed[2, 3] and not allowed[2, 4]
    assert layout.total_allowed_blocks == 8 * 9 // 2 + 4


def test_identity_permutation_is_free():
    perm = Permutation.identity(1, 2, 10)
    x = torch.randn(1, 2, 10, 4)
    assert perm.apply(x) is x and perm.unapply(x) is x


def test_per_head_apply_expands_kv_heads():
    idx = torch.stack([torch.randperm(6) for _ in range(4)]).view(1, 4, 6)
    perm = Permutation.from_indices(idx)
    k = torch.randn(1, 2, 6, 3)
    out = perm.apply(k)
    assert out.shape == (1, 4, 6, 3)
    for h in range(4):
        assert torch.equal(out[0, h], k[0, h // 2, idx[0, h]])


def test_block_index_dtype_is_int16_below_2_to_15_blocks():
    from pbs.types import block_index_dtype

    # int16 halves the mask's memory; lists longer than int16 can index fall back to int32.
    assert block_index_dtype(1) == torch.int16
    assert block_index_dtype(2**15 - 1) == torch.int16
    assert block_index_dtype(2**15) == torch.int32

