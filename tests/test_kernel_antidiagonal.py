"""Differential tests: the Triton antidiagonal block-share kernel against its eager twin.

Truth is :func:`pbs.selectors.antidiagonal.antidiagonal_block_scores` on the permuted tensors: for
a segmented layout the strided softmax sees only the candidate blocks (allowed minus the on-diagonal
segment, the partial last segment included), for an unsegmented one (the ``none`` permuter,
XAttention's estimator) the allowed blocks under a strided causal mask. The kernel's defaults
(``allowed=None``, ``strided_causal=None``) follow the layout the same way. On CPU the kernel runs
in the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so shapes are tiny and
dtypes are fp32/fp16 (the interpreter's bf16 dot products are wrong); the ``gpu`` test reruns the
check in bf16 at a longer length. Each check runs both walks of the kernel (two passes, and one pass
with per-row partial sums in scratch, the default within its scratch budget). Every output buffer is NaN-poisoned first, so a block that the
kernel forgets to write fails the comparison.
"""

from __future__ import annotations

import pytest
import torch

import pbs
from pbs.components import SelectionInputs
from pbs.kernels.antidiagonal import antidiagonal_block_shares
from pbs.layout import Layout
from pbs.permuters._segments import sort_within_segments
from pbs.planning import make_layout
from pbs.selectors.antidiagonal import antidiagonal_block_scores
from pbs.testing import make_qkv
from pbs.types import Permutation

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class _CustomCandidatesInputs(SelectionInputs):
    """Selection inputs whose candidate blocks (the strided softmax's block mask of a segmented
    layout) are given, not derived from the layout."""

    def __init__(self, *args, candidates: torch.Tensor, **kwargs):
        super().__init__(*args, **kwargs)
        self._candidates = candidates

    def candidate_blocks(self) -> torch.Tensor:
        return self._candidates


def segment_shuffle(batch: int, heads: int, length: int, lo: int, hi: int, segment: int, seed: int) -> Permutation:
    """A random permutation that moves tokens only inside the full segments of ``[lo, hi)``."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(batch, heads, length, generator=gen)
    return Permutation.from_indices(sort_within_segments(scores, lo, hi, segment))


def reference(q, k_perm, layout, stride, scale, candidates=None) -> torch.Tensor:
    """The eager shares of ``q (B, Hq, Nq, D)`` and permuted ``k_perm (B, Hk, Nk, D)``, fp32."""
    b, hq, nq, _ = q.shape
    hk, nk = k_perm.shape[1], k_perm.shape[2]
    args = dict(
        q=q.float(),
        k=k_perm.float(),
        layout=layout,
        # The reference does not read positions; give plausible ones.
        query_positions=(torch.arange(nq, device=q.device) + layout.query_offset).expand(b, hq, nq),
        key_positions=torch.arange(nk, device=q.device).expand(b, hk, nk),
        scale=scale,
    )
    inputs = SelectionInputs(**args) if candidates is None else _CustomCandidatesInputs(**args, candidates=candidates)
    return antidiagonal_block_scores(inputs, stride)


def run_kernel(q, k, layout, stride, scale, head_start=0, head_stop=None, **kwargs) -> torch.Tensor:
    """The kernel on a NaN-poisoned output buffer, in two passes; the one-pass walk (in launches
    of three programs, so that scratch slots are reused) must give the same shares."""
    stop = q.shape[1] if head_stop is None else head_stop
    shape = (q.shape[0], stop - head_start, layout.num_query_blocks, layout.num_key_blocks)
    results = []
    for one_pass in (False, True):
        out = torch.full(shape, float("nan"), device=q.device)
        got = antidiagonal_block_shares(q, k, layout, stride, scale, head_start=head_start, head_stop=head_stop,
                                        out=out, one_pass=one_pass, programs_per_launch=3, **kwargs)
        assert got is out
        assert not got.isnan().any(), f"some output element was not written (one_pass={one_pass})"
        results.append(got)
    torch.testing.assert_close(results[1], results[0], atol=2e-6, rtol=1e-5)
    return results[0]


def workload(heads_q=4, heads_kv=2, seq_len=200, seq_len_q=None, head_dim=32, dtype=torch.float32, batch=2, seed=0):
    q, k, _ = make_qkv(
        batch, heads_q, heads_kv, seq_len, head_dim, seq_len_q=seq_len_q, slash_offsets=(16, 64), seed=seed,
        dtype=dtype, device=DEVICE,
    )
    return q, k


def _segmented(q, k, block, segment, causal=True):
    # The paper's permuter, named: the layout's segmentation comes from the permuter.
    config = pbs.PBSConfig(block_size=block, segment_size=segment, permuter="last_block", causal=causal)
    layout = make_layout(q, k, config)
    assert layout.segmented and layout.segment_size == segment
    return layout


@pytest.mark.parametrize(
    "block,stride",
    [(32, 4), (32, 8), (32, 16), (64, 4), (64, 8), (64, 16)],
)
def test_matches_reference_fp32_gqa(block, stride):
    # GQA 4:2, batch 2, 200 keys (not a multiple of the block), causal prefill.
    q, k = workload()
    layout = _segmented(q, k, block, 2 * block)
    scale = q.shape[-1] ** -0.5
    got = run_kernel(q, k, layout, stride, scale)
    torch.testing.assert_close(got, reference(q, k, layout, stride, scale), atol=1e-5, rtol=0)


@pytest.mark.parametrize("nq", [37, 90])
def test_fewer_queries_than_keys_mha(nq):
    # Hk == Hq; the queries are the last nq of 230 positions (neither a multiple of the block).
    q, k = workload(heads_q=2, heads_kv=2, seq_len=230, seq_len_q=nq, seed=1)
    layout = _segmented(q, k, 32, 64)
    scale = 0.3
    got = run_kernel(q, k, layout, 8, scale)
    torch.testing.assert_close(got, reference(q, k, layout, 8, scale), atol=1e-5, rtol=0)


def test_fp16_fewer_queries():
    q, k = workload(seq_len=256, seq_len_q=150, dtype=torch.float16, seed=2)
    layout = _segmented(q, k, 64, 128)
    scale = q.shape[-1] ** -0.5
    got = run_kernel(q, k, layout, 8, scale)
    # fp16 products are exact in fp32 on both sides; only the order of the sums differs.
    torch.testing.assert_close(got, reference(q, k, layout, 8, scale), atol=1e-4, rtol=0)


@pytest.mark.parametrize("per_head", [True, False], ids=["per_head", "shared"])
def test_key_indices_equal_permuted_keys(per_head):
    # Segmented permutations of keys and queries: k read through key_indices (original order,
    # Hkv = 2 heads) must give what the gathered permuted copy gives, and both the reference.
    q, k = workload(seq_len=224, seq_len_q=192, seed=3)
    b, hq, nq, _ = q.shape
    layout = _segmented(q, k, 32, 64)
    hk = hq if per_head else k.shape[1]
    key_perm = segment_shuffle(b, hk, layout.seq_len_k, 0, layout.permutable_key_len, 64, seed=4)
    q_lo, q_hi = layout.permutable_query_range
    query_perm = segment_shuffle(b, hq, nq, q_lo, q_hi, 64, seed=5)
    assert not torch.equal(key_perm.indices, torch.arange(layout.seq_len_k).expand_as(key_perm.indices))
    q_perm, k_perm = query_perm.apply(q), key_perm.apply(k)
    scale = q.shape[-1] ** -0.5
    via_indices = run_kernel(q_perm, k, layout, 8, scale, key_indices=key_perm.indices.to(DEVICE))
    via_copy = run_kernel(q_perm, k_perm, layout, 8, scale)
    torch.testing.assert_close(via_indices, via_copy, atol=1e-6, rtol=0)
    torch.testing.assert_close(via_indices, reference(q_perm, k_perm, layout, 8, scale), atol=1e-5, rtol=0)


def test_plan_permutation_and_head_range():
    # A real plan (last_block permuter, per-head GQA), query heads [1, 3) only.
    q, k = workload(seq_len=256, seed=6)
    config = pbs.PBSConfig(
        block_size=32, segment_size=64, permuter="last_block", gqa="per_head", backend="reference", check_finite=False
    )
    plan = pbs.plan(q, k, config)
    q_perm, k_perm = plan.query_permutation.apply(q), plan.key_permutation.apply(k)
    scale = q.shape[-1] ** -0.5
    got = run_kernel(q_perm, k, plan.layout, 4, scale, head_start=1, head_stop=3, key_indices=plan.key_positions())
    want = reference(q_perm, k_perm, plan.layout, 4, scale)[:, 1:3]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("head_start,head_stop", [(0, 1), (3, 4)])
def test_head_range_shared_kv(head_start, head_stop):
    q, k = workload(seq_len=160, seed=7)
    layout = _segmented(q, k, 32, 64)
    got = run_kernel(q, k, layout, 8, 0.2, head_start=head_start, head_stop=head_stop)
    want = reference(q, k, layout, 8, 0.2)[:, head_start:head_stop]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_non_causal():
    q, k = workload(seq_len=200, seq_len_q=100, seed=8)
    layout = _segmented(q, k, 64, 128, causal=False)
    scale = q.shape[-1] ** -0.5
    got = run_kernel(q, k, layout, 16, scale)
    torch.testing.assert_close(got, reference(q, k, layout, 16, scale), atol=1e-5, rtol=0)


def test_custom_allowed_with_empty_rows_and_small_steps():
    # Rows that start late, have holes or see nothing; several query blocks per program and one
    # key block per step, so the zero-filled ranges before and after the walk are exercised.
    q, k = workload(heads_q=2, heads_kv=1, seq_len=288, seed=9)
    layout = _segmented(q, k, 32, 64)
    gen = torch.Generator().manual_seed(10)
    allowed = torch.rand(layout.num_query_blocks, layout.num_key_blocks, generator=gen) < 0.4
    allowed[2] = False
    allowed[3, :4] = False
    allowed[5] = False
    allowed[5, 6] = True
    allowed = allowed.to(DEVICE)
    scale = q.shape[-1] ** -0.5
    want = reference(q, k, layout, 4, scale, candidates=allowed)
    # Stride 4: eight strided rows per block, so (4, 2) is 32 rows x 16 keys per step.
    for qb_per, kb_per in [(4, 2), (2, 4)]:
        got = run_kernel(
            q, k, layout, 4, scale, allowed=allowed, query_blocks_per_program=qb_per, key_blocks_per_step=kb_per
        )
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (got[:, :, 2] == 0).all()


def test_per_block_not_a_power_of_two():
    # block 48, stride 16: three strided rows per block, padded to four inside the kernel.
    q, k = workload(heads_q=2, heads_kv=1, seq_len=200, seq_len_q=170, seed=11)
    layout = Layout(batch=2, heads_q=2, heads_kv=1, seq_len_q=170, seq_len_k=200, block_size=48, segment_size=96)
    scale = q.shape[-1] ** -0.5
    got = run_kernel(q, k, layout, 16, scale)
    torch.testing.assert_close(got, reference(q, k, layout, 16, scale), atol=1e-5, rtol=0)


def _unsegmented(q, k, block, causal=True):
    layout = make_layout(q, k, pbs.PBSConfig(block_size=block, segment_size=2 * block, permuter="none", causal=causal))
    assert not layout.segmented and layout.segment_size == block
    return layout


@pytest.mark.parametrize("nq, block, stride", [(None, 64, 16), (90, 32, 8)], ids=["prefill", "offset"])
def test_unsegmented_strided_causal_mask(nq, block, stride):
    # XAttention's estimator: GQA 4:2, batch 2, 230 keys; with 90 queries the offset (140) is not
    # a multiple of the block or the stride.
    q, k = workload(seq_len=230, seq_len_q=nq, seed=14)
    layout = _unsegmented(q, k, block)
    scale = q.shape[-1] ** -0.5
    want = reference(q, k, layout, stride, scale)
    # Four blocks per key step: the first steps of a program need no strided mask, the later do.
    for qb_per, kb_per in [(None, None), (4, 4)]:
        got = run_kernel(q, k, layout, stride, scale, query_blocks_per_program=qb_per, key_blocks_per_step=kb_per)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # The strided mask matters: the block-level allowed set alone gives other shares.
    block_level = run_kernel(q, k, layout, stride, scale, strided_causal=False)
    assert (block_level - want).abs().max() > 1e-3


def test_unsegmented_fp16_and_non_causal():
    q, k = workload(seq_len=200, seq_len_q=150, dtype=torch.float16, seed=15)
    scale = q.shape[-1] ** -0.5
    for causal in (True, False):
        layout = _unsegmented(q, k, 32, causal=causal)
        got = run_kernel(q, k, layout, 8, scale)
        torch.testing.assert_close(got, reference(q, k, layout, 8, scale), atol=1e-4, rtol=0)


def test_segmented_shares_live_on_the_candidates():
    # A segmented layout with a partial last segment (200 = 3 * 64 + 8): the shares are zero off
    # the candidates, and rows without candidates (the first segment) are all zero.
    q, k = workload(seq_len=200, seed=16)
    layout = _segmented(q, k, 32, 64)
    got = run_kernel(q, k, layout, 8, q.shape[-1] ** -0.5)
    candidates = layout.candidate_blocks().to(got.device)
    assert (got[..., ~candidates] == 0).all()
    rows = candidates.any(-1)
    torch.testing.assert_close(got[..., rows, :].sum(-1), torch.ones_like(got[..., rows, 0]), atol=1e-5, rtol=0)
    assert (got[..., ~rows, :] == 0).all()


def test_the_default_walk_is_one_pass_unless_its_scratch_exceeds_the_budget(monkeypatch):
    from pbs.kernels import antidiagonal

    q, k = workload(seq_len=200, batch=1)
    layout = _segmented(q, k, 32, 64)
    real = antidiagonal._antidiagonal_shares_kernel
    walks = []

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                walks.append(kwargs["ONE_PASS"])
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(antidiagonal, "_antidiagonal_shares_kernel", Spy())
    one = antidiagonal_block_shares(q, k, layout, 8, 0.2)
    assert walks == [True]
    # Budget below one program's scratch: two passes, the same shares.
    monkeypatch.setattr(antidiagonal, "ONE_PASS_SCRATCH_BYTES", 64)
    two = antidiagonal_block_shares(q, k, layout, 8, 0.2)
    assert walks == [True, False]
    torch.testing.assert_close(one, two, atol=2e-6, rtol=1e-5)


def test_rejects_bad_arguments():
    q, k = workload(seq_len=64, batch=1)
    layout = _segmented(q, k, 32, 64)
    with pytest.raises(ValueError, match="must divide"):
        antidiagonal_block_shares(q, k, layout, 12, 1.0)
    with pytest.raises(ValueError, match="head range"):
        antidiagonal_block_shares(q, k, layout, 8, 1.0, head_start=2, head_stop=2)
    with pytest.raises(ValueError, match="one dtype"):
        antidiagonal_block_shares(q, k.half(), layout, 8, 1.0)


def antidiagonal_compile_report() -> dict:
    """Compiles, for sm_90 (run by compile_in_subprocess), the share kernel's one-pass walk as the GPU
    would launch it (bf16, D 128, 128 strided rows x 128 strided keys, 8 warps, 3 stages), at strides
    8 and 16, with keys permuted in place, read through key indices, and unsegmented (XAttention's
    strided causal mask): registers, spills and shared memory of each. (The two-pass walk is the one
    the GPU runs and tests.)"""
    from pbs.kernels import antidiagonal
    from tests.sm90_compile import resource_usage, scratch_dir, sm90_driver

    q, k = (x.to(torch.bfloat16) for x in make_qkv(1, 4, 2, 2048, 128, seed=0)[:2])
    report = {}
    for stride in (8, 16):
        per_block = 128 // stride
        for case in ("permuted", "key_indices", "unsegmented"):
            permuter = "none" if case == "unsegmented" else "last_block"
            layout = make_layout(q, k, pbs.PBSConfig(block_size=128, segment_size=1024, permuter=permuter))
            indices = torch.arange(2048).expand(1, 4, 2048).contiguous() if case == "key_indices" else None
            compiled = []
            real = antidiagonal._antidiagonal_shares_kernel

            class CompileOnly:
                def __getitem__(self, grid):
                    def warmup(*args, **kwargs):
                        kwargs.update(num_warps=8, num_stages=3)
                        compiled.append(real.warmup(*args, grid=grid, **kwargs))
                    return warmup

            antidiagonal._antidiagonal_shares_kernel = CompileOnly()
            try:
                with sm90_driver():
                    antidiagonal.antidiagonal_block_shares(
                        q, k, layout, stride, 128 ** -0.5, key_indices=indices, one_pass=True,
                        query_blocks_per_program=128 // per_block, key_blocks_per_step=128 // per_block,
                    )
            finally:
                antidiagonal._antidiagonal_shares_kernel = real
            cubin = compiled[0].asm["cubin"]
            usage = resource_usage(cubin, scratch_dir())
            usage["DYNAMIC_SHARED"] = compiled[0].metadata.shared
            report[f"stride {stride} {case}"] = usage
    return report


def test_the_one_pass_walk_compiles_for_sm90_within_shared_memory_and_without_spills():
    # The GPU's tiling (the interpreter runs 16 x 32 tiles): 128 x 128, 8 warps, 3 stages, as
    # GPU_TILE; an H100/H200 gives a block 227 KB of shared memory.
    from tests.sm90_compile import compile_in_subprocess

    report = compile_in_subprocess("tests.test_kernel_antidiagonal:antidiagonal_compile_report")
    assert len(report) == 6
    for name, usage in report.items():
        assert usage["LOCAL"] == 0, f"register spills ({name}): {usage}"
        assert usage["SHARED"] + usage["DYNAMIC_SHARED"] <= 232448, f"shared memory ({name}): {usage}"


@pytest.mark.gpu
def test_gpu_bf16_long():
    q, k = workload(heads_q=8, heads_kv=2, seq_len=8192, head_dim=128, dtype=torch.bfloat16, batch=1, seed=12)
    config = pbs.PBSConfig(block_size=128, segment_size=1024, permuter="last_block")
    layout = make_layout(q, k, config)
    scale = q.shape[-1] ** -0.5
    want = reference(q, k, layout, 8, scale)  # fp32 from the same bf16 inputs
    got = run_kernel(q, k, layout, 8, scale)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=0)
    # The same through a segmented key permutation read via key_indices (per-head GQA).
    key_perm = segment_shuffle(1, 8, 8192, 0, layout.permutable_key_len, 1024, seed=13).to(DEVICE)
    got = run_kernel(q, k, layout, 8, scale, key_indices=key_perm.indices)
    torch.testing.assert_close(got, reference(q, key_perm.apply(k), layout, 8, scale), atol=1e-3, rtol=0)
    # XAttention's estimator (unsegmented layout, strided causal mask), with fewer queries than keys.
    q_short = q[:, :, -3000:]
    layout = make_layout(q_short, k, config.model_copy(update={"permuter": pbs.permuters.NoPermuter()}))
    got = run_kernel(q_short, k, layout, 8, scale)
    torch.testing.assert_close(got, reference(q_short, k, layout, 8, scale), atol=1e-3, rtol=0)
