"""Differential tests: the Triton block-sparse kernel against its eager twin.

The kernel gets the reference's own mask and positions, so only attention arithmetic is compared.
Error is judged against PyTorch's error at the same dtype, twice: the relative (Frobenius) error
against the reference on fp32 inputs, where ``torch_at_dtype`` is the reference on inputs rounded
to the test dtype, its output rounded too; and the max-abs error against the truth in float64,
where torch's is that of PyTorch's own matmul-softmax computed in the test dtype
(`tests.helpers.assert_max_abs_error_within_torch`, as flash-attention's tests). Either way the
kernel may be off by at most twice torch's error (plus a small floor).

On CPU the kernel runs in the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so
shapes are tiny and dtypes are fp16/fp32 (the interpreter's bf16 dot products are wrong). The
``gpu`` tests rerun the same checks in bf16 at long lengths.
"""

from __future__ import annotations

import functools

import dataclasses

import pytest
import torch

import pbs
from pbs.backends import CallSpec, resolve_backend
from pbs.backends.eligibility import triton_kernel_reasons
from pbs.config import PBSConfig
from pbs.kernels.block_sparse_attn import KernelConfig, block_sparse_attention, candidate_configs
from pbs.reference.block_sets import finalize_selection
from pbs.reference import block_sparse_attention_reference
from pbs.testing import assert_close_to_reference, make_qkv
from pbs.types import BlockMask, Plan
from tests.helpers import assert_max_abs_error_within_torch, assert_plan_output_within_torch

# Every interpreted launch here has its addresses checked (tests/interpreter_bounds.py).
pytestmark = pytest.mark.usefixtures("checked_addresses")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    block: int = 32,
    segment: int = 64,
    permuter: str = "last_block",
    gqa: str = "shared",
    causal: bool = True,
    density: float = 0.4,
) -> Plan:
    config = PBSConfig(
        block_size=block,
        segment_size=segment,
        permuter=permuter,
        selector={"name": "budget", "density": density},
        gqa=gqa,
        causal=causal,
        backend="reference",
        check_finite=False,
    )
    return pbs.plan(q, k, config)


def check_kernel(
    plan: Plan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dtype: torch.dtype,
    mask: BlockMask | None = None,
    config: KernelConfig | None = None,
    kernel: str = "triton",
) -> torch.Tensor:
    """Runs the kernel on NaN-poisoned output and compares it with the reference; returns the output.

    ``kernel="hopper"`` runs the warp-specialized Gluon kernel instead (GPU only)."""
    mask = plan.mask if mask is None else mask
    causal = plan.layout.causal
    qp = plan.query_permutation.apply(q).float()
    kp = plan.key_permutation.apply(k).float()
    vp = plan.key_permutation.apply(v).float()
    qpos, kpos = plan.query_positions(), plan.key_positions()
    truth = block_sparse_attention_reference(qp, kp, vp, mask, qpos, kpos, causal=causal)
    rounded = [x.to(dtype).float() for x in (qp, kp, vp)]
    torch_at_dtype = block_sparse_attention_reference(*rounded, mask, qpos, kpos, causal=causal).to(dtype)

    if config is None and q.is_cuda and kernel == "triton":
        # One config per test keeps GPU compile time down; test_gpu_every_candidate covers the rest.
        config = candidate_configs(dtype, max(16, 1 << (max(q.shape[-1], v.shape[-1]) - 1).bit_length()), False)[0]
    out = torch.full((*q.shape[:3], v.shape[-1]), float("nan"), dtype=dtype, device=q.device)
    if kernel == "hopper":
        from pbs.kernels.hopper_attn import hopper_block_sparse_attention as launch
    else:
        launch = functools.partial(block_sparse_attention, config=config)
    launch(
        qp.to(dtype),
        kp.to(dtype),
        vp.to(dtype),
        mask,
        query_positions=None if plan.query_permutation.is_identity else qpos,
        key_positions=None if plan.key_permutation.is_identity else kpos,
        causal=causal,
        out=out,
    )
    assert not out.isnan().any(), "some output element was never written (or is NaN)"
    assert_close_to_reference(out, torch_at_dtype, truth)
    inputs = [x.to(dtype) for x in (qp, kp, vp)]
    del qp, kp, vp, truth, rounded, torch_at_dtype  # 5.5 GiB at 64K x 32 heads, before the float64 check
    assert_max_abs_error_within_torch(out, *inputs, mask, qpos, kpos, causal)
    return out


def test_max_abs_rule_catches_one_wrong_element_that_the_frobenius_rule_misses():
    q, k, v = make_qkv(heads_q=4, heads_kv=2, seq_len=256, head_dim=32, seed=1)
    plan = make_plan(q, k, density=0.6)
    exact = [plan.query_permutation.apply(q), plan.key_permutation.apply(k), plan.key_permutation.apply(v)]
    qp, kp, vp = (x.half() for x in exact)
    qpos, kpos = plan.query_positions(), plan.key_positions()
    truth = block_sparse_attention_reference(*exact, plan.mask, qpos, kpos)
    # fp32 arithmetic on the fp16 inputs, rounded once: as good as a kernel can be.
    good = block_sparse_attention_reference(qp.float(), kp.float(), vp.float(), plan.mask, qpos, kpos).half()
    assert_max_abs_error_within_torch(good, qp, kp, vp, plan.mask, qpos, kpos)
    bad = good.clone()
    bad[0, 1, 100, 5] += 0.05  # one element off, e.g. one padded key let through in one row
    assert_close_to_reference(bad, good, truth)  # lost in the norm of 32768 elements
    with pytest.raises(AssertionError, match="max-abs error"):
        assert_max_abs_error_within_torch(bad, qp, kp, vp, plan.mask, qpos, kpos)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("density", [0.2, 0.6, 1.0])
def test_budget_masks_shared_gqa(density, dtype):
    q, k, v = make_qkv(heads_q=4, heads_kv=2, seq_len=256, head_dim=32, seed=1, device=DEVICE)
    plan = make_plan(q, k, density=density)
    check_kernel(plan, q, k, v, dtype)


@pytest.mark.parametrize("permuter", ["random", "last_block"])
def test_per_head_gqa_with_cached_prefix(permuter):
    # Nq < Nk, neither a multiple of the block: partial last key block and a partial query tile.
    q, k, v = make_qkv(heads_q=4, heads_kv=2, seq_len=300, seq_len_q=150, head_dim=32, seed=2, device=DEVICE)
    plan = make_plan(q, k, permuter=permuter, gqa="per_head", density=0.5)
    assert plan.key_positions().shape[1] == 4
    check_kernel(plan, q, k, v, torch.float16)


def test_permuted_queries_small_blocks():
    q, k, v = make_qkv(heads_q=2, heads_kv=1, seq_len=192, head_dim=16, seed=3, device=DEVICE)
    plan = make_plan(q, k, block=16, segment=32, permuter="key_aware_query", density=0.5)
    assert not plan.query_permutation.is_identity
    check_kernel(plan, q, k, v, torch.float16)


@pytest.mark.parametrize("permuter", ["identity", "random"])
def test_non_causal(permuter):
    q, k, v = make_qkv(heads_q=2, heads_kv=2, seq_len=200, head_dim=32, seed=4, device=DEVICE)
    plan = make_plan(q, k, permuter=permuter, causal=False, density=0.5)
    check_kernel(plan, q, k, v, torch.float16)


@pytest.mark.parametrize("block, seq_len, seq_len_q", [(128, 384, 384), (64, 320, 100)])
def test_tiles_smaller_than_mask_blocks(block, seq_len, seq_len_q):
    # The interpreter's tile is 64x64: a 128 mask block is two query tiles and two key sub-tiles.
    q, k, v = make_qkv(heads_q=2, heads_kv=1, seq_len=seq_len, seq_len_q=seq_len_q, head_dim=64, seed=5, device=DEVICE)
    plan = make_plan(q, k, block=block, segment=2 * block, density=0.7)
    check_kernel(plan, q, k, v, torch.float16)


@pytest.mark.parametrize("causal", [True, False])
def test_random_dense_masks(causal):
    """Arbitrary masks, future blocks and empty rows included; long masked tails hit the full scan."""
    q, k, v = make_qkv(heads_q=4, heads_kv=2, seq_len=240, head_dim=32, seed=6, device=DEVICE)
    plan = make_plan(q, k, block=16, segment=32, permuter="random", causal=causal)
    layout = plan.layout
    gen = torch.Generator().manual_seed(0)
    dense = torch.rand(layout.batch, layout.heads_q, layout.num_query_blocks, layout.num_key_blocks, generator=gen) < 0.7
    dense[:, 0, 3] = False  # a query block that selects nothing
    mask = BlockMask.from_dense(dense.to(q.device), layout)
    out = check_kernel(plan, q, k, v, torch.float16, mask=mask)
    assert out[:, 0, 3 * 16 : 4 * 16].abs().max() == 0


@pytest.mark.parametrize("permuter", ["random", "key_aware_query"])
def test_kernel_reads_the_masks_split(permuter):
    """The kernel takes the unmasked/masked split from ``mask.full_counts`` and works out nothing
    itself: claiming every block is full drops the per-token check (the result is then attention
    over the selected blocks with no causality at all), claiming none is full costs only time."""
    # Nk a multiple of the block: no padded key slots, so "no check" is exactly non-causal.
    q, k, v = make_qkv(heads_q=2, heads_kv=1, seq_len=256, head_dim=32, seed=11, device=DEVICE)
    plan = make_plan(q, k, permuter=permuter, density=1.0)
    mask = plan.mask
    assert (mask.full_counts < mask.counts).all()  # every query block has an on-diagonal tail
    qp, kp, vp = plan.query_permutation.apply(q), plan.key_permutation.apply(k), plan.key_permutation.apply(v)
    qpos, kpos = plan.query_positions(), plan.key_positions()
    positions = dict(
        query_positions=None if plan.query_permutation.is_identity else qpos,
        key_positions=None if plan.key_permutation.is_identity else kpos,
    )

    def run(m):
        return block_sparse_attention(qp.half(), kp.half(), vp.half(), m, **positions).float()

    causal = block_sparse_attention_reference(qp, kp, vp, mask, qpos, kpos, causal=True)
    unchecked = block_sparse_attention_reference(qp, kp, vp, mask, qpos, kpos, causal=False)
    assert pbs.testing.relative_error(run(mask), causal) < 5e-3
    all_full = dataclasses.replace(mask, full_counts=mask.counts.clone())
    out = run(all_full)
    assert pbs.testing.relative_error(out, unchecked) < 5e-3
    assert pbs.testing.relative_error(out, causal) > 0.05
    none_full = dataclasses.replace(mask, full_counts=torch.zeros_like(mask.counts))
    assert pbs.testing.relative_error(run(none_full), causal) < 5e-3


def test_causal_run_of_a_non_causal_mask_is_refused():
    q, k, v = make_qkv(heads_q=2, heads_kv=1, seq_len=128, head_dim=16, seed=12, device=DEVICE)
    plan = make_plan(q, k, block=16, segment=32, causal=False)
    with pytest.raises(ValueError, match="causal=True needs a mask built for causal attention"):
        block_sparse_attention(q.half(), k.half(), v.half(), plan.mask, causal=True)


def test_finalized_random_selection_batch_two():
    q, k, v = make_qkv(batch=2, heads_q=2, heads_kv=1, seq_len=256, head_dim=32, seed=7, device=DEVICE)
    plan = make_plan(q, k, permuter="random")
    layout = plan.layout
    gen = torch.Generator().manual_seed(1)
    selected = (torch.rand(2, 2, layout.num_query_blocks, layout.num_key_blocks, generator=gen) < 0.3).to(DEVICE)
    mask = finalize_selection(selected, layout, plan.key_positions(), force_sink_block=True)
    check_kernel(plan, q, k, v, torch.float16, mask=mask)


def test_value_head_dim_and_strided_inputs():
    q, k, _ = make_qkv(heads_q=2, heads_kv=1, seq_len=128, head_dim=32, seed=8, device=DEVICE)
    plan = make_plan(q, k, permuter="identity", density=1.0)
    v = torch.randn(1, 1, 128, 16, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    # q in (B, N, H, D) memory, seen as (B, H, N, D): the kernel reads strides, no copy needed.
    q_strided = q.transpose(1, 2).contiguous().transpose(1, 2)
    check_kernel(plan, q_strided, k, v, torch.float16)


def test_rows_without_keys_are_zero_not_nan():
    q, k, v = make_qkv(heads_q=2, heads_kv=1, seq_len=128, head_dim=16, seed=9, device=DEVICE)
    plan = make_plan(q, k, block=16, segment=32)
    empty = BlockMask.from_dense(torch.zeros_like(plan.mask.to_dense()), plan.layout)
    out = block_sparse_attention(q.half(), k.half(), v.half(), empty)
    assert out.abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_end_to_end_matches_reference_backend(dtype):
    q, k, v = make_qkv(heads_q=4, heads_kv=2, seq_len=256, head_dim=32, seed=10, dtype=dtype, device=DEVICE)
    # last_block, named: permuted positions are what the kernel must get right.
    config = {"block_size": 32, "segment_size": 64, "permuter": "last_block",
              "selector": {"name": "budget", "density": 0.5}}
    expected = pbs.attention(q, k, v, {**config, "backend": "reference"})
    actual, plan = pbs.attention(q, k, v, {**config, "backend": "triton"}, return_plan=True)
    assert actual.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert pbs.testing.relative_error(actual, expected) < tol
    assert_plan_output_within_torch(actual, plan, q, k, v)


def _spec(q, k, v) -> CallSpec:
    return CallSpec.of(q, v.shape[-1], 32)


def test_support_reasons(monkeypatch):
    q, k, v = make_qkv(heads_q=2, heads_kv=1, seq_len=64, head_dim=32, device=DEVICE)
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert any("not CUDA" in r for r in triton_kernel_reasons(_spec(q, k, v)))
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert triton_kernel_reasons(_spec(q.half(), k.half(), v.half())) == []
        assert any("bfloat16" in r for r in triton_kernel_reasons(_spec(q.bfloat16(), k.bfloat16(), v.bfloat16())))
        # The interpreter runs when named, but auto keeps CPU tensors on the reference path.
        assert resolve_backend("triton", _spec(q.half(), k.half(), v.half())).name == "triton"
        assert resolve_backend("auto", _spec(q.half(), k.half(), v.half())).name == "reference"
    wide = torch.zeros(1, 2, 64, 264)
    assert any("larger than 256" in r for r in triton_kernel_reasons(_spec(wide, wide[:, :1], wide[:, :1])))
    odd = torch.zeros(1, 2, 64, 20, dtype=torch.float16)
    assert any("multiple of 8" in r for r in triton_kernel_reasons(_spec(odd, odd[:, :1], odd[:, :1])))


def test_interpreter_tunes_nothing():
    assert len(candidate_configs(torch.float16, 128, interpret=True)) == 1
    assert len(candidate_configs(torch.bfloat16, 256, interpret=False)) > 1
    assert KernelConfig(128, 128, 8, 2).fitted(64) == KernelConfig(64, 64, 8, 2)


# ---------------------------------------------------------------------------------------------
# GPU: the same checks in bf16 at long lengths (run by scripts/gpu_check.sh).


def _gpu_inputs(batch, heads_q, heads_kv, seq_len, head_dim, seq_len_q=None, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    nq = seq_len if seq_len_q is None else seq_len_q
    # Peaked attention (large logits) stresses the running max and rescaling.
    q = 2.0 * torch.randn(batch, heads_q, nq, head_dim, device="cuda", generator=gen)
    k = torch.randn(batch, heads_kv, seq_len, head_dim, device="cuda", generator=gen)
    v = torch.randn(batch, heads_kv, seq_len, head_dim, device="cuda", generator=gen)
    return q, k, v


@pytest.mark.gpu
@pytest.mark.parametrize(
    "seq_len, seq_len_q, heads_q, heads_kv, head_dim, gqa, permuter, density",
    [
        (65536, None, 32, 8, 128, "shared", "last_block", 0.3),
        (16384 + 100, 4096 + 37, 32, 8, 128, "per_head", "last_block", 0.5),
        (8192, None, 8, 2, 64, "shared", "key_aware_query", 0.3),
        (8192 + 64, None, 8, 2, 96, "shared", "random", 0.3),
        (8192, None, 8, 2, 256, "per_head", "last_block", 0.3),
    ],
)
def test_gpu_bf16_long(seq_len, seq_len_q, heads_q, heads_kv, head_dim, gqa, permuter, density):
    q, k, v = _gpu_inputs(1, heads_q, heads_kv, seq_len, head_dim, seq_len_q)
    plan = make_plan(q, k, block=128, segment=256, permuter=permuter, gqa=gqa, density=density)
    check_kernel(plan, q, k, v, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_batch_and_blocks(block, causal):
    q, k, v = _gpu_inputs(2, 8, 2, 4096 + 17, 128)
    plan = make_plan(q, k, block=block, segment=256, permuter="last_block", causal=causal, density=0.4)
    check_kernel(plan, q, k, v, torch.bfloat16)
    check_kernel(plan, q, k, v, torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_every_candidate(head_dim):
    q, k, v = _gpu_inputs(1, 8, 2, 4096 + 64, head_dim)
    plan = make_plan(q, k, block=128, segment=256, density=0.4)
    for config in candidate_configs(torch.bfloat16, head_dim, interpret=False):
        check_kernel(plan, q, k, v, torch.bfloat16, config=config)


@pytest.mark.gpu
def test_gpu_fp32_and_end_to_end():
    q, k, v = _gpu_inputs(1, 8, 2, 2048, 64)
    plan = make_plan(q, k, block=64, segment=128, density=0.5)
    check_kernel(plan, q, k, v, torch.float32)
    # A permuter and selector whose draws do not depend on the planning backend, and no dense
    # fallback (2K tokens is below its default crossover), so both calls compute the same plan.
    config = {
        "permuter": "random", "selector": {"name": "budget", "density": 0.5},
        "dense_fallback": {"min_seq_len": 0, "max_density": None},
    }
    qb, kb, vb = (x.bfloat16() for x in (q, k, v))
    expected = pbs.attention(qb, kb, vb, {**config, "backend": "reference"})
    actual, plan = pbs.attention(qb, kb, vb, {**config, "backend": "auto"}, return_plan=True)
    assert pbs.testing.relative_error(actual, expected) < 1e-2
    assert_plan_output_within_torch(actual, plan, qb, kb, vb)
