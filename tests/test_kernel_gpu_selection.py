"""GPU only: the real CUDA planning path (the ``triton`` last_block permuter and selectors that
``pbs.plan`` uses on CUDA) against the reference planning and the paper's algorithms.

* :func:`test_gpu_plan_matches_reference`: fp32 and bf16, a few thousand tokens, batch 2, GQA; the
  key order must be the reference's (up to near-tied scores), and the mask must be the reference
  selector's on the same (bf16) inputs and permutation, identical as sets up to float near-ties
  at the cut (:func:`tests.planning_helpers.assert_same_selection`);
* :func:`test_gpu_planning_and_attention_follow_the_paper`: fp32, ``Nq == Nk``; the plan against the
  independent transcriptions of Eq. 3, Algorithm 2 and XAttention's estimator in
  tests/test_paper_algorithms.py, and ``pbs.attention``'s output within 1e-3 of a float64 masked
  attention over the plan's blocks.

Skipped without CUDA (tests/conftest.py); run them with ``bash scripts/gpu_check.sh tests``.
"""

from __future__ import annotations

import math

import pytest
import torch

import pbs
from pbs.components import PermutationInputs, SelectionInputs
from pbs.planning import make_layout
from pbs.selectors.antidiagonal import antidiagonal_block_scores
from tests.planning_helpers import (
    assert_same_key_order,
    assert_same_selection,
    reference_key_scores,
    reference_mask,
    reference_scores,
)
from tests.test_paper_algorithms import (
    algorithm_2,
    block_may_be_needed,
    causal_block_mask_c,
    eq3_key_order,
    expand_blocks,
    masked_attention,
    pooled,
    segment_blocks,
    xattention_estimate,
)

pytestmark = pytest.mark.gpu

BLOCK, SEGMENT, STRIDE = 128, 256, 8
N = 3000  # a partial last segment of 184 keys and a partial last block of 56
TOL = {torch.float32: dict(atol=1e-6, rtol=1e-5), torch.bfloat16: dict(atol=1e-6, rtol=1e-4)}

COMBOS = {
    # name: (permuter, selector, gqa)
    "last_block-mean_pool": ("last_block", "mean_pool", "per_head"),
    "last_block-mean_pool-shared": ("last_block", "mean_pool", "shared"),
    "causal_scoring-mean_pool": ({"name": "last_block", "causal_scoring": True}, "mean_pool", "per_head"),
    "none-mean_pool": ("none", "mean_pool", "shared"),
    "none-antidiagonal": ("none", "antidiagonal", "shared"),
    "last_block-antidiagonal": ("last_block", "antidiagonal", "per_head"),
    "none-sampled_rows": ("none", {"name": "sampled_rows", "rows_per_block": 4}, "shared"),
    "last_block-sampled_rows": ("last_block", {"name": "sampled_rows", "rows_per_block": 8}, "per_head"),
}


def _config(combo: str, threshold: float = 0.9, **extra) -> pbs.PBSConfig:
    permuter, selector, gqa = COMBOS[combo]
    sel = selector if isinstance(selector, dict) else {"name": selector}
    sel = {**sel, "threshold": threshold, **({"stride": STRIDE} if sel["name"] == "antidiagonal" else {})}
    return pbs.PBSConfig(
        block_size=BLOCK, segment_size=SEGMENT, permuter=permuter, selector=sel, gqa=gqa, backend="triton", **extra
    )


@pytest.mark.parametrize(
    "seq_len, seq_len_q, dtype",
    [(N, None, torch.float32), (N, None, torch.bfloat16), (N, 1000, torch.float32), (N, 1000, torch.bfloat16),
     (8192, None, torch.bfloat16)],
    ids=["prefill-fp32", "prefill-bf16", "chunk-fp32", "chunk-bf16", "8k-bf16"],
)
@pytest.mark.parametrize("combo", list(COMBOS))
def test_gpu_plan_matches_reference(combo, seq_len, seq_len_q, dtype):
    # With 1000 queries after 2000 cached keys the offset is not a multiple of the block.
    q, k, _ = pbs.testing.make_qkv(
        batch=2, heads_q=4, heads_kv=2, seq_len=seq_len, seq_len_q=seq_len_q, head_dim=128, dtype=dtype,
        device="cuda", seed=3,
    )
    config = _config(combo)
    scale = q.shape[-1] ** -0.5
    fast = pbs.plan(q, k, config)
    reference = pbs.plan(q, k, config.model_copy(update={"backend": "reference"}))
    layout = fast.layout
    assert layout.segmented == (config.permuter.name != "none")

    # The key order (scores of the reference, on the same inputs).
    if config.permuter.name == "last_block":
        perm_inputs = PermutationInputs(q=q, k=k, layout=layout, gqa=config.gqa, scale=scale)
        causal = config.permuter.causal_scoring
        scores = reference_key_scores(perm_inputs, causal)[..., : layout.permutable_key_len]
        assert_same_key_order(fast.key_permutation, reference.key_permutation, scores, rtol=TOL[dtype]["rtol"])
    else:
        assert fast.key_permutation.is_identity and reference.key_permutation.is_identity

    # The mask: the reference selector on the same inputs and the fast plan's own permutation.
    q_perm = fast.query_permutation.apply(q)
    inputs = SelectionInputs(
        q_perm, fast.key_permutation.apply(k), layout, fast.query_positions(), fast.key_positions(), scale
    )
    expected = reference_mask(config.selector, inputs)
    block_scores, candidates, first = reference_scores(config.selector, inputs)
    assert_same_selection(
        fast.mask, expected, block_scores, candidates, config.selector.threshold, ranked_first=first, **TOL[dtype]
    )
    if torch.equal(fast.key_permutation.indices, reference.key_permutation.indices):
        assert_same_selection(
            fast.mask, reference.mask, block_scores, candidates, config.selector.threshold, ranked_first=first,
            **TOL[dtype],
        )
    assert abs(fast.density - reference.density) < 0.01


def _algorithm_2_scores(q_perm: torch.Tensor, k_perm: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Algorithm 2's pooled softmax over ``C`` in float64, for explaining near-ties (rows without
    candidates are zero)."""
    logits = pooled(q_perm, BLOCK) @ pooled(k_perm, BLOCK).T / math.sqrt(q_perm.shape[-1])
    return torch.softmax(logits.masked_fill(~c, float("-inf")), dim=-1).nan_to_num(0.0)


@pytest.mark.parametrize(
    "combo", ["last_block-mean_pool", "none-mean_pool", "none-antidiagonal", "last_block-antidiagonal"]
)
@pytest.mark.parametrize("threshold", [0.9, 0.95])
def test_gpu_planning_and_attention_follow_the_paper(combo, threshold):
    q, k, v = pbs.testing.make_qkv(batch=1, heads_q=4, heads_kv=2, seq_len=N, head_dim=64, device="cuda", seed=4)
    config = _config(combo, threshold=threshold)
    out, plan = pbs.attention(q, k, v, config, return_plan=True)
    assert plan is not None and plan.fallback is None
    dense = plan.mask.to_dense().cpu()
    positions = plan.key_positions().cpu()
    qc, kc, vc = q.cpu(), k.cpu(), v.cpu()
    nb = -(-N // BLOCK)
    segmented = config.permuter.name != "none"
    group = q.shape[1] // k.shape[1]
    if config.selector.name == "antidiagonal":
        layout = make_layout(q, k, config)
        inputs = SelectionInputs(q, plan.key_permutation.apply(k), layout, plan.query_positions(), plan.key_positions(),
                                 q.shape[-1] ** -0.5)
        library_scores = antidiagonal_block_scores(inputs, STRIDE).cpu()
    for h in range(q.shape[1]):
        kv = h // group
        order = positions[0, h if positions.shape[1] == q.shape[1] else kv]
        if segmented:
            # Eq. 3-4: the plan's order sorts each full segment by the transcription's scores.
            eq3_order, eq3_scores = eq3_key_order(qc[0, h], kc[0, kv], BLOCK, SEGMENT)
            differ = order != eq3_order
            assert torch.allclose(eq3_scores.float()[order[differ]], eq3_scores.float()[eq3_order[differ]],
                                  rtol=1e-5, atol=0), "the key order is not Eq. 3's"
        else:
            assert torch.equal(order, torch.arange(N))
        c = causal_block_mask_c(nb, SEGMENT // BLOCK if segmented else 1, segmented)
        if config.selector.name == "mean_pool":
            selected = algorithm_2(qc[0, h], kc[0, kv][order], c, BLOCK, threshold)
            scores = _algorithm_2_scores(qc[0, h], kc[0, kv][order], c)
            if segmented:
                sink = torch.zeros(nb, nb, dtype=torch.bool)
                sink[:, int((order == 0).nonzero()) // BLOCK] = True
                needed = block_may_be_needed(order, BLOCK)
                expected = (selected | segment_blocks(nb, SEGMENT // BLOCK) | sink) & needed
                assert_same_selection(dense[0, h] & needed, expected, scores, c, threshold, atol=1e-6, rtol=1e-5)
            else:
                expected = selected | torch.eye(nb, dtype=torch.bool)
                expected[:, 0] = True
                assert_same_selection(dense[0, h], expected, scores, c, threshold, atol=1e-6, rtol=1e-5)
        elif not segmented:
            # XAttention's estimator: forced sink and diagonal blocks rank first.
            expected = xattention_estimate(qc[0, h], kc[0, kv], BLOCK, STRIDE, threshold)
            forced = torch.eye(nb, dtype=torch.bool)
            forced[:, 0] = True
            assert_same_selection(dense[0, h], expected, library_scores[0, h], c, threshold, ranked_first=forced,
                                  atol=1e-6, rtol=1e-5)
        # (last_block + antidiagonal has no transcription of its selection: test_gpu_plan_matches_reference.)
        # Attention over the plan's blocks, causal on original positions, in float64.
        want = masked_attention(qc[0, h], kc[0, kv], vc[0, kv], order, expand_blocks(dense[0, h], N, BLOCK))
        torch.testing.assert_close(out[0, h].cpu().double(), want, atol=1e-3, rtol=0)
