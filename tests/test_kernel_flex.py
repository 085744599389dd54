"""The FlexAttention lowering of a PBS mask.

FlexAttention honours block sparsity only when compiled, and compiled FlexAttention needs CUDA, so
on CPU the lowered mask is checked by expanding it to a token mask (full blocks, plus partial
blocks filtered by ``mask_mod``) and running dense masked attention with it. The ``gpu`` tests run
compiled FlexAttention against the reference.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import pbs
from pbs.kernels.flex import flex_block_sparse_attention, split_full_and_partial, to_flex_block_mask
from pbs.reference import block_sparse_attention_reference
from pbs.testing import assert_close_to_reference, make_qkv, relative_error

from tests.test_block_sparse_attn import make_plan
from tests.helpers import assert_max_abs_error_within_torch, assert_plan_output_within_torch


def _token_mask(counts: torch.Tensor, indices: torch.Tensor, block: int, nq: int, nk: int) -> torch.Tensor:
    b, h, tq, tk = indices.shape
    dense = torch.zeros(b, h, tq, tk + 1, dtype=torch.bool)
    listed = torch.where(torch.arange(tk) < counts[..., None].long(), indices.long(), tk)
    dense.scatter_(-1, listed, True)
    return dense[..., :tk].repeat_interleave(block, -2).repeat_interleave(block, -1)[:, :, :nq, :nk]


def _emulate_flex(block_mask, q, k, v) -> torch.Tensor:
    b, h, nq, d = q.shape
    nk = k.shape[2]
    block = block_mask.BLOCK_SIZE[1]
    keep = _token_mask(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, block, nq, nk)
    partial = _token_mask(block_mask.kv_num_blocks, block_mask.kv_indices, block, nq, nk)
    q_idx, kv_idx = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
    for bi in range(b):
        for hi in range(h):
            allowed = block_mask.mask_mod(torch.tensor(bi), torch.tensor(hi), q_idx, kv_idx)
            keep[bi, hi] |= partial[bi, hi] & allowed
    group = h // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    logits = (q @ kk.transpose(-1, -2)) * d**-0.5
    return logits.masked_fill(~keep, float("-inf")).softmax(-1).nan_to_num(0.0) @ vv


@pytest.mark.parametrize(
    "permuter, gqa, causal, seq_len, seq_len_q",
    [
        ("last_block", "shared", True, 256, None),
        ("key_aware_query", "shared", True, 256, None),
        ("random", "per_head", True, 300, 200),
        ("random", "per_head", False, 300, 200),
    ],
)
def test_lowered_mask_means_the_same_attention(permuter, gqa, causal, seq_len, seq_len_q):
    q, k, v = make_qkv(heads_q=4, heads_kv=2, seq_len=seq_len, seq_len_q=seq_len_q, head_dim=32, seed=3)
    plan = make_plan(q, k, permuter=permuter, gqa=gqa, causal=causal, density=0.4)
    qp, kp, vp = plan.query_permutation.apply(q), plan.key_permutation.apply(k), plan.key_permutation.apply(v)
    qpos, kpos = plan.query_positions(), plan.key_positions()
    expected = block_sparse_attention_reference(qp, kp, vp, plan.mask, qpos, kpos, causal=causal)
    block_mask = to_flex_block_mask(
        plan.mask,
        None if plan.query_permutation.is_identity else qpos,
        None if plan.key_permutation.is_identity else kpos,
        causal,
    )
    emulated = _emulate_flex(block_mask, qp, kp, vp)
    assert relative_error(emulated, expected) < 1e-5
    assert_max_abs_error_within_torch(emulated, qp, kp, vp, plan.mask, qpos, kpos, causal)


def test_split_keeps_every_selected_block_once():
    q, k, _ = make_qkv(heads_q=2, heads_kv=1, seq_len=256, head_dim=16)
    plan = make_plan(q, k, block=16, segment=64, density=0.5)
    partial_counts, partial_indices, full_counts, full_indices = split_full_and_partial(plan.mask)
    assert torch.equal(partial_counts + full_counts, plan.mask.counts)
    layout = plan.layout
    rebuilt = _token_mask(partial_counts, partial_indices, 1, layout.num_query_blocks, layout.num_key_blocks)
    rebuilt |= _token_mask(full_counts, full_indices, 1, layout.num_query_blocks, layout.num_key_blocks)
    assert torch.equal(rebuilt, plan.mask.to_dense())
    # Every partial block is on the diagonal (or later), every full block before it.
    assert (partial_counts <= layout.diagonal_blocks().sum(-1)).all()
    # The split is the mask's own (one rule for every backend), not worked out again here.
    assert torch.equal(full_counts, plan.mask.full_counts)
    claimed = dataclasses.replace(plan.mask, full_counts=torch.zeros_like(plan.mask.counts))
    assert torch.equal(split_full_and_partial(claimed)[0], plan.mask.counts)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "gqa, permuter, causal, block, head_dim",
    [
        ("shared", "last_block", True, 128, 128),
        ("per_head", "last_block", True, 128, 64),
        ("shared", "key_aware_query", True, 128, 128),
        ("shared", "random", False, 64, 128),
    ],
)
def test_gpu_flex_matches_reference(gqa, permuter, causal, block, head_dim):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = 2.0 * torch.randn(1, 8, 4096, head_dim, device="cuda", generator=gen)
    k = torch.randn(1, 2, 4096, head_dim, device="cuda", generator=gen)
    v = torch.randn(1, 2, 4096, head_dim, device="cuda", generator=gen)
    plan = make_plan(q, k, block=block, segment=256, permuter=permuter, gqa=gqa, causal=causal, density=0.4)
    qp, kp, vp = plan.query_permutation.apply(q), plan.key_permutation.apply(k), plan.key_permutation.apply(v)
    qpos, kpos = plan.query_positions(), plan.key_positions()
    truth = block_sparse_attention_reference(qp, kp, vp, plan.mask, qpos, kpos, causal=causal)
    rounded = [x.bfloat16().float() for x in (qp, kp, vp)]
    torch_at_dtype = block_sparse_attention_reference(*rounded, plan.mask, qpos, kpos, causal=causal).bfloat16()
    out = flex_block_sparse_attention(
        qp.bfloat16(),
        kp.bfloat16(),
        vp.bfloat16(),
        plan.mask,
        None if plan.query_permutation.is_identity else qpos,
        None if plan.key_permutation.is_identity else kpos,
        causal=causal,
    )
    assert not out.isnan().any()
    assert_close_to_reference(out, torch_at_dtype, truth)
    assert_max_abs_error_within_torch(out, *(x.bfloat16() for x in (qp, kp, vp)), plan.mask, qpos, kpos, causal)


@pytest.mark.gpu
def test_gpu_flex_backend_end_to_end():
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(1, 8 if i == 0 else 2, 2048, 64, device="cuda", generator=gen).bfloat16() for i in range(3))
    config = {"permuter": "last_block", "selector": {"name": "budget", "density": 0.5}}
    expected = pbs.attention(q, k, v, {**config, "backend": "reference"})
    actual, plan = pbs.attention(q, k, v, {**config, "backend": "flex"}, return_plan=True)
    assert relative_error(actual, expected) < 1e-2
    assert_plan_output_within_torch(actual, plan, q, k, v)
