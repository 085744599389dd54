"""Differential tests against independent transcriptions of the paper's algorithms.

Everything below the helpers is written from the paper's text (and, for XAttention, from the
description of its reference estimator), one (batch, head) at a time with plain loops, sharing no
code with ``pbs``:

* Eq. 3-4: the last query block scores every key of the full segments with no causal mask, the
  softmax is normalised over those keys, and keys are sorted by descending score in each segment;
* Algorithm 2 (MeanPooling block selection) with the causal mask ``C`` that "also includes the
  on-diagonal segments" when segmented permutation is applied, the partial last segment included;
  the on-diagonal segment and the sink block are then always computed;
* the unpermuted MeanPooling baseline: ``C`` is the plain causal block mask, and the sink and the
  diagonal block are forced;
* XAttention's estimator: antidiagonal strided scores with a strided causal mask, block sums,
  forced sink and diagonal blocks counted first towards the threshold.

Masks must be identical on the causally allowed blocks, and outputs within 1e-3 in fp32.
"""

from __future__ import annotations

import math

import pytest
import torch

import pbs
from tests.helpers import random_qkv

BLOCK, SEGMENT = 32, 64


def _config(**overrides) -> pbs.PBSConfig:
    """The paper's method (preset ``pbs_paper``: last_block + mean_pool, per-head GQA) at test size."""
    base = dict(block_size=BLOCK, segment_size=SEGMENT, backend="reference", gqa="per_head")
    base.update(overrides)
    return pbs.PBSConfig.from_preset("pbs_paper", **base)


# -- independent transcriptions (one head, Nq == Nk) ---------------------------------------------
def eq3_key_order(q: torch.Tensor, k: torch.Tensor, block: int, segment: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 3-4 for one head: ``(order, scores)``; ``order[slot]`` is the original key index."""
    n, d = k.shape
    full = (n // segment) * segment
    q_last = q[n - block :] if n >= block else q
    s = torch.softmax(q_last.double() @ k[:full].double().T / math.sqrt(d), dim=-1).mean(0)
    order = list(range(n))
    for start in range(0, full, segment):
        seg_scores = s[start : start + segment]
        ranked = sorted(range(segment), key=lambda i: (-float(seg_scores[i]), i))
        order[start : start + segment] = [start + i for i in ranked]
    return torch.tensor(order), s


def pooled(x: torch.Tensor, block: int) -> torch.Tensor:
    """MeanPool of every block (a partial last block: the mean of the tokens it has)."""
    return torch.stack([x[i : i + block].double().mean(0) for i in range(0, x.shape[0], block)])


def causal_block_mask_c(num_blocks: int, blocks_per_segment: int, segmented: bool) -> torch.Tensor:
    """Algorithm 2's ``C`` as a bool "may be scored" mask: causal, minus on-diagonal segments."""
    c = torch.zeros(num_blocks, num_blocks, dtype=torch.bool)
    for i in range(num_blocks):
        for j in range(i + 1):
            same_segment = j // blocks_per_segment == i // blocks_per_segment
            c[i, j] = not (segmented and same_segment)
    return c


def algorithm_2(q_perm: torch.Tensor, k_perm: torch.Tensor, c: torch.Tensor, block: int, tau: float) -> torch.Tensor:
    """Algorithm 2 lines 1-14 for one head: the selected blocks ``M``."""
    d = q_perm.shape[-1]
    qb, kb = pooled(q_perm, block), pooled(k_perm, block)
    logits = (qb @ kb.T / math.sqrt(d)).masked_fill(~c, float("-inf"))
    tr = c.shape[0]
    m = torch.zeros(tr, tr, dtype=torch.bool)
    for i in range(tr):
        if not c[i].any():
            continue  # no candidate block: nothing beyond the forced ones
        a = torch.softmax(logits[i], dim=-1)
        order = sorted(range(tr), key=lambda j: (-float(a[j]), j))
        cumulative, k = 0.0, int(c[i].sum())
        for rank, j in enumerate(order[: int(c[i].sum())]):
            cumulative += float(a[j])
            if cumulative >= tau:
                k = rank + 1
                break
        for j in order[:k]:
            m[i, j] = True
    return m


def segment_blocks(num_blocks: int, blocks_per_segment: int) -> torch.Tensor:
    """The on-diagonal segment of every query block (the partial last segment is one too)."""
    idx = torch.arange(num_blocks)
    return (idx[:, None] // blocks_per_segment) == (idx[None, :] // blocks_per_segment)


def block_may_be_needed(order: torch.Tensor, block: int) -> torch.Tensor:
    """``[i, j]``: key block ``j`` holds a key at or before the last query of block ``i``."""
    n = order.shape[0]
    nb = -(-n // block)
    out = torch.zeros(nb, nb, dtype=torch.bool)
    for i in range(nb):
        last_query = min(n, (i + 1) * block) - 1
        for j in range(nb):
            # With segmented permutation a block may receive any key of its segment; which keys it
            # actually holds is what matters for the output, but the forced segment is kept whole.
            out[i, j] = bool((order[j * block : (j + 1) * block] <= last_query).any())
    return out


def masked_attention(q, k, v, order, token_mask) -> torch.Tensor:
    """Attention of one head over permuted keys, with causality on original positions."""
    n, d = q.shape
    logits = q.double() @ k[order].double().T / math.sqrt(d)
    causal = order[None, :] <= torch.arange(n)[:, None]
    logits = logits.masked_fill(~(causal & token_mask), float("-inf"))
    return torch.softmax(logits, dim=-1) @ v[order].double()


def expand_blocks(mask: torch.Tensor, n: int, block: int) -> torch.Tensor:
    return mask.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :n]


def xattention_estimate(q: torch.Tensor, k: torch.Tensor, block: int, stride: int, tau: float) -> torch.Tensor:
    """XAttention's estimator for one head (prefill, causal), written from its description."""
    n, d = q.shape
    nb = -(-n // block)
    pad = nb * block - n
    qp = torch.cat([q.double(), q.new_zeros(pad, d).double()])
    kp = torch.cat([k.double(), k.new_zeros(pad, d).double()])
    rows = nb * block // stride
    # Row r: queries r*stride + stride-1, ..., r*stride (reversed); column c: keys c*stride, ... in order.
    q_r = torch.stack([torch.cat([qp[r * stride + stride - 1 - t] for t in range(stride)]) for r in range(rows)])
    k_r = torch.stack([torch.cat([kp[c * stride + t] for t in range(stride)]) for c in range(rows)])
    logits = q_r @ k_r.T / math.sqrt(d) / stride
    r_idx, c_idx = torch.arange(rows)[:, None], torch.arange(rows)[None, :]
    visible = (c_idx <= r_idx) & (c_idx * stride < n)
    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    probs[(torch.arange(rows) * stride) >= n] = 0.0
    per = block // stride
    sums = probs.view(nb, per, nb, per).sum((1, 3))
    m = torch.zeros(nb, nb, dtype=torch.bool)
    for i in range(nb):
        required = float(sums[i].sum()) * tau
        forced = sorted({0, i})
        for j in forced:
            m[i, j] = True
        total = sum(float(sums[i, j]) for j in forced)
        others = sorted((j for j in range(i + 1) if j not in forced), key=lambda j: (-float(sums[i, j]), j))
        for j in others:
            if total >= required:
                break
            m[i, j] = True
            total += float(sums[i, j])
    return m


# -- tests --------------------------------------------------------------------------------------
@pytest.mark.parametrize("seq_len", [256, 300, 200])
@pytest.mark.parametrize("seed", range(3))
def test_last_block_follows_eq_3(seq_len, seed):
    q, k, _ = random_qkv(batch=1, heads_q=2, heads_kv=2, seq_len=seq_len, head_dim=16, seed=seed)
    plan = pbs.plan(q, k, _config())
    for h in range(2):
        order, scores = eq3_key_order(q[0, h], k[0, h], BLOCK, SEGMENT)
        actual = plan.key_positions()[0, h]
        full = (seq_len // SEGMENT) * SEGMENT
        assert torch.equal(actual[full:], torch.arange(full, seq_len)), "the partial last segment must not move"
        for start in range(0, full, SEGMENT):
            seg = actual[start : start + SEGMENT]
            assert sorted(seg.tolist()) == list(range(start, start + SEGMENT))
            # Sorted by the independent scores (exact ties aside, the two orders are the same).
            ranked = scores[seg]
            assert (ranked[1:] <= ranked[:-1] + 1e-9).all()
        assert (actual == order).float().mean() > 0.95


def test_last_block_causal_scoring_is_a_different_named_rule():
    q, k, _ = random_qkv(batch=1, heads_q=2, heads_kv=2, seq_len=300, head_dim=16, seed=1)
    paper = pbs.plan(q, k, _config()).key_positions()
    causal = pbs.plan(q, k, _config(permuter={"name": "last_block", "causal_scoring": True})).key_positions()
    assert not torch.equal(paper, causal)


@pytest.mark.parametrize("seq_len", [256, 300, 232])
@pytest.mark.parametrize("tau", [0.5, 0.9, 0.99])
@pytest.mark.parametrize("seed", range(2))
def test_pbs_selection_and_output_follow_algorithm_2(seq_len, tau, seed):
    q, k, v = random_qkv(batch=1, heads_q=2, heads_kv=2, seq_len=seq_len, head_dim=16, seed=seed)
    config = _config(selector={"name": "mean_pool", "threshold": tau})
    plan = pbs.plan(q, k, config)
    out = pbs.attention(q, k, v, config)
    nb = -(-seq_len // BLOCK)
    per_segment = SEGMENT // BLOCK
    c = causal_block_mask_c(nb, per_segment, segmented=True)
    for h in range(2):
        # The key order must sort the independent Eq. 3 scores; it is then used as is, so that a
        # float near-tie between two keys cannot make the comparison below fail or be skipped.
        _, scores = eq3_key_order(q[0, h], k[0, h], BLOCK, SEGMENT)
        order = plan.key_positions()[0, h]
        for start in range(0, (seq_len // SEGMENT) * SEGMENT, SEGMENT):
            ranked = scores[order[start : start + SEGMENT]]
            assert (ranked[1:] <= ranked[:-1] + 1e-9).all()
        selected = algorithm_2(q[0, h], k[0, h][order], c, BLOCK, tau)
        sink = torch.zeros(nb, nb, dtype=torch.bool)
        sink[:, int((order == 0).nonzero()) // BLOCK] = True
        needed = block_may_be_needed(order, BLOCK)
        expected = (selected | segment_blocks(nb, per_segment) | sink) & needed
        actual = plan.mask.to_dense()[0, h]
        assert torch.equal(actual & needed, expected)
        reference = masked_attention(q[0, h], k[0, h], v[0, h], order, expand_blocks(expected, seq_len, BLOCK))
        torch.testing.assert_close(out[0, h].double(), reference, atol=1e-3, rtol=0)


@pytest.mark.parametrize("seq_len", [256, 300])
@pytest.mark.parametrize("tau", [0.5, 0.9])
def test_mean_pooling_baseline_is_plain_causal_algorithm_2(seq_len, tau):
    q, k, v = random_qkv(batch=1, heads_q=2, heads_kv=2, seq_len=seq_len, head_dim=16, seed=3)
    config = pbs.PBSConfig.from_preset(
        "mean_pooling", block_size=BLOCK, segment_size=SEGMENT, backend="reference",
        selector={"name": "mean_pool", "threshold": tau},
    )
    plan = pbs.plan(q, k, config)
    out = pbs.attention(q, k, v, config)
    nb = -(-seq_len // BLOCK)
    c = causal_block_mask_c(nb, 1, segmented=False)
    order = torch.arange(seq_len)
    for h in range(2):
        selected = algorithm_2(q[0, h], k[0, h], c, BLOCK, tau)
        forced = torch.eye(nb, dtype=torch.bool)
        forced[:, 0] = True
        expected = selected | forced
        assert torch.equal(plan.mask.to_dense()[0, h], expected)
        reference = masked_attention(q[0, h], k[0, h], v[0, h], order, expand_blocks(expected, seq_len, BLOCK))
        torch.testing.assert_close(out[0, h].double(), reference, atol=1e-3, rtol=0)


def test_identity_keeps_the_segment_rule_and_none_does_not():
    q, k, _ = random_qkv(batch=1, heads_q=2, heads_kv=2, seq_len=256, head_dim=16, seed=0)
    identity = pbs.plan(q, k, _config(permuter="identity", selector={"name": "mean_pool", "threshold": 0.01}))
    none = pbs.plan(q, k, _config(permuter="none", selector={"name": "mean_pool", "threshold": 0.01}))
    # Block 1 is in query block 0's segment (forced, wholly future: dropped) and query block 1's
    # (forced); with "none" only the diagonal block and the sink are forced.
    assert identity.mask.to_dense()[0, 0, 1, :2].all()
    assert none.layout.segment_size == BLOCK and not none.layout.segmented
    assert int(none.mask.counts[0, 0, 3]) <= 2 + 1


@pytest.mark.parametrize("seq_len", [256, 288])
@pytest.mark.parametrize("tau", [0.5, 0.9, 0.95])
def test_xattention_estimator(seq_len, tau):
    q, k, _ = random_qkv(batch=1, heads_q=2, heads_kv=2, seq_len=seq_len, head_dim=16, seed=5)
    config = pbs.PBSConfig.from_preset(
        "xattention", block_size=BLOCK, segment_size=SEGMENT, backend="reference",
        selector={"name": "antidiagonal", "stride": 8, "threshold": tau},
    )
    plan = pbs.plan(q, k, config)
    for h in range(2):
        expected = xattention_estimate(q[0, h], k[0, h], BLOCK, 8, tau)
        assert torch.equal(plan.mask.to_dense()[0, h], expected)


def test_permuted_antidiagonal_scores_only_the_candidates():
    """With segments, the strided softmax sees only blocks outside the on-diagonal segment."""
    from pbs.components import SelectionInputs
    from pbs.selectors.antidiagonal import antidiagonal_block_scores

    q, k, _ = random_qkv(batch=1, heads_q=2, heads_kv=2, seq_len=300, head_dim=16, seed=2)
    plan = pbs.plan(q, k, _config(selector="antidiagonal"))
    inputs = SelectionInputs(
        q, plan.key_permutation.apply(k), plan.layout, plan.query_positions(), plan.key_positions(), 0.25
    )
    scores = antidiagonal_block_scores(inputs, 8)
    candidates = plan.layout.candidate_blocks()
    assert (scores[..., ~candidates] == 0).all()
    rows = candidates.any(-1)
    torch.testing.assert_close(scores[..., rows, :].sum(-1), torch.ones(1, 2, int(rows.sum())))
    assert (scores[..., ~rows, :] == 0).all()
